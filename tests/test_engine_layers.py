"""Imports inside engine/ run one way: every module sits in a layer (LAYERS, lowest first) and imports only from its
own layer or lower ones, counting imports inside functions too. Names imported only for type annotations (under
`if TYPE_CHECKING:`) are not imports at run time and may name a higher layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    ("engine.host_copy", "engine.parallel", "engine.draft_schedule", "engine.agreement_profile", "engine.gc_heap"),
    ("engine.kernels",),
    # Weight formats (FP8, MXFP4) and the loader's seam: their products are kernels; the config validates them.
    ("engine.quantization",),
    ("engine.config", "engine.model_config"),
    ("engine.sample",),
    ("engine.request", "engine.request_limits"),
    ("engine.kv_cache",),
    ("engine.attention",),
    ("engine.models",),
    ("engine.runner",),
    ("engine.scheduler", "engine.detokenizer"),
    ("engine.step",),
    # The core step's parts: proposer, draft loop, verifier, rejection sampling, step order.
    ("engine.speculation",),
    # Speculation ahead builds on the core proposer; the speculative step composes the two.
    ("engine.speculation.ahead",),
    ("engine.speculation.speculative_step",),
    ("engine.decode_pipeline", "engine.local_executor", "engine.model_setup", "engine.engine_core"),
    ("engine.llm",),
    ("engine.distill", "engine"),
]


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    return layer


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(source: str) -> list[tuple[str, bool]]:
    """(imported engine module, type-only) for every import of engine modules in `source`, lazy ones included."""
    tree = ast.parse(source)
    typed = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from engine.x import y` may import the module engine.x.y: count the deepest module it names.
            names = [f"{node.module}.{a.name}" if (ROOT / (node.module.replace(".", "/") + f"/{a.name}.py")).exists()
                     else node.module for a in node.names]
        else:
            continue
        out += [(n, id(node) in typed) for n in names if n == "engine" or n.startswith("engine.")]
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    """'importer -> imported' for every run-time import from a lower layer to a higher one."""
    found = []
    for f in sorted((root / "engine").rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for target, type_only in imports_of(f.read_text()):
            if not type_only and layer_of(target) > layer_of(module):
                found.append(f"{module} -> {target}")
    return sorted(set(found))


def test_engine_imports_run_one_way() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_import_back_up() -> None:
    # A kernel importing the speculation step is the kind of import the rule forbids; a lazy one counts too.
    assert layer_of("engine.kernels.speculation.rejection") < layer_of("engine.speculation.rejection_sampler")
    src = "def f():\n    from engine.speculation.rejection_sampler import rejection_sample\n"
    assert imports_of(src) == [("engine.speculation.rejection_sampler", False)]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.models.layers import RMSNorm\n"
    assert imports_of(typed) == [("engine.models.layers", True)]
    assert layer_of("engine.speculation.ahead.tree") > layer_of("engine.speculation.proposer")
    assert layer_of("engine.speculation.speculative_step") > layer_of("engine.speculation.ahead.proposer")


def test_every_module_has_a_layer() -> None:
    for f in (ROOT / "engine").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        layer_of(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    with pytest.raises(KeyError, match="no layer"):
        layer_of("elsewhere.module")


if __name__ == "__main__":
    print("\n".join(upward_imports()) or "no import runs back up inside engine/")
