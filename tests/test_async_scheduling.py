"""Asynchronous scheduling in process: EngineCore submits step n+1 before it collects step n, the executor's side
resolves the open plan entries from its request table, and the scheduler plans from bounds. Everything a user
sees must be what synchronous scheduling gives: greedy tokens equal to the target alone (itself equal to HF),
sampled outputs exact in distribution, stops and max_tokens at the right token, aborts and preemptions exact, and
every KV block and every side's request state released at the end.

The in-process executor runs a step that speculates when it is collected (a step without drafts it queues on the
device at once, engine/decode_pipeline.py), and by default the engine collects such a step before it plans the
next (planning ahead of it would overlap nothing). These tests plan ahead of it all the same (`plans_ahead`), as
the engine does with an executor that sends each step at submit (Ray's workers), so that they exercise the whole
protocol (open entries, bounds, deferred frees, finished ids) without Ray; tests/test_ray_executor.py runs it across
processes, and the last test here checks the in-process default.
"""

from __future__ import annotations

import pytest
from conftest import random_prompts, start_requests
from spec_support import (
    ENGINE_KW,
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    assert_kv_released,
)
from test_spec_distribution import (
    DIST_PROMPT,
    DIST_SAMPLES,
    assert_first_three_follow_target,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)

from engine import LLM, SamplingParams
from engine.local_executor import LocalExecutor
from engine.request import Request
from engine.step.plan import PlannedRequest, StepPlan
from engine.step.request_table import RequestTable

pytestmark = pytest.mark.usefixtures("one_thread", "plans_ahead")


@pytest.fixture
def plans_ahead(request, monkeypatch):
    """The engine plans the next step before it collects one that speculates, as it does with Ray's executor (a
    test marked `in_process_default` keeps the in-process executor's own answer)."""
    if "in_process_default" not in request.keywords:
        monkeypatch.setattr(LocalExecutor, "runs_when_collected", lambda self, handle: False)

ASYNC = dict(ENGINE_KW, async_scheduling=True)


def _draft(tiny_drafts, near_drafts, target: str, draft: str) -> str:
    return near_drafts[target].path if draft == "near" else tiny_drafts[draft].path


def _watch(llm: LLM) -> dict[str, list]:
    """Record, per step the executor runs, its plan as sent (open entries included) and as resolved, and the order
    of the engine's submits and collects."""
    seen: dict[str, list] = {"sent": [], "resolved": [], "order": []}
    ex = llm.engine.executor
    resolve, run, submit, collect = ex.table.resolve, ex.step.run_resolved, ex.submit, ex.collect

    def rec_resolve(plan):
        seen["sent"].append(plan)
        return resolve(plan)

    def rec_run(plan):
        seen["resolved"].append(plan)
        return run(plan)

    def rec_submit(plan):
        seen["order"].append(("submit", plan.step_id))
        return submit(plan)

    def rec_collect(handle):
        seen["order"].append(("collect", handle if isinstance(handle, int) else handle.step_id))
        return collect(handle)

    ex.table.resolve, ex.step.run_resolved, ex.submit, ex.collect = rec_resolve, rec_run, rec_submit, rec_collect
    return seen


def _assert_released(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.executor.table.requests.keys() <= set(llm.engine._finished_ids)
    assert not llm.engine.in_flight.deferred_free


@pytest.mark.parametrize("target,draft,k,mode", [
    ("llama", "near", 3, "probabilistic"), ("mistral", "gemma3-2l", 4, "strict"), ("qwen2", "near", 1, "strict"),
    ("qwen3", "near", 5, "probabilistic"), ("gemma3", "gemma3-2l", 3, "probabilistic"), ("gemma3", "near", 4, "strict"),
])
def test_async_greedy_speculation_is_lossless(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k,
                                              mode):
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, adaptive_draft_length=False, **ASYNC)  # drafts counted
    seen = _watch(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    assert llm.spec_stats(outs).num_drafts > 0
    # The pipeline really ran ahead: most steps were submitted with their predecessor's tokens not yet
    # collected, so their decodes went out open and were resolved by the executor's side.
    open_entries = sum(p.token_ids is None for plan in seen["sent"] for p in plan.requests)
    assert open_entries > len(seen["sent"]) // 2, open_entries
    submits_before_collect = sum(1 for a, b in zip(seen["order"], seen["order"][1:])
                                 if a[0] == "submit" and b == ("collect", a[1] - 1))
    assert submits_before_collect > len(seen["sent"]) // 2
    assert all(p.token_ids is not None for plan in seen["resolved"] for p in plan.requests)
    assert_kv_released(llm)
    _assert_released(llm)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_async_target_alone_equals_sync(tiny_models, target_greedy, family):
    outs = LLM(tiny_models[family].path, **ASYNC).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(family)


def test_async_resolved_inputs_equal_sync_inputs(tiny_models, near_drafts):
    """Each resolved entry equals the entry synchronous scheduling sends for the same request at the same position
    (greedy, so both runs take the same path): tokens and output count (it seeds seeded sampling). Near a request's
    end the asynchronous run may draft less (k from bounds), which moves the draft's own KV frontier, so the
    draft's catch-up is compared where both runs had drafted alike before (the greedy equality covers the rest)."""
    path, draft = tiny_models["llama"].path, near_drafts["llama"].path
    runs = {}
    for name, kw in (("sync", ENGINE_KW), ("async", ASYNC)):
        # The same k in both runs: the draft length rule off (its choices follow measured time).
        llm = LLM(path, draft_model=draft, num_speculative_tokens=3, adaptive_draft_length=False, **kw)
        seen = _watch(llm)
        llm.generate(PROMPTS, GREEDY)
        runs[name] = {(p.request_id, p.start_pos): (p.token_ids, p.num_output_tokens, p.draft_start_pos,
                                                    p.draft_token_ids)
                      for plan in seen["resolved"] for p in plan.requests}
    common = runs["sync"].keys() & runs["async"].keys()
    assert len(common) >= 0.8 * len(runs["sync"]), (len(common), len(runs["sync"]))
    same_draft = 0
    for key in sorted(common):
        assert runs["async"][key][:2] == runs["sync"][key][:2], key
        same_draft += runs["async"][key][2:] == runs["sync"][key][2:]
    assert same_draft >= 0.8 * len(common)


def stops_and_max_tokens_inside(llm: LLM, ref: list[list[int]], past: int, max_tokens: int) -> None:
    """Greedy PROMPTS (`ref`: the target's outputs), request 0 ending on a stop token id, request 1 at `max_tokens`
    and request 2 on a stop token id (each its first new token from position `past` on): the outputs end exactly
    there, whatever step or proposal they land in."""
    stops = [next(j for j in range(past, len(r)) if r[j] not in r[:j]) for r in ref]
    params = [SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=[r[j]], ignore_eos=True)
              for r, j in zip(ref, stops, strict=True)]
    params[1] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert outs[0].token_ids == ref[0][:stops[0] + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == ref[1][:max_tokens] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == ref[2][:stops[2] + 1] and outs[2].stop_reason == ref[2][stops[2]]


def test_async_stop_token_and_max_tokens_inside_a_step_in_flight(tiny_models, target_greedy):
    # A draft identical to the target accepts everything, so a request's last tokens land while its next step
    # is already in flight: that step's tokens must be dropped, and its blocks freed only after it lands.
    path = tiny_models["llama"].path
    ref = target_greedy("llama")
    llm = LLM(path, draft_model=path, num_speculative_tokens=4, adaptive_draft_length=False, **ASYNC)  # k every step
    stops_and_max_tokens_inside(llm, ref, past=2, max_tokens=7)
    assert_kv_released(llm)
    _assert_released(llm)


def test_async_max_model_len(tiny_models):
    path = tiny_models["llama"].path
    prompts = random_prompts([9, 7], seed=5)
    kw = dict(block_size=4, max_model_len=13)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = LLM(path, **kw).generate(prompts, params)
    outs = LLM(path, draft_model=path, num_speculative_tokens=5, async_scheduling=True, **kw).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [len(o.token_ids) for o in outs] == [13 - len(p) for p in prompts]


@pytest.mark.parametrize("target,draft,k", [("llama", "near", 3), ("gemma3", "gemma3-2l", 5)])
def test_async_preemption(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k):
    # As test_spec_decode's preemption test: 16 blocks per model force preemptions; an optimistic schedule never
    # preempts, it lets the step in flight land first and schedules synchronously.
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, block_size=4, max_model_len=48, num_kv_blocks=16, async_scheduling=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert_kv_released(llm)
    _assert_released(llm)


def test_async_abort_with_a_step_in_flight(tiny_models, near_drafts, target_greedy):
    path, draft = tiny_models["llama"].path, near_drafts["llama"].path
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, **ASYNC)
    engine = llm.engine
    reqs = start_requests(engine, PROMPTS, GREEDY, steps=4)
    victim = reqs[1]
    assert victim.inflight is not None  # a step of it is in flight now
    used_before = engine.target_kv.num_blocks_held("r1", 0)
    assert used_before > 0
    engine.abort_request("r1")
    assert victim.finish_reason == "abort"
    # Its blocks wait for the step in flight; the id stays taken until then.
    assert engine.target_kv.has("r1") and "r1" in engine.in_flight.deferred_free
    with pytest.raises(ValueError, match="already in use"):
        engine.validate_request(Request("r1", [5, 6], GREEDY))
    n_out = victim.num_output_tokens
    while engine.has_unfinished():
        engine.step()
    assert victim.num_output_tokens == n_out  # the step in flight's tokens were dropped
    ref = target_greedy("llama")
    assert reqs[0].output_token_ids == ref[0] and reqs[2].output_token_ids == ref[2]
    assert_kv_released(llm)
    _assert_released(llm)


@pytest.mark.parametrize("mode", ["strict", "probabilistic"])
def test_async_seeded_sampling_is_batch_independent(tiny_models, tiny_drafts, mode):
    # SamplingParams' contract under asynchronous scheduling too: seeded requests draw from generators seeded by
    # their output position, which open entries take from the side's table, so a seeded request's tokens do not
    # depend on what else runs; and the sides shrink an open entry's k exactly as the scheduler would, so they
    # equal a synchronous run's (a server's seeded output equals the offline engine's).
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=4,
              rejection_sampling=mode, block_size=4, max_model_len=64, async_scheduling=True)
    prompts = random_prompts([5] * 8, seed=9)
    seeded = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in range(8)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, seeded, strict=True)]
    batched = llm.generate(prompts + [PROMPTS[2]], seeded + [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert [o.token_ids for o in batched[:8]] == alone
    assert len(set(map(tuple, alone))) > 4  # really sampled
    sync = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=4,
               rejection_sampling=mode, block_size=4, max_model_len=64)
    assert [o.token_ids for o in sync.generate(prompts, seeded)] == alone


@pytest.mark.parametrize("mode", ["probabilistic", "strict"])
def test_async_sampling_follows_target_distribution(small_vocab_pair, mode):  # noqa: F811
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=2, rejection_sampling=mode, seed=4321,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES, max_num_batched_tokens=3 * DIST_SAMPLES,
              async_scheduling=True)
    seen = _watch(llm)
    # Six tokens, of which the first three are tested: the first step (a one-token prompt, k = 2) may end a request
    # of three, so the second would sit out; with six, the second step goes out open, behind the first.
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert any(p.token_ids is None for plan in seen["sent"] for p in plan.requests)
    assert_first_three_follow_target(outs, target_hf, draft_hf)


def test_request_table_refuses_an_open_entry_it_cannot_resolve():
    table = RequestTable()
    entry = PlannedRequest("x", None, 0, 2, True, [[1]])
    with pytest.raises(RuntimeError, match="does not know it"):
        table.resolve(StepPlan(0, [entry]))


def test_request_table_resolves_like_the_scheduler_commits():
    table = RequestTable()
    first = PlannedRequest("a", [5, 6, 7], 0, 0, True, [[0]], draft_token_ids=[5, 6, 7], draft_start_pos=0,
                           draft_runs=True)
    plan = table.resolve(StepPlan(0, [first]))
    from engine.step.plan import StepResult

    table.record(StepResult([[9]], [0], step_id=plan.step_id))
    # A 3-draft verify after it: the last token fed, KV of the draft up to the frontier.
    nxt = table.resolve(StepPlan(1, [PlannedRequest("a", None, -1, 3, True, [[0]], draft_runs=True)])).requests[0]
    assert (nxt.token_ids, nxt.start_pos, nxt.num_output_tokens) == ([9], 3, 1)
    assert (nxt.draft_token_ids, nxt.draft_start_pos) == ([9], 3)
    table.record(StepResult([[10, 11, 12]], [2], step_id=1))  # 2 of 3 drafts accepted, then a recovered token
    # An open entry whose block tables are tails (the side copies it to fill them) and one sent whole: each resolves
    # to a new entry, and the plan's own entry stays as sent (open), whatever else the side reads from it later.
    sent = PlannedRequest("a", None, -1, 3, True, [[1]], draft_runs=True, block_table_starts=[1])
    last = table.resolve(StepPlan(2, [sent])).requests[0]
    assert last is not sent and (sent.token_ids, sent.start_pos, sent.num_output_tokens) == (None, -1, 0)
    assert last.block_tables == [[0, 1]] and last.block_table_starts is None and sent.block_tables == [[1]]
    assert (last.token_ids, last.start_pos, last.num_output_tokens) == ([12], 6, 4)
    # The draft holds KV for the frontier plus k - 1 = 2 drafts: both accepted ones, so only the new token is new.
    assert (last.draft_token_ids, last.draft_start_pos) == ([12], 6)
    table._unrecorded.clear()  # step 2's result never comes: resolve the same open entry again, sent whole
    whole = PlannedRequest("a", None, -1, 3, True, [[0, 1]], draft_runs=True)
    again = table.resolve(StepPlan(3, [whole])).requests[0]
    assert again is not whole and (whole.token_ids, whole.draft_token_ids) == (None, [])
    assert (again.token_ids, again.start_pos, again.draft_token_ids) == ([12], 6, [12])
    with pytest.raises(RuntimeError, match="did not run"):
        table.record(StepResult([[1]], [0], step_id=99))
    # A finished id drops the request before anything else in the plan.
    table.resolve(StepPlan(4, [], finished_ids=["a"]))
    assert len(table) == 0


@pytest.mark.parametrize("draft", [None, "near"])
def test_async_penalties_read_the_tokens_of_the_step_in_flight(tiny_models, near_drafts, draft):
    """Penalties read the output so far; an open entry's history is the scheduler's (one step behind) completed by
    the side's own newest tokens. Greedy with strong penalties is deterministic, so a stale history would show as
    different tokens than synchronous scheduling gives."""
    path = tiny_models["llama"].path
    kw = dict(draft_model=near_drafts["llama"].path, num_speculative_tokens=3) if draft else {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.7, presence_penalty=0.4)
    outs = {}
    for flag in (False, True):
        llm = LLM(path, **kw, **dict(ENGINE_KW, async_scheduling=flag))
        outs[flag] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert outs[True] == outs[False]
    plain = [o.token_ids for o in LLM(path, **ENGINE_KW).generate(PROMPTS, GREEDY)]
    assert outs[True] != plain  # the penalties changed the output, so the history mattered


def test_a_step_whose_commit_fails_is_never_committed_again(tiny_models, near_drafts, target_greedy):
    """A commit that raises (a detokenizer or stop-string error, say) takes its step out of flight all the same. The
    server then fails the requests in flight and carries on (serving/router/recovery.py): no later step may commit
    that result a second time, and new requests come out exact."""
    path, draft = tiny_models["llama"].path, near_drafts["llama"].path
    llm = LLM(path, draft_model=draft, num_speculative_tokens=3, **ASYNC)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", p, GREEDY))
    committed: list[object] = []  # the results themselves: an id() alone is reused once its object is freed
    commit, append = engine.commit, engine.output.append

    def recording_commit(scheduled, result):
        committed.append(result)
        return commit(scheduled, result)

    def failing_append(*args, **kwargs):
        engine.output.append = append  # once
        raise RuntimeError("detokenizer failed")

    engine.commit = recording_commit
    for _ in range(3):
        engine.step()
    engine.output.append = failing_append
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        for _ in range(10):
            engine.step()
    for i in range(len(PROMPTS)):  # what the server does after such an error
        engine.abort_request(f"r{i}")
    fresh = [Request(f"n{i}", PROMPTS[i], GREEDY) for i in range(2)]
    for r in fresh:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    assert len({id(r) for r in committed}) == len(committed), "a step's result was committed twice"
    ref = target_greedy("llama")
    assert [r.output_token_ids for r in fresh] == ref[:2]
    assert_kv_released(llm)


@pytest.mark.in_process_default
def test_in_process_collects_a_speculating_step_before_planning_the_next(tiny_models, near_drafts, target_greedy):
    """In process a step that speculates runs when collected, so the engine collects it before planning the next:
    no plan goes out with open entries, every submit comes after the collect of the step before, and the tokens are
    the target alone's."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              adaptive_draft_length=False, **ASYNC)
    seen = _watch(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy("llama")
    assert llm.spec_stats(outs).num_drafts > 0
    assert seen["sent"] and not any(p.token_ids is None for plan in seen["sent"] for p in plan.requests)
    assert not any(a[0] == "submit" and b == ("collect", a[1] - 1) for a, b in zip(seen["order"], seen["order"][1:]))
    _assert_released(llm)
