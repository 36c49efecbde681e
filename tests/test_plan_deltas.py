"""Plans carry only what the model sides do not know yet (engine/step/plan_deltas.py): sampling settings with a
request's
first entry, block tables as tails. Every side resolves each entry back to exactly the entry a whole plan has; the
builder's record of what the sides know is dropped whenever they may not know it (finish, preemption, a failed
step, a new draft group); a side sent what it cannot splice raises. End to end, greedy output equals the target
alone and seeded sampling the tokens of whole plans, with synchronous and asynchronous scheduling, a Gemma 3-like
sliding-window draft (two KV-cache groups in both models), preemption and prefix caching.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import random_prompts, start_requests
from spec_support import ENGINE_KW, GREEDY, PROMPTS

import engine.engine_core as engine_core
from engine import LLM, SamplingParams
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.request import Request
from engine.step.plan import PlannedRequest, SamplingSettings, StepPlan, StepResult
from engine.step.plan_deltas import SentState
from engine.step.request_table import RequestTable

pytestmark = pytest.mark.usefixtures("one_thread")

TABLE_FIELDS = ("sampling", "block_tables", "block_table_starts", "draft_block_tables", "draft_block_table_starts")


class PlanLog:
    """Per step: the plan as sent, as the executor's side resolved it, and as a whole plan (built the old way from
    the same schedule)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[StepPlan] = []
        self.resolved: list[StepPlan] = []
        self.whole: dict[int, StepPlan] = {}
        real_build = engine_core.build_plan

        def build_both(*args: Any) -> StepPlan:
            plan = real_build(*args)
            self.whole[plan.step_id] = real_build(*args[:-1], None)
            return plan

        monkeypatch.setattr(engine_core, "build_plan", build_both)
        table = llm.engine.executor.table
        resolve = table.resolve

        def rec_resolve(plan: StepPlan) -> StepPlan:
            self.sent.append(plan)
            out = resolve(plan)
            self.resolved.append(out)
            return out

        monkeypatch.setattr(table, "resolve", rec_resolve)

    def check_resolved_equal_whole(self) -> None:
        for plan, resolved in zip(self.sent, self.resolved, strict=True):
            whole = self.whole[plan.step_id]
            assert resolved.finished_ids == whole.finished_ids
            for p, r, w in zip(plan.requests, resolved.requests, whole.requests, strict=True):
                if p.token_ids is not None:
                    assert r == w, (plan.step_id, p.request_id)
                else:  # an open entry: its input came from the side's state, the rest must be the whole entry's
                    assert [getattr(r, f) for f in TABLE_FIELDS] == [getattr(w, f) for f in TABLE_FIELDS]


def _is_whole(p: PlannedRequest) -> bool:
    return p.sampling is not None and p.block_table_starts is None and p.draft_block_table_starts is None


def _check_sent_once(log: PlanLog) -> tuple[int, int]:
    """Entries are whole exactly where the sides know nothing of the request; returns (whole, delta) counts."""
    known: set[str] = set()
    counts = [0, 0]
    for plan in log.sent:
        known -= set(plan.finished_ids)
        for p, w in zip(plan.requests, log.whole[plan.step_id].requests, strict=True):
            if p.request_id in known:
                assert p.sampling is None and p.block_table_starts is not None, (plan.step_id, p.request_id)
                for start, tail, whole in zip(p.block_table_starts, p.block_tables, w.block_tables, strict=True):
                    assert whole[start:] == tail
                counts[1] += 1
            else:
                assert _is_whole(p), (plan.step_id, p.request_id)
                known.add(p.request_id)
                counts[0] += 1
    return counts[0], counts[1]


# --------------------------------------------------------------------------------------------------------
# The protocol, entry by entry
# --------------------------------------------------------------------------------------------------------


def test_tails_round_trip_any_change_of_the_tables() -> None:
    """Random edits of two models' two-group tables (appends, sliding-window releases and replacements, tables
    that start with shared cached blocks, a draft that sits steps out, finishes): every entry after a request's
    first carries no settings and per group only the tail past the longest common prefix with what was sent, and a
    side resolves it to the current tables."""
    rng = random.Random(3)
    sent, side = SentState(), RequestTable()
    settings = {f"r{i}": SamplingSettings(temperature=0.5 + i, seed=i) for i in range(4)}
    shared = [[90, 91, 92], [93, 94, 95]]  # cached blocks at the start of every table (prefix caching)
    tables = {rid: [list(g) for g in shared] for rid in settings}
    drafts = {rid: [[], []] for rid in settings}
    known: set[str] = set()
    finished: list[str] = []
    next_block = 100
    num_tails = 0
    last: dict[str, list[list[int]]] = {}  # the target tables each request was last sent
    for step in range(300):
        entries, expect = [], []
        for rid in settings:
            for model_tables in (tables[rid], drafts[rid]):
                for g, t in enumerate(model_tables):
                    for _ in range(rng.choice([0, 0, 1, 2])):
                        t.append(next_block)
                        next_block += 1
                    if g == 0 and len(t) > 4 and rng.random() < 0.3:  # the window moved past a block
                        first = next((i for i, b in enumerate(t) if b != NULL_BLOCK), len(t) - 1)
                        t[first] = NULL_BLOCK
                    if rng.random() < 0.05 and t:  # any other change
                        t[rng.randrange(len(t))] = next_block
                        next_block += 1
            draft_runs = rng.random() < 0.7
            p = PlannedRequest(rid, [1], 5, 2, True, [], draft_runs=draft_runs)
            if sent.encode(p, tables[rid], drafts[rid] if draft_runs else None):
                p.sampling = settings[rid]
            if rid in known:
                assert p.sampling is None and p.block_table_starts is not None
                for start, tail, now, before in zip(p.block_table_starts, p.block_tables, tables[rid], last[rid]):
                    assert tail == now[start:]
                    assert now[:start] == before[:start] and (start == min(len(now), len(before))
                                                              or now[start] != before[start])
                num_tails += 1
            else:
                assert p.sampling == settings[rid] and p.block_table_starts is None
            last[rid] = [list(g) for g in tables[rid]]
            known.add(rid)
            entries.append(p)
            expect.append((settings[rid], tables[rid], drafts[rid] if draft_runs else []))
        resolved = side.resolve(StepPlan(step, entries, finished_ids=finished))
        got = [(r.sampling, r.block_tables, r.draft_block_tables) for r in resolved.requests]
        assert got == [(s, [list(g) for g in t], [list(g) for g in d]) for s, t, d in expect], step
        assert all(r.block_table_starts is None and r.draft_block_table_starts is None for r in resolved.requests)
        finished = [rid for rid in settings if rng.random() < 0.03]  # the next plan says these ended
        sent.forget(finished)
        known -= set(finished)
        for rid in finished:  # a new request under the same id, or a preempted one that resumes
            tables[rid] = [list(g) for g in shared]
            drafts[rid] = [[], []]
    assert num_tails > 0.9 * 300 * len(settings)


def test_a_side_refuses_what_it_cannot_splice() -> None:
    side = RequestTable()
    with pytest.raises(RuntimeError, match="request ghost's sampling settings"):
        side.resolve(StepPlan(0, [PlannedRequest("ghost", [1, 2], 0, 0, True, [[7]], sampling=None)]))
    with pytest.raises(RuntimeError, match="request ghost2's target block tables as tails"):
        side.resolve(StepPlan(1, [PlannedRequest("ghost2", [1, 2], 0, 0, True, [[7]], block_table_starts=[0])]))
    side.resolve(StepPlan(2, [PlannedRequest("a", [1, 2, 3, 4, 5], 0, 0, True, [[7, 8]], draft_runs=True,
                                             draft_token_ids=[1, 2, 3, 4, 5], draft_block_tables=[[3, 4]])]))
    with pytest.raises(RuntimeError, match="request a's target block table of KV-cache group 0 from block 3, but "
                                           "this side has only 2"):
        side.resolve(StepPlan(3, [PlannedRequest("a", [6], 5, 0, True, [[9]], sampling=None,
                                                 block_table_starts=[3])]))
    with pytest.raises(RuntimeError, match="request a's draft block table of KV-cache group 0 from block 5"):
        side.resolve(StepPlan(4, [PlannedRequest("a", [6], 5, 0, True, [[9]], sampling=None, block_table_starts=[2],
                                                 draft_runs=True, draft_start_pos=5, draft_token_ids=[6],
                                                 draft_block_tables=[[9]], draft_block_table_starts=[5])]))
    ok = side.resolve(StepPlan(5, [PlannedRequest("a", [6], 5, 0, True, [[9]], sampling=None, block_table_starts=[1],
                                                  draft_runs=True, draft_start_pos=5, draft_token_ids=[6],
                                                  draft_block_tables=[[9]], draft_block_table_starts=[2])]))
    r = ok.requests[0]
    assert (r.block_tables, r.draft_block_tables, r.temperature, r.logprobs) == ([[7, 9]], [[3, 4, 9]], 0.0, None)
    # A whole entry replaces what the side kept (a plan whose finished ids were lost, an id used again).
    again = side.resolve(StepPlan(6, [PlannedRequest("a", [1], 0, 0, True, [[5]], temperature=0.3)])).requests[0]
    assert (again.block_tables, again.temperature) == ([[5]], 0.3)
    later = side.resolve(StepPlan(7, [PlannedRequest("a", [2], 1, 0, True, [[6]], sampling=None,
                                                     block_table_starts=[1])])).requests[0]
    assert (later.block_tables, later.temperature) == ([[5, 6]], 0.3)
    # A finished id drops what the side kept: the request's next entry must be whole again.
    side.resolve(StepPlan(8, [], finished_ids=["a"]))
    with pytest.raises(RuntimeError, match="request a's sampling settings"):
        side.resolve(StepPlan(9, [PlannedRequest("a", [6], 5, 0, True, [[9]], sampling=None)]))


def test_an_entry_reads_its_settings_only_once_resolved() -> None:
    p = PlannedRequest("a", [1], 0, 0, True, [[1]], temperature=0.7, logprobs=2)
    assert (p.sampling, p.temperature, p.logprobs) == (SamplingSettings(temperature=0.7, logprobs=2), 0.7, 2)
    import dataclasses

    assert dataclasses.replace(p, logprobs=None).sampling == SamplingSettings(temperature=0.7)
    assert dataclasses.replace(p, token_ids=[2]).sampling is p.sampling
    with pytest.raises(RuntimeError, match="request b's entry carries no sampling settings"):
        _ = PlannedRequest("b", [1], 0, 0, True, [[1]], sampling=None).temperature


# --------------------------------------------------------------------------------------------------------
# End to end, in process
# --------------------------------------------------------------------------------------------------------

# Gemma 3 target and its near draft (an extra sliding-window layer): two KV-cache groups in each model. 16 blocks of
# 4 tokens per model force preemptions (test_spec_decode's preemption case).
SMALL_KV = dict(block_size=4, max_model_len=48, num_kv_blocks=16)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_with_deltas_equals_the_target_alone(tiny_models, near_drafts, target_greedy, monkeypatch,
                                                    async_scheduling):
    expected = target_greedy("gemma3")  # before the log patches plan building for every engine
    llm = LLM(tiny_models["gemma3"].path, draft_model=near_drafts["gemma3"].path, num_speculative_tokens=3,
              async_scheduling=async_scheduling, **SMALL_KV)
    log = PlanLog(llm, monkeypatch)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert any(o.num_preemptions > 0 for o in outs)
    assert any(p.token_ids is None for plan in log.sent for p in plan.requests) == async_scheduling
    log.check_resolved_equal_whole()
    whole, delta = _check_sent_once(log)
    assert delta > 3 * whole
    # A preempted request resumes with a whole entry (the sides dropped it with the finished id).
    resumed = [(n, rid) for n, plan in enumerate(log.sent) for rid in plan.finished_ids
               if any(p.request_id == rid for later in log.sent[n:] for p in later.requests)]
    assert resumed
    for n, rid in resumed:
        first = next(p for later in log.sent[n:] for p in later.requests if p.request_id == rid)
        assert _is_whole(first)
    # The sides and the builder know the same requests: only those whose end the next plan would announce.
    assert set(llm.engine.sent) == set(llm.engine.executor.table.requests) <= set(llm.engine._finished_ids)


def test_prefix_cached_tables_and_seeded_sampling_match_whole_plans(tiny_models, near_drafts, monkeypatch):
    """Seeded sampled requests (one with logprobs, one with penalties: settings the sides keep) that share a cached
    prefix give the same tokens and logprobs with deltas as with whole plans."""
    system = random_prompts([12], seed=31)[0]
    prompts = [system + s for s in random_prompts([3, 6, 5, 9], seed=32)]
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
    params[1].logprobs = 2
    params[2].repetition_penalty = 1.5
    runs = {}
    for mode in ("deltas", "whole"):
        with monkeypatch.context() as m:
            llm = LLM(tiny_models["gemma3"].path, draft_model=near_drafts["gemma3"].path, num_speculative_tokens=3,
                      rejection_sampling="probabilistic", block_size=4, max_model_len=64)
            log = PlanLog(llm, m)
            if mode == "whole":
                m.setattr(engine_core, "build_plan", lambda *a, real=engine_core.build_plan: real(*a[:-1], None))
            first = llm.generate(prompts[:1], params[:1])  # its blocks are cached for the others
            outs = first + llm.generate(prompts[1:], params[1:])
            runs[mode] = [(o.token_ids, o.logprobs) for o in outs]
            if mode == "deltas":
                log.check_resolved_equal_whole()
                _check_sent_once(log)
                assert sum(o.num_cached_tokens for o in outs[1:]) > 0
                starts = [p.block_tables[0][0] for plan in log.sent for p in plan.requests if _is_whole(p)]
                assert len(set(starts)) < len(starts)  # tables that start with the same cached block
    assert runs["deltas"] == runs["whole"]
    assert len({tuple(t) for t, _ in runs["deltas"]}) == 4 and runs["deltas"][1][1]


def _drive(llm: LLM, prompts: list[list[int]], fail_at: int | None = None) -> list[list[int]]:
    """Run `prompts` greedily step by step; the side drops the plan of resolve call `fail_at` (it never reached
    it) and the step fails."""
    engine = llm.engine
    table = engine.executor.table
    resolve, calls = table.resolve, [0]

    def lossy_resolve(plan: StepPlan) -> StepPlan:
        calls[0] += 1
        if calls[0] == fail_at:
            raise ConnectionError("the plan was lost on its way")
        return resolve(plan)

    table.resolve = lossy_resolve
    reqs = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except ConnectionError:
            failures += 1
            assert len(engine.sent) == 0  # the sides may know less than was sent: everything goes whole
    assert failures == (fail_at is not None)
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_step_resends_everything(tiny_models, near_drafts, target_greedy, async_scheduling):
    """The second plan never reaches the side; the engine goes on (a failed step commits nothing) and the next plan
    is whole, so the side can resolve it: the tokens are the target's alone."""
    llm = LLM(tiny_models["gemma3"].path, draft_model=near_drafts["gemma3"].path, num_speculative_tokens=3,
              async_scheduling=async_scheduling, **ENGINE_KW)
    assert _drive(llm, PROMPTS, fail_at=2) == target_greedy("gemma3")


class DraftGroupExecutor:
    """The in-process executor with a draft side of its own, as Ray's draft ranks have: a request table that
    resolves every plan (and must agree with the target side's), and that a new draft group starts empty."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.draft_table: RequestTable | None = RequestTable()
        self.detached: tuple[Any, ...] | None = None
        self.num_checked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, plan: StepPlan, on_dispatched: Any = None) -> StepResult:
        mine = self.draft_table.resolve(plan) if self.draft_table is not None else None
        step = self.inner.step
        theirs = step.target.resolve(plan)
        result = step.run_resolved(theirs)
        if mine is not None:
            assert [[getattr(r, f) for f in TABLE_FIELDS] for r in mine.requests] == \
                [[getattr(r, f) for f in TABLE_FIELDS] for r in theirs.requests]
            self.draft_table.record(result)
            self.num_checked += 1
        return result

    def detach_draft(self) -> None:
        ex = self.inner
        self.detached = (ex.step.draft, ex.draft_kv_groups, ex.draft_num_blocks)
        ex.step.draft, ex.draft_kv_groups, ex.draft_num_blocks = None, None, 0
        self.draft_table = None

    def start_draft_group(self) -> None:
        pass

    def attach_draft(self) -> None:
        assert self.detached is not None
        self.inner.step.draft, self.inner.draft_kv_groups, self.inner.draft_num_blocks = self.detached
        self.draft_table = RequestTable()


def test_a_new_draft_group_is_sent_everything(tiny_models, near_drafts, target_greedy):
    # A fixed k: the new draft group drafts in the steps after it is attached.
    llm = LLM(tiny_models["gemma3"].path, draft_model=near_drafts["gemma3"].path, num_speculative_tokens=3,
              block_size=4, max_model_len=64, adaptive_draft_length=False)
    engine = llm.engine
    ex = engine.executor = DraftGroupExecutor(engine.executor)
    reqs = start_requests(engine, PROMPTS, GREEDY, steps=3)
    assert len(engine.sent) == 3
    spec = engine.detach_draft()
    assert len(engine.sent) == 0
    for _ in range(2):
        engine.step()
    assert len(engine.sent) == 3
    engine.start_draft_group()
    engine.attach_draft(spec)
    assert len(engine.sent) == 0
    checked = ex.num_checked
    while engine.has_unfinished():
        engine.step()
    assert ex.num_checked > checked + 2  # the new draft side resolved every later plan, deltas included
    assert [r.output_token_ids for r in reqs] == target_greedy("gemma3")
    assert sum(r.spec.num_drafts for r in reqs) > 0
