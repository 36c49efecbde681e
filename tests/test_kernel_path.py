"""The engine's kernel path (input buffers at fixed addresses, the Triton kernels, the buffer-based draft loop
with its in-place metadata rebuild) on CPU through Triton's interpreter: the same code CUDA runs, minus the
graphs (tests/gpu covers those). Child processes run the cases, one per family (see kernel_path_run.py for why)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from interpreter_children import run_side_by_side

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install '.[test]')")


FAMILIES = ("mistral", "gemma3")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Both families' results, one interpreted child per family, side by side (tests/interpreter_children.py)."""
    script = str(Path(__file__).resolve().parent / "kernel_path_run.py")
    cmds = [[sys.executable, script, str(tmp_path_factory.mktemp("kp")), fam] for fam in FAMILIES]
    out: dict = {"generate": {}, "draft_loop": {}}
    for fam, (rc, stdout, stderr) in zip(FAMILIES, run_side_by_side(cmds)):
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert rc == 0 and lines, f"{fam}: {stderr[-3000:]}"
        res = json.loads(lines[-1][len("RESULT "):])
        for part in out:
            out[part].update(res[part])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_path_greedy_equals_torch_path(results, family):
    """Target alone and with a draft, on the kernel path, token for token equal to the torch reference path
    (itself checked against HF elsewhere); the sliding windows (mistral 7, gemma3 6) are shorter than the
    sequences, and gemma3 has two KV-cache groups."""
    res = results["generate"][family]
    ref = res["torch"]
    # Fewer tokens than the reference's (greedy: a prefix of it), still past the windows; the speculation ahead case
    # below runs its own length (the reference's for the Mistral pair).
    n = res["tokens"]
    assert n > 7 and all(len(ids) >= n for ids in ref)
    assert res["triton"] == res["triton+spec"] == res["torch+spec"] == [ids[:n] for ids in ref]
    # Both paths see the same drafts, so they accept the same share of them; and speculation did happen.
    assert res["triton+spec:acceptance"] == res["torch+spec:acceptance"] > 0.3
    # Speculation ahead with four windows per request, through the draft loop: windows hit, rejection windows (in
    # scratch blocks) too where the draft's runner-up guesses the target's token (the Mistral pair; the Gemma 3
    # pair's rejections are too few here).
    n_ahead = res["ahead_tokens"]
    assert n_ahead >= 7 and all(len(ids) >= n_ahead for ids in ref)
    assert res["triton+ahead4"] == [ids[:n_ahead] for ids in ref]
    hits_accept, hits_reject = res["triton+ahead4:hits"]
    assert hits_accept > 0 and (hits_reject > 0 or family == "gemma3"), res["triton+ahead4:hits"]
    if family == "mistral":  # the persistent decoder (engine/kernels/persistent/decoder.py), window shorter than
        # the sequences: a target's decode steps and a draft's steps ran through it
        n_short = res["persistent_tokens"]  # fewer tokens than above, still past the window (greedy: a prefix of ref)
        assert n_short >= 6  # the 3-token prompt's last decode step at position 7: its window leaves position 0
        assert res["triton+persistent"] == res["triton+spec+persistent"] == [ids[:n_short] for ids in ref]
        assert all(n > 0 for n in res["persistent_calls"]), res["persistent_calls"]


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_loop_rebuilds_metadata_every_step(results, family):
    """Six draft steps from positions 5, 6 and 9 with 4-token blocks and 5-7-token windows: every loop crosses
    block boundaries and moves the window start. A step that reused stale slots or positions would store K/V
    over an earlier token or rotate by the wrong angle, and its tokens would leave HF's greedy ones."""
    res = results["draft_loop"][family]
    assert res["loop"] == res["hf"]
    assert res["padding"] == [[], [-1, -1], []]  # a row with fewer drafts reports only its own
