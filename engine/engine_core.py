"""The engine's step loop on the scheduler's side: schedule, plan, execute (propose + verify), commit.

Without a draft this is plain continuous batching. With one, every decoding request runs one
speculation step per engine step (docs/ARCHITECTURE.md, "One speculation step"), batched with other requests'
prefill chunks. The models run behind an Executor: in this process, or on Ray worker actors.

Asynchronous scheduling (EngineConfig.async_scheduling): `step()` submits step n+1 before it collects step n, so
the models never wait for the scheduler; the steps in flight, and the KV blocks that wait for them, are kept by
engine/step/inflight_steps.py. Synchronous scheduling is the same loop with one step in flight at most: the
executor runs it to its result before `step()` goes on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, SpeculativeConfig
from engine.detokenizer import OutputProcessor
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_limits import check_prompt_fits, check_request_limits
from engine.sample.logits_params import logits_params_of
from engine.sample.structured_output import grammar_spec_of
from engine.scheduler import ScheduledRequest, Scheduler
from engine.speculation.ahead.planner import AheadPlanner
from engine.speculation.draft_length_control import DraftLengthControl
from engine.speculation.draft_length_rule import DraftLengthRule
from engine.speculation.draft_settings import check_draft_settings
from engine.step.commit import commit_result
from engine.step.executor import Executor
from engine.step.inflight_steps import InFlightStep, InFlightSteps
from engine.step.phases import COMMIT, SCHEDULE, StepStats
from engine.step.plan import StepPlan, StepResult
from engine.step.plan_builder import build_plan
from engine.step.plan_deltas import SentState


class EngineCore:
    def __init__(self, executor: Executor, engine_config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None,
                 eos_token_ids: list[int], spec_config: SpeculativeConfig | None = None) -> None:
        self.executor = executor
        self.config = engine_config
        self.spec_config = spec_config if executor.draft_kv_groups is not None else None
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        bs = engine_config.block_size
        caching = engine_config.enable_prefix_caching
        self.target_kv = KVCacheManager(executor.target_kv_groups, executor.target_num_blocks, bs, caching)
        self.draft_kv = (KVCacheManager(executor.draft_kv_groups, executor.draft_num_blocks, bs, caching)
                         if executor.draft_kv_groups is not None else None)
        managers = [self.target_kv] + ([self.draft_kv] if self.draft_kv is not None else [])
        self.scheduler = Scheduler(managers, engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                                   engine_config.max_model_len, num_speculative_tokens=k,
                                   draft_length_fn=self.spec_config.draft_length if self.spec_config else None,
                                   enable_prefix_caching=caching)
        # The draft length of each step: the rule's, from measured costs (engine/speculation/draft_length_control.py
        # sets the scheduler's k to its choices), unless it is off or a static schedule overrides it
        # (engine/draft_schedule.py).
        self.draft_lengths = (DraftLengthControl(k, self.scheduler, engine_config.max_num_seqs,
                                                 lambda: self.draft_kv is not None)
                              if self.spec_config is not None and engine_config.adaptive_draft_length
                              and not self.spec_config.has_static_schedule() else None)
        self.scheduler.draft_catches_up = _draft_catches_up(self.spec_config)
        self.output = OutputProcessor(tokenizer, eos_token_ids, engine_config.max_model_len)
        self.vocab_size = executor.vocab_size
        self.last_step = StepStats()
        self._step_ids = itertools.count()
        self.async_scheduling = executor.async_scheduling
        # Steps submitted and not collected yet: one at most, and never between steps, unless asynchronous.
        self.in_flight = InFlightSteps(self.scheduler.free_kv)
        self._finished_ids: list[str] = []  # ids the sides may forget
        self.sent = SentState()  # what the model sides know of each request: plans carry the rest
        self.scheduler.speculation_ahead = self.spec_config is not None and executor.speculation_ahead
        check_draft_settings(engine_config, self.spec_config, self.scheduler.speculation_ahead)
        # Each plan's share of speculation ahead, from its budget and gate (engine/speculation/ahead/planner.py).
        self.speculation_ahead = AheadPlanner(self.config, self.scheduler.speculation_ahead,
                                              executor.ahead_overlaps_verify)

    # --- requests ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        request.logits_params = logits_params_of(request, self.output.eos_token_ids, self._grammar(request))
        self.scheduler.add_request(request)

    def validate_request(self, request: Request) -> None:
        """Raise ValueError for a request the engine cannot serve; changes nothing."""
        check_request_limits(request, self.config.max_model_len, self.vocab_size)  # engine/request_limits.py
        if request.request_id in self.scheduler.requests or self.in_flight.holds(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._grammar(request)  # a grammar the backend cannot compile is refused here (compiled once, cached)

    def _grammar(self, request: Request) -> Any:
        return grammar_spec_of(request.params.structured_outputs, self.output.tokenizer,
                               sorted(self.output.eos_token_ids), self.vocab_size)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            req.finish_reason = "abort"
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End a request; its KV blocks go back at once, or once its step in flight has landed."""
        keep_kv = req.inflight is not None
        self.scheduler.finish_request(req, status, free_kv=not keep_kv)
        if self.draft_rule is not None:
            self.draft_rule.forget(req.request_id)
        if keep_kv:
            self.in_flight.defer_free(req)
        self._finished_ids.append(req.request_id)
        self.output.release(req.request_id)

    def has_unfinished(self) -> bool:
        """Requests to run, or steps in flight to collect (whose blocks may still be held)."""
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # --- what a server reads between steps ------------------------------------------------------------
    # A server (serving/router/router.py) drives this engine from another thread and must not read the scheduler's
    # queues or a request's fields itself: those belong to the step path, whose state may move (e.g. into the
    # workers) without the server having to follow. Call these between steps.
    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is queued or running (a finished or aborted request is gone)."""
        return request_id in self.scheduler.requests

    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        """Requests waiting for a batch slot."""
        return len(self.scheduler.waiting)

    def stats(self) -> dict[str, Any]:
        """Load and KV use: num_running, num_waiting, kv_cache_usage ("model/group" -> fraction in use),
        kv_blocks_used ("model/group" -> blocks), speculation (whether the engine has a draft now)."""
        return {"num_running": self.num_running(), "num_waiting": self.num_waiting(),
                "kv_cache_usage": {f"{m}/{g}": u for (m, g), u in self.kv_usage().items()},
                "kv_blocks_used": self.kv_blocks_used(), "speculation": self.spec_config is not None}

    # --- the models' workers -------------------------------------------------------------------------
    def workers(self) -> list[tuple[str, int, Any]]:
        """(role, rank, actor handle) of each model worker; empty for models in this process."""
        return list(self.executor.workers())

    def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise (serving.worker_health.WorkerDiedError) when a model worker is dead or does not answer
        within `timeout_s`; call between steps. Models in this process have nothing to check."""
        self.executor.check_health(timeout_s)

    def shutdown(self) -> None:
        """Release the models' workers (their placement groups, hence their GPUs), if they have any."""
        self.executor.shutdown()

    # --- speculation on and off (a draft group that died and restarts) -------------------------------
    # Speculation is lossless: the target decides every token, so an engine that stops speculating
    # mid-request produces exactly what it would have with the draft. A failed step commits nothing, so the
    # target's KV and every request's progress are intact when the draft's group dies; only the draft's side
    # is dropped, and a new draft group catches up on each request's tokens in one chunk once attached.
    def detach_draft(self) -> SpeculativeConfig:
        """Switch to target-only steps (the executor stops running the draft; no draft KV; k = 0); returns the
        SpeculativeConfig, for `attach_draft`. Raises if the engine does not speculate or the executor cannot
        (a target rank is dead too). Call between steps."""
        spec = self.spec_config
        if spec is None:
            raise RuntimeError("the engine does not speculate: there is no draft to detach")
        self.executor.detach_draft()
        self.spec_config = None
        self.draft_kv = None
        self.scheduler.kv_managers = [self.target_kv]
        self.scheduler.num_speculative_tokens = 0
        self._restart_draft_progress()
        return spec

    def start_draft_group(self) -> None:
        """Start (load) a new draft group next to the running target, after `detach_draft`; steps may run
        meanwhile (not between steps: loading takes long). `attach_draft` puts it into the step."""
        self.executor.start_draft_group()

    def attach_draft(self, spec: SpeculativeConfig) -> None:
        """Put the draft group that `start_draft_group` started into the step; call between steps. The
        draft's KV starts empty: each request's draft progress restarts at 0."""
        self.executor.attach_draft()
        ex = self.executor
        self.draft_kv = KVCacheManager(ex.draft_kv_groups, ex.draft_num_blocks, self.config.block_size,
                                       self.config.enable_prefix_caching)
        self._restart_draft_progress()
        self.scheduler.kv_managers = [self.target_kv, self.draft_kv]
        self.scheduler.num_speculative_tokens = spec.num_speculative_tokens
        self.scheduler.draft_catches_up = _draft_catches_up(spec)
        self.spec_config = spec
        self.speculation_ahead.restart(ex.ahead_overlaps_verify)  # the new group's runs ahead are measured anew

    def _restart_draft_progress(self) -> None:
        for req in self.scheduler.requests.values():
            req.num_draft_computed_tokens = 0
        self.sent.reset()  # new draft ranks know no request: the next plan sends every entry whole

    # --- KV caches -----------------------------------------------------------------------------------
    def kv_managers(self) -> list[tuple[str, KVCacheManager]]:
        """("target" | "draft", its KV manager): the draft's only while the engine has one."""
        return [("target", self.target_kv)] + ([("draft", self.draft_kv)] if self.draft_kv is not None else [])

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError for a prompt whose KV alone outgrows a model's whole cache: it could never run, and
        saying so up front beats failing it once it reaches the head of the queue (engine/request_limits.py)."""
        check_prompt_fits(num_prompt_tokens, self.kv_managers())

    def kv_usage(self) -> dict[tuple[str, int], float]:
        """Fraction of each (model, KV-cache group)'s blocks in use."""
        return {(model, g): kv.usage(g) for model, kv in self.kv_managers() for g in range(kv.num_groups)}

    def kv_blocks_used(self) -> dict[str, int]:
        """Blocks in use per "model/group"."""
        return {f"{model}/{g}": n for model, kv in self.kv_managers() for g, n in enumerate(kv.num_used_blocks())}

    def speculation_ahead_branches(self) -> int:
        """Windows a request the last plan asked the draft to draft ahead (engine/speculation/ahead/budget.py); 0 where
        the gate found drafting ahead slower at that load (engine/speculation/ahead/gate.py)."""
        return self.speculation_ahead.branches()

    def speculation_ahead_off_steps(self) -> int:
        """Steps planned without drafting ahead by the gate (engine/speculation/ahead/gate.py), since the draft group
        was last set up."""
        return self.speculation_ahead.off_steps()

    def speculation_ahead_stats(self) -> tuple[int, ...]:
        """The draft's speculation-ahead running totals (AheadStats.as_tuple): lookups, hits, tokens drafted ahead, of
        those dropped unproposed, branches chosen but not drafted, trees drafted and their nodes (tree mode), then
        hits by outcome (tree mode, a = 0..16); they restart from 0 when a new draft group is attached."""
        return self.speculation_ahead.totals

    def prefix_cache_stats(self) -> dict[str, tuple[int, int]]:
        """Per model, (tokens looked up, tokens found) in its prefix cache since the model's KV manager began."""
        return {model: (kv.prefix_queries, kv.prefix_hits) for model, kv in self.kv_managers()}

    # --- one step ------------------------------------------------------------------------------------
    def step(self, on_dispatched: Callable[[], None] | None = None) -> list[Request]:
        """Run one step; returns the requests that got tokens or finished. on_dispatched: called once the step's
        plan is on its way to the models, before waiting for them (an executor on other processes), so that a
        caller's own work (a server publishing the last step's tokens) overlaps the models' instead of delaying
        the plan. With asynchronous scheduling the tokens returned are those of the step before the one just
        submitted."""
        in_flight = self.in_flight
        touched = self.flush() if in_flight.sync_next else []
        in_flight.sync_next = False
        t0 = time.perf_counter()
        # While a step is in flight the scheduler plans from bounds (asynchronous scheduling only).
        sched = self._schedule(optimistic=bool(in_flight))
        submitted = sched is not None and bool(sched.scheduled)
        if sched is not None:
            in_flight.sync_next = sched.blocked
        if submitted:
            plan = self.make_plan(sched.scheduled)
            # Timed before the submit: a pipelined executor's submit also waits for the step before it.
            self._submit(plan, sched.scheduled, time.perf_counter() - t0, on_dispatched)
        elif on_dispatched is not None:
            on_dispatched()
        # Asynchronous: the step before lands now, the one just submitted a step later (or now, if none follows).
        if len(in_flight) > 1 or (in_flight and not (submitted and self.async_scheduling)):
            touched += self._collect()
        return touched

    def _submit(self, plan: StepPlan, scheduled: list[ScheduledRequest], schedule_seconds: float,
                on_dispatched: Callable[[], None] | None) -> None:
        """Hand a step's plan to the executor and keep it in flight until `_collect`. Synchronous: the executor runs
        it to its result (calling on_dispatched once the plan is on its way), which stands as its handle."""
        try:
            if self.async_scheduling:
                handle = self.executor.submit(plan)
            elif on_dispatched is None:
                handle = self.executor.execute(plan)
            else:
                handle = self.executor.execute(plan, on_dispatched=on_dispatched)
        except BaseException:
            # The plan may have reached some ranks only, and a pipelined executor loses the step queued before it
            # too: forget every step in flight (and what the sides know), plan explicit input next.
            self._drop_in_flight()
            raise
        if self.async_scheduling and on_dispatched is not None:
            on_dispatched()
        self.in_flight.add(InFlightStep(scheduled, handle, self.last_step, schedule_seconds))
        if self.async_scheduling and self.executor.runs_when_collected(handle):
            # The step runs only when collected (a step that speculates, in process): planning the next one from
            # bounds before it would overlap nothing and cost the host more (a plan of open entries, resolved
            # later). Collect it first; steps without speculation still queue one ahead.
            self.in_flight.sync_next = True

    def _collect(self) -> list[Request]:
        """Wait for the oldest step in flight and commit it; returns the requests it gave tokens or finished."""
        step = self.in_flight.oldest
        try:
            result = self.executor.collect(step.handle) if self.async_scheduling else step.handle
        except BaseException:
            self._drop_in_flight()
            raise
        t = time.perf_counter()
        try:
            touched = self.commit(step.scheduled, result)
        finally:
            self.in_flight.landed(step)  # committed or failed, it is out of flight: never committed twice
        step.stats.phase_seconds = {**result.phase_seconds, SCHEDULE: step.schedule_seconds,
                                    COMMIT: time.perf_counter() - t}
        self.last_step = step.stats
        return touched

    def _drop_in_flight(self) -> None:
        """A step failed: forget every step in flight, and what the sides were sent (a plan may have reached some
        ranks only): the next plan sends every entry whole."""
        self.sent.reset()
        self.in_flight.drop()

    def _schedule(self, optimistic: bool) -> Any:
        """The scheduler's output for the next step, or None when nothing can run (and nothing is in flight)."""
        sched = self.scheduler.schedule(optimistic=optimistic)
        self.last_step = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted),
                                   sched.draft_length)
        for req in sched.preempted:
            self._finished_ids.append(req.request_id)  # the sides forget it; it resumes with explicit input
        if sched.scheduled:
            return sched
        if not optimistic and self.scheduler.waiting and not self.scheduler.running:
            # Nothing runs and the head request does not fit an empty cache: fail it, do not spin.
            req = self.scheduler.waiting[0]
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            req.finish_reason = "abort"
            raise RuntimeError(f"request {req.request_id} ({req.num_tokens} tokens) does not fit in the "
                               "KV cache even alone; raise the KV budget or lower max_model_len")
        return sched if optimistic else None

    def flush(self) -> list[Request]:
        """Collect every step in flight (before the executor's workers change: a draft group attached or
        detached); returns the requests they gave tokens or finished."""
        touched: list[Request] = []
        while self.in_flight:
            touched += self._collect()
        return touched

    def make_plan(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        """The plan of a scheduled step (engine/step/plan_builder.py); it carries the ids the sides may forget."""
        finished, self._finished_ids = self._finished_ids, []
        plan = build_plan(next(self._step_ids), scheduled, self.target_kv, self.draft_kv, self.config.max_model_len,
                          self.spec_config, finished, self.sent)
        if self.draft_lengths is not None:
            self.draft_lengths.planned(plan.step_id, scheduled)
        self.speculation_ahead.plan(plan, scheduled)
        return plan

    def commit(self, scheduled: list[ScheduledRequest], result: StepResult) -> list[Request]:
        """Commit a collected step (engine/step/commit.py); returns the requests it gave tokens or finished."""
        self.speculation_ahead.observe(result)
        if self.draft_lengths is not None:
            self.draft_lengths.observe(scheduled, result)
        return commit_result(self.scheduler, self.output, scheduled, result, self._finish)

    @property
    def draft_rule(self) -> DraftLengthRule | None:
        """The draft length rule (engine/speculation/draft_length_rule.py); None where it is off."""
        return self.draft_lengths.rule if self.draft_lengths is not None else None

    def draft_rule_stats(self) -> tuple[int, int, dict[str, dict[int, float]]] | None:
        """The draft length rule's (steps chosen, of those at k = 0, its estimates); None where it is off."""
        rule = self.draft_rule
        return None if rule is None else (rule.steps, rule.steps_at_zero, rule.estimates())


def _draft_catches_up(spec: SpeculativeConfig | None) -> bool:
    """Whether the draft can compute positions a prefix hit let the target skip (engine/scheduler.py): a draft model
    can, from their tokens; an EAGLE-3 head cannot, it reads the target's states of each position it runs."""
    return spec is None or spec.speculative_method != "eagle3"

