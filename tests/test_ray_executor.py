"""The Ray executor on a real local Ray runtime: target and draft worker actors, tensor parallel over gloo,
steps dispatched through a Ray Compiled Graph or plain actor calls, against the in-process engine.

Greedy outputs must equal engine.LLM's token for token: tensor parallelism only changes the order of float
sums, and the tiny models' scaled-up weights give next-token distributions too peaked for that to flip an
argmax. Sampled outputs (temperature > 0) must be identical between the compiled graph and plain calls,
which run the same worker code on the same seeds. Small blocks, a short max_model_len and a token budget
below the longest prompt make steps cross block boundaries and mix prefill chunks with (speculative) decodes.
Without Ray: the workers' step methods in tests/test_worker_replay.py, how their groups are built in
tests/test_worker_group.py.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator

import pytest
import ray
import torch
from conftest import TinyModel, hf_greedy, local_ray, random_prompts, run_to_completion
from moe_support import gpt_oss_config, make_model, save_packed_copy

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from engine.request import Request
from engine.speculation.ahead.budget import AheadBudget
from engine.step.plan import StepPlan, StepResult
from serving.engine_factory import build_ray_engine
from serving.thread_switch import DEFAULT_GIL_SWITCH_INTERVAL_S
from serving.workers.health import WorkerDiedError
from serving.workers.ray_executor import RayExecutor

PROMPTS = random_prompts([3, 9, 17], seed=5)
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# k stays at num_speculative_tokens: these tests check what speculation does across processes, and the draft length
# rule (measured costs) would turn these tiny drafts off part-way through, on timing alone.
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20, adaptive_draft_length=False)


@pytest.fixture(scope="module", autouse=True)
def ray_runtime() -> Iterator[None]:
    # 4 CPUs of bookkeeping on a 2-core box: each worker runs one torch thread and the models are tiny.
    with local_ray(num_cpus=4):
        yield


def greedy_tokens(engine: EngineCore) -> list[list[int]]:
    return [r.output_token_ids for r in run_to_completion(engine, PROMPTS, [GREEDY] * len(PROMPTS))]


def llm_greedy(path: str) -> list[list[int]]:
    return [o.token_ids for o in LLM(path, **ENGINE_KW).generate(PROMPTS, GREEDY)]


def test_target_only_tp1_matches_llm(tiny_models: dict[str, TinyModel]) -> None:
    path = tiny_models["llama"].path
    engine = build_ray_engine(path, **ENGINE_KW)
    try:
        assert greedy_tokens(engine) == llm_greedy(path)
        phases = engine.last_step.phase_seconds
        assert {"verify", "sample", "dispatch"} <= phases.keys() and "propose" not in phases
        # The worker process switches threads every 200 us, not Python's 5 ms (see set_gil_switch_interval).
        interval = ray.get(engine.executor.target.workers[0].__ray_call__.remote(lambda self: sys.getswitchinterval()))
        assert interval == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_S)
        # Its startup heap (torch, the model) is frozen out of garbage collection (engine/gc_heap.py); a frozen
        # object freed by its reference count since leaves the count.
        info = ray.get(engine.executor.target.workers[0].info.remote())
        frozen = ray.get(engine.executor.target.workers[0].__ray_call__.remote(lambda self: gc.get_freeze_count()))
        assert info.gc_frozen > 10_000 and frozen > 0.9 * info.gc_frozen, (frozen, info.gc_frozen)
    finally:
        engine.executor.shutdown()


def test_target_tp2_matches_tp1_and_dies_loudly(tiny_models: dict[str, TinyModel]) -> None:
    path = tiny_models["llama"].path
    engine = build_ray_engine(path, tensor_parallel_size=2, **ENGINE_KW)
    executor = engine.executor
    assert isinstance(executor, RayExecutor)
    try:
        assert greedy_tokens(engine) == llm_greedy(path)
        executor.check_health()
        # A dead rank: the health check names it, and the next step fails with the same clear error
        # instead of hanging in the compiled graph or in the surviving rank's collectives.
        ray.kill(executor.target.workers[1])
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerDiedError, match="target worker rank 1 of 2 has died"):
            while time.monotonic() < deadline:  # the kill is asynchronous
                executor.check_health()
                time.sleep(0.2)
        engine.add_request(Request("after-kill", PROMPTS[0], GREEDY))
        with pytest.raises(WorkerDiedError, match="rank 1 of 2"):
            # With asynchronous scheduling the first step is only submitted; collecting it (at the latest on the
            # next call) raises.
            for _ in range(2):
                engine.step()
    finally:
        executor.shutdown()
    with pytest.raises(WorkerDiedError):
        executor.execute(engine.make_plan([]))


def test_target_alone_pipelined_tp2_compiled_plain_and_in_process_agree(tiny_models: dict[str, TinyModel]) -> None:
    """A target alone under asynchronous scheduling queues each step before the last one's tokens are read
    (engine/decode_pipeline.py); each execution returns the step before's result, and the last is collected by an
    empty one. At TP=2, through the compiled graph and through plain calls, every output (greedy, seeded and
    unseeded sampling) equals the in-process pipelined engine's, and greedy equals the target step by step."""
    path = tiny_models["gemma3"].path
    sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=s, ignore_eos=True) for s in (1, None)]
    prompts = PROMPTS + PROMPTS[:2]
    params = [GREEDY] * len(PROMPTS) + sampled
    local = LLM(path, seed=7, async_scheduling=True, **ENGINE_KW)
    expected = [o.token_ids for o in local.generate(prompts, params)]
    assert local.engine.executor.pipeline.num_queued_ahead > 0
    assert expected[:len(PROMPTS)] == llm_greedy(path)
    for compiled in (True, False):
        engine = build_ray_engine(path, tensor_parallel_size=2, use_compiled_graph=compiled, seed=7, **ENGINE_KW)
        try:
            assert engine.executor.pipelined
            reqs = run_to_completion(engine, prompts, params)
            queued = ray.get([w.__ray_call__.remote(lambda self: self.pipeline.num_queued_ahead)
                              for w in engine.executor.target.workers])
        finally:
            engine.executor.shutdown()
        assert [r.output_token_ids for r in reqs] == expected, compiled
        assert queued[0] == queued[1] > len(reqs), queued  # both ranks queued alike, most steps ahead


def test_gpt_oss_with_mxfp4_experts_over_two_ranks(tmp_path_factory) -> None:
    """A packed GPT-OSS (MXFP4 experts, attention sinks, sliding and full layers) at tensor_parallel_size 2: each
    rank holds half of every expert's intermediate features (one MXFP4 block of two) and half the heads and sinks,
    the ranks' expert outputs summed by the layer's all-reduce; greedy output equals HF's on the dequantized copy."""
    root = tmp_path_factory.mktemp("gpt_oss_tp")
    m = make_model(root, "source", gpt_oss_config())
    packed, _ = save_packed_copy(m, root)
    engine = build_ray_engine(packed, tensor_parallel_size=2, **ENGINE_KW)
    try:
        got = greedy_tokens(engine)
        shards = [ray.get(w.__ray_call__.remote(lambda self: self.runner.model.model.layers[0].mlp.experts.shard))
                  for w in engine.executor.target.workers]
    finally:
        engine.executor.shutdown()
    assert shards == [(0, 32), (32, 64)]
    assert got == [hf_greedy(m.hf, p, NEW_TOKENS) for p in PROMPTS]


def test_random_weights_are_the_same_model_at_every_tensor_parallel_size(tiny_models: dict[str, TinyModel]) -> None:
    """load_format "dummy" (how the GPU benchmarks run 8B shapes) draws each checkpoint tensor whole and shards
    it like real weights: TP=2 workers hold the same model as the in-process engine, not a different random one.
    The gemma3 config has two KV-cache groups, q/k norms and 4 heads over 2 ranks."""
    path = tiny_models["gemma3"].path
    offline = [o.token_ids for o in LLM(path, load_format="dummy", **ENGINE_KW).generate(PROMPTS, GREEDY)]
    assert offline != llm_greedy(path)  # random weights, not the checkpoint's
    engine = build_ray_engine(path, tensor_parallel_size=2, load_format="dummy", **ENGINE_KW)
    try:
        assert greedy_tokens(engine) == offline
    finally:
        engine.executor.shutdown()


def test_speculation_with_draft_tp2_compiled_equals_plain(tiny_models: dict[str, TinyModel],
                                                          near_llama: str) -> None:
    """Draft at TP=2, target at TP=1, k=3, probabilistic rejection: greedy equals target-only greedy, and every
    output (greedy, seeded and unseeded sampling) is identical with the compiled graph and plain actor calls."""
    target = tiny_models["llama"].path
    expected = llm_greedy(target)
    sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=s, ignore_eos=True) for s in (1, None)]
    prompts = PROMPTS + PROMPTS[:2]
    params = [GREEDY] * len(PROMPTS) + sampled
    outputs = {}
    for compiled in (True, False):
        engine = build_ray_engine(target, near_llama, num_speculative_tokens=3, rejection_sampling="probabilistic",
                                  draft_tensor_parallel_size=2, use_compiled_graph=compiled, seed=7, **ENGINE_KW)
        try:
            reqs = run_to_completion(engine, prompts, params)
            assert engine.last_step.phase_seconds.get("propose", 0) > 0
        finally:
            engine.executor.shutdown()
        assert [r.output_token_ids for r in reqs[:len(PROMPTS)]] == expected
        assert sum(r.spec.num_accepted_tokens for r in reqs) > 0  # accepted runs were exercised
        outputs[compiled] = [(r.output_token_ids, r.spec.num_accepted_tokens) for r in reqs]
    assert outputs[True] == outputs[False]


def test_gemma3_hybrid_tp2_with_replicated_kv_draft(tiny_models: dict[str, TinyModel],
                                                    tiny_drafts: dict[str, TinyModel]) -> None:
    """Gemma 3 target (sliding + full: two KV-cache groups) at TP=2, and a 1-layer Llama draft with a single KV
    head at TP=2 (the KV head is replicated on both ranks). Every step's verify input is built by the graph's
    prepare node on both target ranks, before the proposal arrives, and the drafts written into it later. Launching
    the forward ahead too is asked for, and stays off: it needs CUDA graphs."""
    target = tiny_models["gemma3"].path
    engine = build_ray_engine(target, tiny_drafts["llama-1l"].path, num_speculative_tokens=3,
                              tensor_parallel_size=2, draft_tensor_parallel_size=2, launch_verify_ahead=True,
                              **ENGINE_KW)
    try:
        executor = engine.executor
        assert len(executor.target_kv_groups) == 2
        # Per-rank head counts size the caches: 2 KV heads / 2 ranks, 1 KV head replicated.
        assert {g.spec.num_kv_heads for g in executor.target_kv_groups} == {1}
        assert [g.spec.num_kv_heads for g in executor.draft_kv_groups] == [1]
        steps: list[StepResult] = []
        collect = executor.collect
        executor.collect = lambda h: steps.append(collect(h)) or steps[-1]  # type: ignore[method-assign]
        assert greedy_tokens(engine) == llm_greedy(target)
        ahead = ray.get([w.__ray_call__.remote(lambda self: self.num_prepared_ahead) for w in executor.target.workers])
        assert ahead == [len(steps), len(steps)]
        launched = ray.get([w.__ray_call__.remote(lambda self: (self.launch_verify_ahead, self.num_launched_ahead))
                            for w in executor.target.workers])
        assert launched == [(False, 0), (False, 0)]
        # Built ahead, the input costs the step only the drafts' copy into it: not the whole build.
        assert all(s.phase_seconds["prepare"] < s.phase_seconds["verify"] + s.phase_seconds["sample"] for s in steps)
    finally:
        engine.executor.shutdown()


@pytest.mark.parametrize("compiled", [True, False])
def test_async_scheduling_and_speculation_ahead_tp2_both_sides_hybrid_draft(
        tiny_models: dict[str, TinyModel], near_drafts: dict[str, TinyModel], compiled: bool) -> None:
    """Asynchronous scheduling and speculation ahead across processes: Gemma 3 target (two KV-cache groups) at TP=2
    with a Gemma 3 hybrid draft (its own sliding and full groups) at TP=2, through the compiled graph and through
    plain actor calls. Greedy equals the in-process target alone; steps really go out before their predecessors'
    tokens came back, their decodes open (resolved by the workers' tables, the draft's fed by target rank 0's
    result); windows drafted ahead are proposed (hits, on both draft ranks alike); every rank's table forgets the
    requests once they end; sampled outputs are the same on both paths. Through plain actor calls the draft drafts
    ahead in tree mode (a tree a request and step, the draft at TP=2: both ranks draft the same trees, and a hit
    is what the proposal would have drafted, so seeded sampled outputs equal the compiled run's windows')."""
    target, draft = tiny_models["gemma3"].path, near_drafts["gemma3"].path
    tree = {} if compiled else dict(speculation_ahead_tree_fanout=2, speculation_ahead_adaptive=False)
    engine = build_ray_engine(target, draft, num_speculative_tokens=3, rejection_sampling="probabilistic",
                              tensor_parallel_size=2, draft_tensor_parallel_size=2, use_compiled_graph=compiled,
                              seed=5, speculation_ahead=True, **tree, **ENGINE_KW)
    executor = engine.executor
    try:
        assert engine.async_scheduling and executor.async_scheduling and executor.speculation_ahead
        assert engine.scheduler.speculation_ahead
        plans: list[StepPlan] = []
        submit = executor.submit
        executor.submit = lambda plan: plans.append(plan) or submit(plan)  # type: ignore[method-assign]
        assert greedy_tokens(engine) == llm_greedy(target)
        assert sum(p.token_ids is None for plan in plans for p in plan.requests) > len(plans) // 2
        sampled = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
        reqs = run_to_completion(engine, PROMPTS[:2], sampled)
        # Prompt logprobs come from target rank 0's verifier, across the prompt's chunks (PROMPTS[2] is longer than
        # the token budget): HF's log_softmax at each position.
        scored = run_to_completion(engine, PROMPTS[1:], [SamplingParams(max_tokens=2, prompt_logprobs=2)] * 2)
        for r, prompt in zip(scored, PROMPTS[1:]):
            with torch.no_grad():
                ref = torch.log_softmax(tiny_models["gemma3"].hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
            assert [lp for lp, _, _ in r.prompt_logprobs] == pytest.approx(
                [ref[j, t].item() for j, t in enumerate(prompt[1:])], abs=2e-4)
            assert [v for _, _, top in r.prompt_logprobs for _, v in top] == pytest.approx(
                ref.topk(2, dim=-1).values.flatten().tolist(), abs=2e-4)
        # One more request's plans carry the finished ids: then every rank remembers that request alone.
        last = run_to_completion(engine, [PROMPTS[0]], [SamplingParams(max_tokens=2, ignore_eos=True)])[0]
        known = ray.get([w.__ray_call__.remote(lambda self: sorted(self.table.requests)) for _, _, w in
                         executor.workers()])
        assert known == [[last.request_id]] * 4
        result = [r.output_token_ids for r in reqs]
        ahead = ray.get([w.__ray_call__.remote(lambda self: self.ahead.stats.as_tuple())
                         for role, _, w in executor.workers() if role == "draft"])
        assert ahead[0] == ahead[1] and ahead[0][1] > 0, ahead  # the ranks agree, and windows hit
        assert (ahead[0][5] > 0) == bool(tree), ahead  # trees drafted (tree mode only)
        assert engine.speculation_ahead_stats()[1] > 0
    finally:
        executor.shutdown()
    assert all(len(t) == NEW_TOKENS for t in result)
    key = "tp2-hybrid-sampled"
    _SAMPLED.setdefault(key, result)
    assert _SAMPLED[key] == result  # compiled graph and plain calls run the same worker code on the same seeds


_SAMPLED: dict[str, list[list[int]]] = {}


def test_speculation_ahead_with_synchronous_scheduling(tiny_models: dict[str, TinyModel], near_llama: str) -> None:
    """Without asynchronous scheduling the window ahead is keyed by the next plan's explicit entries: greedy still
    equals the target alone, windows hit, and the engine reports the draft's counters (with fan-out: the next
    test)."""
    target = tiny_models["llama"].path
    engine = build_ray_engine(target, near_llama, num_speculative_tokens=3, seed=5, async_scheduling=False,
                              speculation_ahead=True, **ENGINE_KW)
    try:
        assert not engine.async_scheduling and engine.executor.speculation_ahead
        assert greedy_tokens(engine) == llm_greedy(target)
        lookups, hits, drafted, unused, _skipped, *_ = engine.speculation_ahead_stats()
        assert 0 < hits <= lookups and 0 < drafted and unused <= drafted
        scratch, hits_reject = ray.get(engine.executor.draft.workers[0].__ray_call__.remote(
            lambda self: (self.ahead.scratch.capacity, self.ahead.stats.hits_reject)))
        assert scratch == hits_reject == 0  # one window a request reserves no scratch and drafts no rejection
    finally:
        engine.executor.shutdown()


def test_tree_mode_across_processes(tiny_models: dict[str, TinyModel], near_llama: str) -> None:
    """Speculation ahead's tree mode with the draft on a worker of its own (asynchronous scheduling): the same
    AheadProposer runs `draft_speculate_ahead` there, trees hit (rejection outcomes included), greedy equals the target
    alone, and the engine reports the tree counters with the others. Its trees overlap the verify, so the ahead budget
    sizes them from the (nodes, seconds) the draft reports through the target's result, and every plan carries the
    cap (engine/speculation/ahead/budget.py); held at the configured fan-out, rejection outcomes hit."""
    target = tiny_models["llama"].path
    engine = build_ray_engine(target, near_llama, num_speculative_tokens=3, seed=5, speculation_ahead=True,
                              speculation_ahead_tree_fanout=2, **ENGINE_KW)
    executor = engine.executor
    try:
        assert engine.async_scheduling and executor.speculation_ahead
        assert engine.speculation_ahead.budget.adaptive and engine.speculation_ahead.budget.tree
        plans: list[StepPlan] = []
        make_plan = engine.make_plan
        engine.make_plan = lambda *a, **kw: plans.append(make_plan(*a, **kw)) or plans[-1]  # type: ignore
        assert greedy_tokens(engine) == llm_greedy(target)
        budget = engine.speculation_ahead.budget
        assert budget.node_seconds is not None and budget.node_seconds.value > 0 and budget.shadow is not None
        caps = [p.ahead_tree_nodes for p in plans if any(r.num_draft_tokens for r in p.requests)]
        assert caps and all(c is not None and c >= 0 for c in caps), caps
        # The draft's own cap: F = 2 every step.
        engine.speculation_ahead.budget = AheadBudget(1, adaptive=False, tree=True)
        assert greedy_tokens(engine) == llm_greedy(target)
        stats = ray.get(engine.executor.draft.workers[0].__ray_call__.remote(lambda self: self.ahead.stats))
        assert stats.trees > 0 and stats.hits_reject > 0, stats
        totals = engine.speculation_ahead_stats()  # as of the last result (the last pre-draft came after it)
        assert totals[:2] == (stats.lookups, stats.hits) and 0 < totals[5] <= stats.trees
    finally:
        engine.executor.shutdown()


def test_fan_out_across_processes(tiny_models: dict[str, TinyModel], near_llama: str) -> None:
    """Three windows a request (engine_kwargs' speculation_ahead_branches), synchronous scheduling, the draft in a
    group of its own: the draft worker keeps scratch blocks out of the ones it reports; its runs ahead overlap the
    verify, so the engine adapts the fan-out (engine/speculation/ahead/budget.py) from the runs the draft's rank 0
    reports
    through the target's result, and every plan carries its count to the draft's ranks, which obey it: at three
    every step rejection windows hit, held at one none is drafted. Greedy equals the target alone throughout."""
    target = tiny_models["llama"].path
    engine = build_ray_engine(target, near_llama, num_speculative_tokens=3, seed=5, async_scheduling=False,
                              speculation_ahead=True, speculation_ahead_branches=3, **ENGINE_KW)
    executor = engine.executor
    worker = executor.draft.workers[0]

    def draft_stats() -> tuple[int, int]:
        return ray.get(worker.__ray_call__.remote(lambda self: (self.ahead.stats.hits, self.ahead.stats.hits_reject)))

    try:
        assert executor.ahead_overlaps_verify and engine.speculation_ahead.budget.adaptive
        scratch, num_blocks = ray.get(worker.__ray_call__.remote(
            lambda self: (self.ahead.scratch.capacity, self.runner.num_blocks)))
        assert scratch > 0 and executor.draft_num_blocks == num_blocks
        plans: list[StepPlan] = []
        execute = executor.execute
        executor.execute = lambda plan, *a, **kw: plans.append(plan) or execute(plan, *a, **kw)  # type: ignore
        assert greedy_tokens(engine) == llm_greedy(target)
        budget = engine.speculation_ahead.budget
        assert budget.shadow is not None and budget.shadow.value > 0
        assert budget.windows and all(rows > 0 and w.value > 0 for rows, w in budget.windows.items())
        counts = [p.ahead_branches for p in plans if any(r.num_draft_tokens for r in p.requests)]
        assert counts and all(1 <= c <= 3 for c in counts)
        engine.speculation_ahead.budget = AheadBudget(3, adaptive=False)
        hits, hits_reject = draft_stats()
        assert greedy_tokens(engine) == llm_greedy(target)
        more, more_reject = draft_stats()
        assert more > hits and more_reject > hits_reject
        engine.speculation_ahead.budget = AheadBudget(1)
        assert greedy_tokens(engine) == llm_greedy(target)
        most, most_reject = draft_stats()
        assert most > more and most_reject == more_reject
    finally:
        executor.shutdown()


def test_prefix_hit_with_the_draft_off_across_processes(tiny_models: dict[str, TinyModel]) -> None:
    """Prefix caching while the draft sits steps out (tests/test_prefix_cache_draft_catch_up.py), the draft's ranks in
    processes of their own, asynchronous scheduling: a request starts the target from the target's whole hit, and
    the draft's ranks, whose request tables never saw the tokens between the draft's hit and the target's, get them
    with the first step that runs the draft for it. A draft equal to the target then has every draft accepted."""
    from test_prefix_cache_draft_catch_up import KW, NEW, PROMPTS, SHARED, fix_k, workload

    path = tiny_models["llama"].path
    engine = build_ray_engine(path, path, async_scheduling=True, **KW)
    try:
        assert engine.async_scheduling and not engine.executor.colocated
        off, on = workload(engine, fix_k(engine))
    finally:
        engine.executor.shutdown()
    assert off.num_cached_tokens == on.num_cached_tokens == len(SHARED)
    assert on.spec.num_drafts > 0 and on.spec.num_accepted_tokens == on.spec.num_draft_tokens, on.spec
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [off.output_token_ids, on.output_token_ids] == [o.token_ids for o in
                                                            LLM(path, **ENGINE_KW).generate(PROMPTS, greedy)]
