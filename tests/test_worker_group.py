"""How the Ray executor builds its worker groups (serving/workers/group.py), without Ray: where the draft drafts ahead,
where the target's ranks launch the verify ahead, and which tensor-parallel sizes a model splits into."""

from __future__ import annotations

import pytest
from conftest import TinyModel

from engine.model_config import ModelConfig
from serving.workers.group import check_tensor_parallel, launch_verify_ahead_for, speculation_ahead_for


def test_speculation_ahead_only_where_the_draft_has_gpus_of_its_own() -> None:
    whole = {"GPU": 1, "CPU": 1}
    assert speculation_ahead_for(None, "cuda", [whole, whole])
    assert not speculation_ahead_for(None, "cuda", [{"GPU": 0.75}, {"GPU": 0.25}])
    assert not speculation_ahead_for(None, "cpu", [{"CPU": 1}, {"CPU": 1}])
    assert speculation_ahead_for(True, "cpu", [{"CPU": 1}, {"CPU": 1}])
    assert not speculation_ahead_for(False, "cuda", [whole, whole])


def test_verify_launched_ahead_only_where_no_gpu_is_shared() -> None:
    whole, cpu = {"GPU": 1, "CPU": 1}, {"CPU": 1}
    assert launch_verify_ahead_for(None, "cuda", [whole, whole], use_compiled_graph=True)
    assert not launch_verify_ahead_for(None, "cuda", [{"GPU": 0.75}, {"GPU": 0.25}], use_compiled_graph=True)
    assert not launch_verify_ahead_for(None, "cuda", [whole], use_compiled_graph=True)  # no draft
    assert not launch_verify_ahead_for(None, "cuda", [whole, whole], use_compiled_graph=False)  # no prepare node
    assert not launch_verify_ahead_for(None, "cpu", [cpu, cpu], use_compiled_graph=True)
    assert launch_verify_ahead_for(True, "cuda", [{"GPU": 0.75}, {"GPU": 0.25}], use_compiled_graph=True)
    assert not launch_verify_ahead_for(False, "cuda", [whole, whole], use_compiled_graph=True)


def test_tensor_parallel_sizes_are_checked_before_any_worker_starts(tiny_models: dict[str, TinyModel]) -> None:
    cfg = ModelConfig.from_path(tiny_models["llama"].path)  # 4 heads, 2 KV heads, intermediate 128
    check_tensor_parallel(cfg, 4, "target")  # KV heads replicated twice
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by tensor_parallel_size=3"):
        check_tensor_parallel(cfg, 3, "target")
    with pytest.raises(ValueError, match="attention heads"):
        check_tensor_parallel(cfg, 8, "draft")
