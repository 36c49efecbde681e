"""Kernel tests under Triton's interpreter, in child processes.

TRITON_INTERPRET=1 only works if it is set before triton is first imported, and the pytest process has imported it
long before (transformers does), so the interpreted tests run in children started with the variable set. Each
child has one thread; several run side by side, each with its share of the work: the interpreter is slow, and the
parent only waits meanwhile (a CI machine has two cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.kernels.triton_compat import HAS_TRITON, interpreting

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


# A test that runs only in the interpreted child; and the parent's test that starts the children.
interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")
in_parent = pytest.mark.skipif(interpreting(), reason="already under the interpreter")


def skip_without_triton() -> None:
    """Skip the calling test module (at its import) where triton is not installed."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)


def interpreter_env() -> dict[str, str]:
    """The environment of an interpreted child: this checkout and tests/ importable, one thread."""
    paths = [str(REPO), str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))


def run_side_by_side(commands: Sequence[list[str]], timeout: float = 900) -> list[tuple[int, str, str]]:
    """Start every command at once under interpreter_env(), from the repository root: (return code, stdout, stderr)
    of each, in order. A child still running when this returns or raises (a timeout) is killed."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=interpreter_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in commands]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
        return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def split_by(first: str) -> tuple[str, str]:
    """Two -k selections that share a module's tests between two children: `first`, and everything else (so no
    test is left out, whatever is added later)."""
    return first, f"not ({first})"


def assert_pytest_children_pass(test_file: str, selections: Sequence[str | None] = (None,),
                                timeout: float = 900) -> None:
    """Run `test_file`'s tests in one child pytest per -k selection (None: all of them), side by side; fail with a
    child's output if any of its tests failed or none ran."""
    base = [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-x", "-p", "no:cacheprovider",
            "--noconftest"]  # --noconftest: the shared fixtures (they import transformers) are not needed there
    cmds = [base + (["-k", sel] if sel else []) for sel in selections]
    for sel, (rc, out, err) in zip(selections, run_side_by_side(cmds, timeout)):
        where = f"{Path(test_file).name} [{sel or 'all'}] under the interpreter"
        assert rc == 0, f"{where}:\n{out[-6000:]}\n{err[-3000:]}"
        assert " passed" in out and " failed" not in out, f"{where}:\n{out[-2000:]}"
