"""Continuous batching: which requests run this step, how many tokens each, with KV for both models.

Policy (as vLLM v1): running requests first, in arrival order, each gets its remaining tokens (a decode
step: 1 + its draft length) within the step's token budget; prefills are chunked to fit. When a model's
KV cache cannot hold a running request's next tokens, the most recently arrived running request is
preempted: its blocks are freed in both models and it is recomputed later from its tokens so far.
Waiting requests are admitted while budget, sequence slots and KV blocks allow.

Speculation adapts to load: each step takes its draft length from the batch size (`draft_length_fn`, the
SpeculativeConfig's schedule). A step with draft length 0 does not run the draft at all: the draft falls
behind (its KV is not allocated or written) and catches up on the missed tokens, in one chunk, at the next
step that speculates. That catch-up is not charged to the step's token budget (only the target's tokens are): a
kernel-path runner whose input buffers cannot hold it runs its leading tokens ahead, in forwards that fit
(engine/runner/model_runner.py, `cut_to_fit`).

Asynchronous scheduling (EngineCore): step n+1 is scheduled while step n is in flight, so a request's committed
state lags by that step. `schedule(optimistic=True)` plans from the committed state advanced by the step in flight
(`Request.inflight`): a prefill chunk short of the prompt's end is exact (the next chunk follows it); a step that
samples may add up to k + 1 tokens, so the next step's KV is allocated for all of them; its k goes out unshrunk
and the sides shrink it from their exact counts (near max_tokens and max_model_len) as a synchronous schedule
would; a request that may already be done sits the step out. Such a step never preempts (blocks freed under a
step in flight could be written by it): when one would be needed, the output says `blocked` and the engine lets
the step in flight land first.

Prefix caching (engine/kv_cache): a waiting request is admitted from the longest prefix of full blocks that every
KV-cache group of the target can supply from its cache (`_prefix_hit`); the target's progress starts there and
chunked prefill computes only the rest. The draft starts from its own hit, the longest prefix up to the target's
that its groups can supply, and computes the positions between the two as the catch-up it does after steps
without speculation: in the admission step's draft forward when the draft runs then (the gap counts against the
step's token budget, and the target's hit is cut where the gap would not fit), else at the first step that runs
the draft for the request, with explicit input (`Request.draft_gap_unsent`). Whenever the draft proposes, its KV
is complete. Where the draft cannot compute positions the target skipped (an EAGLE-3 head, which reads the target's
states of each position: `draft_catches_up` False) both models start from the prefix both hold. At least the last
token is always computed, since the step must produce logits to sample from. Freed and preempted requests drop
their references only: their cached blocks stay reusable (by anyone, the resumed request included) until evicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache.block_hash import update_block_hashes
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # target tokens fed this step, draft slots included
    num_draft_tokens: int  # k for this request this step; 0 while prefilling or without speculation
    draft_runs: bool = False  # the draft processes this request this step (catch-up, prefill, proposals)
    # Where the target's input starts, and the draft's; -1: the request's committed counts. Set when the request
    # has a step in flight: a chunk's successor starts where that chunk ends.
    start: int = -1
    draft_start: int = -1
    # The input is left to the sides (StepPlan: token_ids None): it follows a step in flight that samples.
    open_input: bool = False

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.request.num_computed_tokens
        if self.draft_start < 0:
            self.draft_start = self.request.num_draft_computed_tokens

    @property
    def frontier(self) -> int:
        """Sequence length the target has seen after this step's committed tokens (drafts not counted); for an
        open input, an upper bound (the step in flight before it accepted every draft)."""
        return self.start + self.num_new_tokens - self.num_draft_tokens

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens, so it samples (and may add up to k + 1 tokens)."""
        return self.open_input or self.frontier >= self.request.num_tokens


@dataclass
class PrefixHit:
    """A waiting request's start from cached blocks: where each model starts, per model its tables."""

    num_tokens: int  # where the target starts: a multiple of the block size, below the request's length; 0: no hit
    draft_tokens: int  # where the draft starts: a multiple of the block size, at most num_tokens
    blocks: list[list[list[int]]]  # [model][group] block ids of the model's hit (NULL_BLOCK outside sliding windows)
    model_hits: list[int]  # [model] tokens that model alone could have supplied (its prefix-cache hit count)
    num_queried: int  # tokens looked up

    def count(self, kv_managers: list[KVCacheManager]) -> None:
        """Add this lookup to each model's prefix-cache counters (once the request is admitted)."""
        for kv, n in zip(kv_managers, self.model_hits):
            kv.prefix_queries += self.num_queried
            kv.prefix_hits += n


class _NeedsPreemption(Exception):
    """A request's next step, planned while its last step is in flight, needs KV blocks that only a preemption
    would free: the engine lets the steps in flight land and schedules synchronously."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    draft_length: int = 0  # the step's k from the load-adaptive schedule (0: the draft does not run)
    blocked: bool = False  # an optimistic schedule stopped where a preemption would have been needed

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_managers: list[KVCacheManager], max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_speculative_tokens: int = 0,
                 draft_length_fn: Callable[[int], int] | None = None, enable_prefix_caching: bool = False) -> None:
        # kv_managers[0] is the target's; a draft's, when there is one, follows.
        self.kv_managers = kv_managers
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        # batch size -> the step's k; None: num_speculative_tokens at every batch size.
        self.draft_length_fn = draft_length_fn
        self.step_draft_length = num_speculative_tokens  # k of the step being scheduled
        # (request, the step's k) -> that request's k, at most the step's (the draft length rule's per-request
        # acceptance, engine/speculation/draft_length_rule.py); None: the step's k for every request.
        self.request_draft_length: Callable[[Request, int], int] | None = None
        # The draft drafts each window ahead (engine/speculation/ahead/proposer.py): its KV must reach that far.
        self.speculation_ahead = False
        # The draft can compute any position from its tokens (a draft model): a prefix hit of the target's that the
        # draft's cache does not cover is caught up by the draft. False (an EAGLE-3 head, which needs the target's
        # states of each position it runs): both models start from the prefix both hold.
        self.draft_catches_up = True
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # --- requests in and out -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus, free_kv: bool = True) -> None:
        """End a request (done, or aborted at any time) and return its blocks to both pools. free_kv=False: the
        caller frees them later (`free_kv`), once no step in flight can write them."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_kv:
            self.free_kv(request)
        self.requests.pop(request.request_id, None)

    def free_kv(self, request: Request) -> None:
        for kv in self.kv_managers:
            kv.free(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ------------------------------------------------------------------------------------
    def draft_length(self, request: Request, num_tokens: int | None = None, num_output: int | None = None) -> int:
        """k for this request, shrunk near max_tokens and max_model_len so a verify never overruns. num_tokens /
        num_output: upper bounds to use instead of the committed counts (a step in flight)."""
        if not self.step_draft_length:
            return 0
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        num_output = request.num_output_tokens if num_output is None else num_output
        room_output = request.params.max_tokens - num_output - 1
        room_context = self.max_model_len - num_tokens - 1
        return max(0, min(self._request_k(request), room_output, room_context))

    def _request_k(self, request: Request) -> int:
        k = self.step_draft_length
        return k if self.request_draft_length is None or not k else self.request_draft_length(request, k)

    def _step_draft_length(self) -> int:
        """This step's k from its load: the requests that want to run, as many as a step may hold."""
        if not self.num_speculative_tokens or self.draft_length_fn is None:
            return self.num_speculative_tokens
        batch = min(self.max_num_seqs, len(self.running) + len(self.waiting))
        return max(0, min(self.num_speculative_tokens, self.draft_length_fn(batch)))

    @property
    def _draft_runs(self) -> bool:
        """Whether the draft model works this step: it has a KV manager and the step speculates."""
        return len(self.kv_managers) > 1 and self.step_draft_length > 0

    def _try_allocate(self, request: Request, num_new: int, k: int, start: int | None = None,
                      hit: PrefixHit | None = None) -> bool:
        """Allocate both models' KV for this step, or nothing. start: where the target's input begins (default: the
        committed count; an upper bound after a step in flight). The committed counts decide what sliding windows
        release: they never exceed the true ones, so nothing a step in flight may still read is released. With a
        prefix hit, every model's table starts from its own cached blocks, the draft's too when it sits this step
        out (it then catches up from its hit, which may lie before the target's)."""
        rid = request.request_id
        start = request.num_computed_tokens if start is None else start
        if hit is not None and not hit.num_tokens:
            hit = None
        # (manager, computed, end, prefix) for each model that takes blocks this step
        plans = [(self.kv_managers[0], request.num_computed_tokens, start + num_new, hit.blocks[0] if hit else None)]
        if len(self.kv_managers) > 1 and (self._draft_runs or hit is not None):
            # The draft holds KV up to the target's frontier plus k - 1 drafts after the step; drafting ahead, also
            # for the next window (the last draft, a guessed bonus token and k - 1 more drafts).
            end = start + num_new - k + max(0, k - 1) if self._draft_runs else request.num_draft_computed_tokens
            if self._draft_runs and k and self.speculation_ahead:
                end = min(end + self.step_draft_length + 1, self.max_model_len)
            plans.append((self.kv_managers[1], request.num_draft_computed_tokens, end, hit.blocks[1] if hit else None))
        if not all(kv.can_allocate(rid, computed, end, prefix) for kv, computed, end, prefix in plans):
            return False
        for kv, computed, end, prefix in plans:
            kv.allocate(rid, computed, end, prefix)
        return True

    # --- prefix caching ------------------------------------------------------------------------------
    def _prefix_hit(self, request: Request, max_lead: int | None = None) -> PrefixHit | None:
        """The longest cached prefix every group of the target can supply, and the draft's longest up to it (None:
        caching is off, or the request wants its prompt's logprobs, which only computing its positions gives).
        max_lead: at most this many tokens between the draft's start and the target's (the draft's catch-up in
        the admission step); None: no bound."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return None
        bs = self.kv_managers[0].block_size
        hashes = update_block_hashes(request, bs)
        max_blocks = (request.num_tokens - 1) // bs  # leave the last token to compute: its logits are sampled
        # Per model, entry h: whether every group of it can supply the first h blocks (not monotone in h with
        # sliding windows, so the choices below scan these arrays rather than compare lengths).
        valid = [kv.valid_prefix_lengths(hashes, max_blocks) for kv in self.kv_managers]
        model_hits = [bs * max(h for h, ok in enumerate(own) if ok) for own in valid]
        if len(valid) == 1:
            n = d = model_hits[0] // bs
        elif not self.draft_catches_up:
            n = d = max(h for h in range(max_blocks + 1) if valid[0][h] and valid[1][h])
        else:
            n, d = 0, 0
            draft_below = 0  # the draft's longest valid prefix up to h, as h grows
            for h in range(max_blocks + 1):
                if valid[1][h]:
                    draft_below = h
                if valid[0][h] and (max_lead is None or (h - draft_below) * bs <= max_lead):
                    n, d = h, draft_below
        blocks = [kv.prefix_blocks(hashes, m) for kv, m in zip(self.kv_managers, (n, d))] if n else []
        return PrefixHit(n * bs, d * bs if n else 0, blocks, model_hits, request.num_tokens)

    def cache_committed_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to each model's cache; called after each commit."""
        if not self.enable_prefix_caching:
            return
        hashes = update_block_hashes(request, self.kv_managers[0].block_size)
        self.kv_managers[0].cache_blocks(request.request_id, hashes, request.num_computed_tokens)
        if len(self.kv_managers) > 1:
            self.kv_managers[1].cache_blocks(request.request_id, hashes, request.num_draft_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        for kv in self.kv_managers:
            kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.draft_gap_unsent = False
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _num_new(self, request: Request, budget: int) -> tuple[int, int]:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 1:  # decoding: the last token plus this step's drafts, unsplittable
            k = self.draft_length(request)
            return (1 + k, k) if 1 + k <= budget else (1, 0) if budget >= 1 else (0, 0)
        return min(remaining, budget), 0

    def _schedule_after_inflight(self, req: Request, budget: int) -> ScheduledRequest | None:
        """The next step of a request whose last step is still in flight: a ScheduledRequest, or None to sit this
        step out. Raises _NeedsPreemption when its KV does not fit."""
        s = req.inflight
        assert s is not None
        if not s.samples:  # a prefill chunk short of the prompt's end: the next chunk follows it, exactly
            draft_start = s.frontier if s.draft_runs else req.num_draft_computed_tokens
            remaining = req.num_tokens - s.frontier
            k = self.draft_length(req) if remaining == 1 else 0
            num_new = 1 + k if remaining == 1 else min(remaining, budget)
            if num_new > budget:
                return None
            if not self._try_allocate(req, num_new, k, start=s.frontier):
                raise _NeedsPreemption
            return ScheduledRequest(req, num_new, k, self._draft_runs, start=s.frontier, draft_start=draft_start)
        # It samples: up to k + 1 tokens more. Plan for all of them; sit out if they could end the request. Its
        # input began at the committed frontier (any step before it has landed; an open step's own `frontier`
        # was only an upper bound).
        num_tokens_max = req.num_tokens + s.num_draft_tokens + 1
        num_output_max = req.num_output_tokens + s.num_draft_tokens + 1
        if num_tokens_max >= self.max_model_len or num_output_max >= req.params.max_tokens:
            return None
        if req.draft_gap_unsent and self._draft_runs:
            # The draft would catch up on tokens before those the sides know of the request (it started behind the
            # target's prefix hit and has not run since): an open entry cannot carry them, so it sits this step
            # out and runs the next one with explicit input.
            return None
        # The step's k, unshrunk: the sides shrink it from their exact counts (StepPlan's token_limit), so that it
        # is the k a synchronous schedule would draft here. KV covers the unshrunk k, up to max_model_len.
        k = self._request_k(req)
        if 1 + k > budget:
            return None
        k_kv = max(0, min(k, self.max_model_len - num_tokens_max))
        if not self._try_allocate(req, 1 + k_kv, k_kv, start=num_tokens_max - 1):
            raise _NeedsPreemption
        return ScheduledRequest(req, 1 + k, k, self._draft_runs, start=num_tokens_max - 1, open_input=True)

    def schedule(self, optimistic: bool = False) -> SchedulerOutput:
        """optimistic: steps may be in flight (asynchronous scheduling); see the module docstring."""
        self.step_draft_length = self._step_draft_length()
        out = SchedulerOutput(draft_length=self.step_draft_length)
        draft_runs = self._draft_runs
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if optimistic and req.inflight is not None:
                try:
                    s = self._schedule_after_inflight(req, budget)
                except _NeedsPreemption:
                    out.blocked = True
                    return out
                if s is not None:
                    out.scheduled.append(s)
                    scheduled_ids.add(req.request_id)
                    budget -= s.num_new_tokens
                i += 1
                continue
            num_new, k = self._num_new(req, budget)
            if optimistic and not self._try_allocate(req, num_new, k):
                out.blocked = True
                return out
            while not optimistic and not self._try_allocate(req, num_new, k):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, k, draft_runs))
                scheduled_ids.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing later in the list can run either
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                # When the draft runs this step it catches up from its own hit to the target's in this step's
                # forward: that gap counts against the budget, with room left for at least one new token.
                hit = self._prefix_hit(req, max_lead=budget - 1 if draft_runs else None)
                if hit is not None and hit.num_tokens:
                    req.num_computed_tokens, req.num_draft_computed_tokens = hit.num_tokens, hit.draft_tokens
                num_new, k = self._num_new(req, budget)
                lead = 0  # the draft's catch-up before the target's start, run this step
                if hit is not None and hit.num_tokens:
                    # The rest runs as the prefill it replaces would, without drafts even when one token is left:
                    # a seeded request then samples the same tokens whether or not its prefix was cached.
                    lead = hit.num_tokens - hit.draft_tokens if draft_runs else 0
                    num_new, k = min(req.num_tokens - req.num_computed_tokens, budget - lead), 0
                if not self._try_allocate(req, num_new, k, hit=hit):
                    req.num_computed_tokens = req.num_draft_computed_tokens = 0
                    break
                if hit is not None:
                    hit.count(self.kv_managers)
                # The sides learn a request's tokens from its first entry's start on: those the draft still has to
                # catch up on, before the target's start, go out with the first entry that runs the draft.
                req.draft_gap_unsent = len(self.kv_managers) > 1 and not draft_runs and (
                    req.num_draft_computed_tokens < req.num_computed_tokens)
                if req.num_cached_tokens is None:  # the first admission's hit is the one reported
                    req.num_cached_tokens = req.num_computed_tokens
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, num_new, k, draft_runs))
                budget -= num_new + lead
        return out
