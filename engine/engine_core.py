"""The engine's step loop: schedule, propose (draft), verify (target), sample, commit.

Without a draft this is plain continuous batching. With one, every decoding request runs one
speculation step per engine step (DESIGN.md, "One speculation step"), batched with other requests'
prefill chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig, SpeculativeConfig
from engine.detokenizer import OutputProcessor
from engine.request import Request, RequestStatus
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, build_step_input
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.scheduler import Scheduler, ScheduledRequest
from engine.spec.proposer import DraftProposer
from engine.spec.rejection_sampler import rejection_sample

_MASK64 = (1 << 63) - 1


def request_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request at one output position. Seeding from (seed, position) makes
    the request's samples independent of batch composition and of preemption/recompute."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((seed, position, stream)) & _MASK64)
    return g


@dataclass
class StepStats:
    """What the last step did, for metrics."""

    num_scheduled: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # propose, verify, sample


class EngineCore:
    def __init__(self, target: ModelRunner, engine_config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None,
                 draft: ModelRunner | None = None, spec_config: SpeculativeConfig | None = None) -> None:
        self.target = target
        self.draft = draft
        self.config = engine_config
        self.spec_config = spec_config if draft is not None else None
        self.device = engine_config.device
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        managers = [target.kv_manager] + ([draft.kv_manager] if draft is not None else [])
        self.scheduler = Scheduler(managers, engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                                   engine_config.max_model_len, num_speculative_tokens=k)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(engine_config.seed)
        self.proposer = None
        if draft is not None and self.spec_config is not None:
            keep_probs = self.spec_config.rejection_sampling == "probabilistic"
            self.proposer = DraftProposer(draft, self.sampler, keep_probs)
        self.output = OutputProcessor(tokenizer, target.model_config.eos_token_ids, engine_config.max_model_len)
        self.last_step = StepStats()

    # --- requests ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n, limit = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {limit}, which leaves no room to "
                             f"generate; shorten the prompt to at most {limit - 1} tokens")
        vocab = self.target.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            req.finish_reason = "abort"
            self.output.release(request_id)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- sampling metadata ---------------------------------------------------------------------------
    def sampling_metadata(self, requests: list[Request], stream: int) -> SamplingMetadata:
        gens = {i: request_generator(r.params.seed, r.num_output_tokens, stream, self.device)
                for i, r in enumerate(requests) if r.params.seed is not None}
        return SamplingMetadata.from_lists(
            [r.params.temperature for r in requests], [r.params.top_p for r in requests],
            [r.params.top_k for r in requests], gens, self.generator, self.device)

    # --- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got tokens or finished."""
        sched = self.scheduler.schedule()
        stats = StepStats(len(sched.scheduled), sched.num_batched_tokens, len(sched.preempted))
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

        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in sched.scheduled]
        draft_probs = None
        if self.proposer is not None:
            md = self.sampling_metadata([s.request for s in sched.scheduled], stream=1)
            proposal = self.proposer.propose(sched.scheduled, md)
            drafts, draft_probs = proposal.draft_token_lists(), proposal.draft_probs
        t1 = time.perf_counter()

        chunks, sample_rows = [], []
        for i, s in enumerate(sched.scheduled):
            r = s.request
            frontier = r.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens
            fed = r.all_token_ids[r.num_computed_tokens:frontier] + drafts[i]
            completes = frontier == r.num_tokens
            chunks.append(Chunk(r.request_id, fed, r.num_computed_tokens, 1 + len(drafts[i]) if completes else 0))
            if completes:
                sample_rows.append(i)
        logits = self.target.execute(build_step_input(chunks, self.target.kv_manager, self.device))
        t2 = time.perf_counter()

        sampled = self._sample(sched.scheduled, sample_rows, drafts, draft_probs, logits)
        t3 = time.perf_counter()
        stats.phase_seconds = {"propose": t1 - t0, "verify": t2 - t1, "sample": t3 - t2}
        return self._commit(sched.scheduled, sampled, drafts)

    def _sample(self, scheduled: list[ScheduledRequest], rows: list[int], drafts: list[list[int]],
                draft_probs: torch.Tensor | None, logits: torch.Tensor) -> dict[int, tuple[list[int], int]]:
        """Returns {scheduled index: (tokens to append, accepted draft count)}."""
        if not rows:
            return {}
        requests = [scheduled[i].request for i in rows]
        md = self.sampling_metadata(requests, stream=0)
        if self.proposer is None:
            # SYNC: the new tokens go to the host to be appended, detokenized and checked for stops.
            tokens = self.sampler(logits, md).tolist()
            return {i: ([t], 0) for i, t in zip(rows, tokens)}
        counts = [1 + len(drafts[i]) for i in rows]
        max_k = max(counts) - 1
        vocab = logits.shape[-1]
        # Verify logits padded to [num_rows, max_k + 1, V]; rows with fewer drafts repeat nothing.
        target_logits = logits.new_zeros(len(rows), max_k + 1, vocab)
        draft_ids = torch.full((len(rows), max(max_k, 1)), -1, dtype=torch.int64, device=self.device)
        q = None
        if draft_probs is not None and max_k > 0:
            q = draft_probs[torch.tensor(rows, device=self.device), :max(max_k, 1)]
        offset = 0
        for j, (i, c) in enumerate(zip(rows, counts)):
            target_logits[j, :c] = logits[offset:offset + c]
            if c > 1:
                draft_ids[j, :c - 1] = torch.tensor(drafts[i], device=self.device)
            offset += c
        num_drafts = torch.tensor([c - 1 for c in counts], dtype=torch.int64, device=self.device)
        spec = self.spec_config
        assert spec is not None
        out = rejection_sample(draft_ids[:, :max_k] if max_k else draft_ids[:, :0], num_drafts,
                               q if max_k else None, target_logits, md, spec.rejection_sampling,
                               spec.synthetic_acceptance_rate)
        # SYNC: accepted tokens go to the host to be appended, detokenized and checked for stops.
        num_acc = out.num_accepted.tolist()
        tok = out.output_token_ids.tolist()
        return {i: (tok[j][:num_acc[j] + 1], num_acc[j]) for j, i in enumerate(rows)}

    def _commit(self, scheduled: list[ScheduledRequest], sampled: dict[int, tuple[list[int], int]],
                drafts: list[list[int]]) -> list[Request]:
        touched = []
        for i, s in enumerate(scheduled):
            r = s.request
            k = len(drafts[i])
            frontier = r.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens
            if i not in sampled:  # a prefill chunk that did not reach the end of the prompt
                r.num_computed_tokens = frontier
                r.num_draft_computed_tokens = frontier
                continue
            tokens, accepted = sampled[i]
            # KV of the fed last token and of the accepted drafts is valid; rejected slots get overwritten.
            r.num_computed_tokens = frontier + accepted
            r.num_draft_computed_tokens = frontier + min(accepted, max(k - 1, 0))
            if k:
                r.spec.record(k, accepted)
            self.output.append(r, tokens)
            touched.append(r)
            if r.status.finished:
                self.scheduler.finish_request(r, r.status)
                self.output.release(r.request_id)
        return touched
