"""EAGLE-3 heads served: vLLM's `--speculative-config '{"method": "eagle3", ...}'` read into the engine's options and
honoured by the offline engine built from the flags, and the Ray engine running the head inside the target's worker
(draft_placement colocated, the default for a head) with greedy output equal to the target alone, Llama and Qwen3
targets; a head split over
the target's two tensor-parallel ranks drafting what one process's head drafts; and a head on workers of its own
(draft_placement separate: the target's states travel with each result) drafting what one process's head drafts,
sync, and with greedy output equal to the target alone, async."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest import local_ray, run_to_completion
from eagle3_support import random_head, write_flat, write_speculators
from spec_support import ENGINE_KW, GREEDY, PROMPTS

from deploy.cli import _given, build_parser
from deploy.config import ServeConfig
from engine import LLM
from engine.speculation.eagle3_proposer import Eagle3Proposer
from serving.engine_factory import build_ray_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_heads(tiny_models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle3-served")
    w = random_head(tiny_models["llama"].config, seed=1)
    return {"flat": write_flat(w, root / "flat"), "speculators": write_speculators(w, root / "spec")}


@pytest.fixture(scope="module")
def qwen3_heads(tiny_models, tmp_path_factory) -> dict[str, str]:
    """For the Qwen3 target: a speculators head whose layer is a Qwen3 one (q/k norms), and a flat one (a Llama
    layer, as SpecForge trains for Qwen3 targets)."""
    root = tmp_path_factory.mktemp("eagle3-served-qwen3")
    cfg = tiny_models["qwen3"].config
    return {"speculators": write_speculators(random_head(cfg, seed=2, layer_type="qwen3"), root / "spec"),
            "flat": write_flat(random_head(cfg, seed=3), root / "flat")}


def test_speculative_config_flag_selects_the_head(tiny_models, llama_heads, target_greedy):
    spec = {"method": "eagle3", "model": llama_heads["flat"], "num_speculative_tokens": 2}
    args = build_parser().parse_args(["generate", "--prompt", "x", "--model", tiny_models["llama"].path,
                                      "--speculative-config", json.dumps(spec), "--device", "cpu",
                                      "--block-size", "4", "--max-model-len", "64",
                                      "--max-num-batched-tokens", "20", "--no-adaptive-draft-length"])
    cfg = ServeConfig.from_dict(_given(args))
    assert (cfg.speculative_method, cfg.draft_model) == ("eagle3", llama_heads["flat"])
    llm = LLM(**cfg.engine_args())
    assert isinstance(llm.executor.proposer, Eagle3Proposer)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy("llama")
    assert llm.spec_stats(outs).num_draft_tokens > 0
    with pytest.raises(ValueError, match="method 'medusa' is not supported"):
        ServeConfig.from_dict({"speculative_config": {"method": "medusa", "model": "d"}})
    with pytest.raises(ValueError, match="unknown key.*'typo'"):
        ServeConfig.from_dict({"speculative_config": {"method": "eagle3", "model": "d", "typo": 1}})


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    with local_ray(num_cpus=4):
        yield


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_served_greedy_equals_target(ray_runtime, tiny_models, llama_heads, qwen3_heads, target_greedy, family):
    """One served case a target family (Ray's start dominates its time): a speculators head (its layer the
    family's), asynchronous scheduling (the Ray executor's default); the in-process tests cover both formats, sync
    and async, and the flat format is served below (a head apart)."""
    heads = {"llama": llama_heads, "qwen3": qwen3_heads}[family]
    engine = build_ray_engine(tiny_models[family].path, heads["speculators"], speculative_method="eagle3",
                              num_speculative_tokens=3, seed=5, adaptive_draft_length=False, **ENGINE_KW)
    try:
        assert engine.executor.colocated  # the head runs where the target's hidden states are
        assert engine.async_scheduling
        reqs = run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))
        assert [r.output_token_ids for r in reqs] == target_greedy(family)
        assert sum(r.spec.num_draft_tokens for r in reqs) > 0
    finally:
        engine.executor.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_head_on_workers_of_its_own(ray_runtime, tiny_models, llama_heads, qwen3_heads, target_greedy,
                                    async_scheduling):
    """draft_placement separate: the head's rank reads each forward's states from target rank 0's result. Sync, under
    synthetic acceptance, the output is the accepted drafts, so it equals one process's only if the head apart drafts
    the same tokens (states lost or misaligned on the way would change them): a Llama target; async, strict, greedy
    output is the target's: a Qwen3 target."""
    family = "qwen3" if async_scheduling else "llama"
    target, head = tiny_models[family].path, {"llama": llama_heads, "qwen3": qwen3_heads}[family]["flat"]
    kw = dict(ENGINE_KW, adaptive_draft_length=False, seed=5)
    if not async_scheduling:
        kw.update(rejection_sampling="synthetic", synthetic_acceptance_rate=0.6)
    engine = build_ray_engine(target, head, speculative_method="eagle3", num_speculative_tokens=3,
                              draft_placement="separate", async_scheduling=async_scheduling, **kw)
    try:
        assert not engine.executor.colocated and engine.executor.draft is not None
        reqs = run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    finally:
        engine.executor.shutdown()
    if async_scheduling:
        assert [r.output_token_ids for r in reqs] == target_greedy(family)
        assert sum(r.spec.num_draft_tokens for r in reqs) > 0
        return
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    one = LLM(target, speculative_config=spec, **kw).generate(PROMPTS, GREEDY)
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in one]
    assert sum(r.spec.num_accepted_tokens for r in reqs) > 10


def test_head_placement_refused_where_it_cannot_run():
    from serving.workers.group import draft_placement_of

    with pytest.raises(ValueError, match="cannot be a draft pool's"):
        draft_placement_of("auto", True, True, True, "cpu", 1, 1, False)


def test_head_split_over_two_ranks_drafts_as_one(ray_runtime, tiny_models, llama_heads):
    """Target and head at tensor_parallel_size 2 (each rank half the head's attention heads, MLP and draft vocabulary,
    the auxiliary states the replicated residual stream): under synthetic acceptance the accepted drafts are the
    output, so it equals one process's only if the split head drafts the same tokens. Synchronous scheduling on both
    sides (the acceptance draws then come in one order)."""
    kw = dict(ENGINE_KW, adaptive_draft_length=False, rejection_sampling="synthetic", synthetic_acceptance_rate=0.6,
              seed=5)
    spec = {"method": "eagle3", "model": llama_heads["flat"], "num_speculative_tokens": 3}
    one = LLM(tiny_models["llama"].path, speculative_config=spec, **kw).generate(PROMPTS, GREEDY)
    engine = build_ray_engine(tiny_models["llama"].path, llama_heads["flat"], speculative_method="eagle3",
                              num_speculative_tokens=3, tensor_parallel_size=2, async_scheduling=False, **kw)
    try:
        assert engine.executor.colocated and len(engine.executor.target.workers) == 2
        reqs = run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    finally:
        engine.executor.shutdown()
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in one]
    assert sum(r.spec.num_accepted_tokens for r in reqs) > 10
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be tensor_parallel_size"):
        build_ray_engine(tiny_models["llama"].path, llama_heads["flat"], speculative_method="eagle3",
                         tensor_parallel_size=2, draft_tensor_parallel_size=3, **ENGINE_KW)
