"""The engine's step loop on the scheduler's side: schedule, plan, execute (propose + verify), commit.

Without a draft this is plain continuous batching. With one, every decoding request runs one
speculation step per engine step (DESIGN.md, "One speculation step"), batched with other requests'
prefill chunks. The models run behind an Executor: in this process, or on Ray worker actors.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, SpeculativeConfig
from engine.detokenizer import OutputProcessor
from engine.executor import Executor
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sample.logits_params import logits_params_of
from engine.scheduler import ScheduledRequest, Scheduler
from engine.step_plan import PlannedRequest, StepPlan, StepResult


@dataclass
class StepStats:
    """What the last step did, for metrics."""

    num_scheduled: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    draft_length: int = 0  # the step's k (load-adaptive schedule); 0: no speculation this step
    # propose, prepare, verify, sample (the models' work and its input), handoff and dispatch (the executor's
    # transport), and the engine's own bookkeeping around them: schedule (scheduling and building the plan) and
    # commit (applying the tokens).
    phase_seconds: dict[str, float] = field(default_factory=dict)


class EngineCore:
    def __init__(self, executor: Executor, engine_config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None,
                 eos_token_ids: list[int], spec_config: SpeculativeConfig | None = None) -> None:
        self.executor = executor
        self.config = engine_config
        self.spec_config = spec_config if executor.draft_kv_groups is not None else None
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        bs = engine_config.block_size
        self.target_kv = KVCacheManager(executor.target_kv_groups, executor.target_num_blocks, bs)
        self.draft_kv = (KVCacheManager(executor.draft_kv_groups, executor.draft_num_blocks, bs)
                         if executor.draft_kv_groups is not None else None)
        managers = [self.target_kv] + ([self.draft_kv] if self.draft_kv is not None else [])
        self.scheduler = Scheduler(managers, engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                                   engine_config.max_model_len, num_speculative_tokens=k,
                                   draft_length_fn=self.spec_config.draft_length if self.spec_config else None)
        self.output = OutputProcessor(tokenizer, eos_token_ids, engine_config.max_model_len)
        self.vocab_size = executor.vocab_size
        self.last_step = StepStats()
        self._step_ids = itertools.count()

    # --- requests ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        request.logits_params = logits_params_of(request, self.output.eos_token_ids)
        self.scheduler.add_request(request)

    def validate_request(self, request: Request) -> None:
        """Raise ValueError for a request the engine cannot serve; changes nothing."""
        n, limit = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {limit}, which leaves no room to "
                             f"generate; shorten the prompt to at most {limit - 1} tokens")
        vocab = self.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name, ids in request.params.token_ids_used().items():
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} names token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")

    def abort_request(self, request_id: str) -> Request | None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            req.finish_reason = "abort"
            self.output.release(request_id)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- KV caches -----------------------------------------------------------------------------------
    def kv_managers(self) -> list[tuple[str, KVCacheManager]]:
        """("target" | "draft", its KV manager): the draft's only while the engine has one."""
        return [("target", self.target_kv)] + ([("draft", self.draft_kv)] if self.draft_kv is not None else [])

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError for a prompt whose KV alone outgrows a model's whole cache: it could never run, and
        saying so up front beats failing it once it reaches the head of the queue."""
        for model, kv in self.kv_managers():
            need = -(-num_prompt_tokens // kv.block_size)
            have = min(pool.num_usable for pool in kv.pools)
            if need > have:
                raise ValueError(f"prompt has {num_prompt_tokens} tokens, which need {need} KV blocks of "
                                 f"{kv.block_size} tokens, but the {model} model's KV cache holds {have} blocks "
                                 f"({have * kv.block_size} tokens); shorten the prompt")

    def kv_usage(self) -> dict[tuple[str, int], float]:
        """Fraction of each (model, KV-cache group)'s blocks in use."""
        return {(model, g): kv.usage(g) for model, kv in self.kv_managers() for g in range(kv.num_groups)}

    def kv_blocks_used(self) -> dict[str, int]:
        """Blocks in use per "model/group"."""
        return {f"{model}/{g}": n for model, kv in self.kv_managers() for g, n in enumerate(kv.num_used_blocks())}

    # --- one step ------------------------------------------------------------------------------------
    def step(self, on_dispatched: Callable[[], None] | None = None) -> list[Request]:
        """Run one step; returns the requests that got tokens or finished. on_dispatched: called once the step's
        plan is on its way to the models, before waiting for them (an executor on other processes), so that a
        caller's own work (a server publishing the last step's tokens) overlaps the models' instead of delaying
        the plan."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        stats = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted), sched.draft_length)
        self.last_step = stats
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing runs and the head request does not fit an empty cache: fail it, do not spin.
                req = self.scheduler.waiting[0]
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                req.finish_reason = "abort"
                raise RuntimeError(f"request {req.request_id} ({req.num_tokens} tokens) does not fit in the "
                                   "KV cache even alone; raise the KV budget or lower max_model_len")
            return []
        plan = self.make_plan(sched.scheduled)
        t1 = time.perf_counter()
        if on_dispatched is None:
            result = self.executor.execute(plan)
        else:
            result = self.executor.execute(plan, on_dispatched=on_dispatched)
        t2 = time.perf_counter()
        touched = self.commit(sched.scheduled, result)
        stats.phase_seconds = {**result.phase_seconds, "schedule": t1 - t0, "commit": time.perf_counter() - t2}
        return touched

    def make_plan(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        planned = []
        for s in scheduled:
            r = s.request
            frontier = s.frontier
            tokens = r.all_token_ids
            p = PlannedRequest(
                request_id=r.request_id, token_ids=tokens[r.num_computed_tokens:frontier],
                start_pos=r.num_computed_tokens, num_draft_tokens=s.num_draft_tokens,
                sample=frontier == r.num_tokens,
                block_tables=[list(self.target_kv.block_table(r.request_id, g))
                              for g in range(self.target_kv.num_groups)],
                temperature=r.params.temperature, top_p=r.params.top_p, top_k=r.params.top_k, seed=r.params.seed,
                num_output_tokens=r.num_output_tokens, logprobs=r.params.logprobs, logits_params=r.logits_params,
                output_token_ids=list(r.output_token_ids)
                if r.logits_params is not None and r.logits_params.needs_output_history else None)
            if s.draft_runs:  # else the draft sits this step out (speculation off at this load) and lags
                p.draft_token_ids = tokens[r.num_draft_computed_tokens:frontier]
                p.draft_start_pos = r.num_draft_computed_tokens
                p.draft_block_tables = [list(self.draft_kv.block_table(r.request_id, g))
                                        for g in range(self.draft_kv.num_groups)]
            planned.append(p)
        spec = self.spec_config
        return StepPlan(next(self._step_ids), planned, spec.rejection_sampling if spec else None,
                        spec.synthetic_acceptance_rate if spec else None)

    def commit(self, scheduled: list[ScheduledRequest], result: StepResult) -> list[Request]:
        touched = []
        for n, (s, tokens, accepted) in enumerate(zip(scheduled, result.sampled, result.num_accepted)):
            r = s.request
            k = s.num_draft_tokens
            frontier = s.frontier
            if tokens is None:  # a prefill chunk that did not reach the end of the prompt
                r.num_computed_tokens = frontier
                if s.draft_runs:
                    r.num_draft_computed_tokens = frontier
                continue
            # KV of the fed last token and of the accepted drafts is valid; rejected slots get overwritten.
            r.num_computed_tokens = frontier + accepted
            if s.draft_runs:
                r.num_draft_computed_tokens = frontier + min(accepted, max(k - 1, 0))
            if k:
                r.spec.record(k, accepted)
            kept = self.output.append(r, tokens)
            if result.logprobs is not None and result.logprobs[n] is not None:
                r.output_logprobs.extend(result.logprobs[n][:kept])  # none for tokens past a stop
            touched.append(r)
            if r.status.finished:
                self.scheduler.finish_request(r, r.status)
                self.output.release(r.request_id)
        return touched
