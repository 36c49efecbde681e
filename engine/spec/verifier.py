"""The target's side of a step: one forward over every planned request (prefill chunks, plain decodes,
and [last token + k drafts] for speculating requests), then sampling or rejection sampling."""

from __future__ import annotations

import time

import torch

from engine.host_copy import to_device
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, DeviceTokens
from engine.sample.from_plan import TARGET_STREAM, sampling_metadata
from engine.sample.sampler import Sampler
from engine.spec.proposer import DraftProposal
from engine.spec.rejection_sampler import rejection_sample
from engine.step_plan import StepPlan, StepResult


class Verifier:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        # The device as tensors report it ("cuda" -> "cuda:0"), for comparing with where a proposal's ids are.
        self._device = torch.empty(0, device=runner.device).device
        self.sampler = Sampler()
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed)
        k = runner.config.num_speculative_tokens
        # Every verify width up to k + 1: a load-adaptive draft length may pick any k per step.
        runner.capture_graphs(list(range(1, k + 2)))

    @torch.inference_mode()
    def verify(self, plan: StepPlan, proposal: DraftProposal | None) -> StepResult:
        t_in = time.perf_counter()
        reqs = plan.requests
        dev = self.runner.device
        device_tokens = None
        if proposal is None:
            counts = [0] * len(reqs)
            token_ids = [r.token_ids for r in reqs]
            draft_ids = None
        elif self.ids_on_device(proposal):
            # A draft in this process: its ids stay on the device. The host builds the verify input with
            # placeholders and queues the forward behind the draft's kernels; nothing waits for the draft.
            counts = [r.num_draft_tokens for r in reqs]  # the proposal's counts: the plan sets them
            token_ids = [r.token_ids + [0] * k for r, k in zip(reqs, counts)]
            draft_ids = proposal.draft_token_ids
            device_tokens = self._device_tokens(reqs, counts, draft_ids)
        else:
            drafts = proposal.draft_token_lists()  # a remote draft's proposal arrives with its ids on the host
            counts = [len(d) for d in drafts]
            token_ids = [r.token_ids + d for r, d in zip(reqs, drafts)]
            draft_ids = proposal.draft_token_ids.to(dev, non_blocking=True)
        chunks = [Chunk(ids, r.start_pos, 1 + k if r.sample else 0, r.block_tables)
                  for r, ids, k in zip(reqs, token_ids, counts)]
        t0 = time.perf_counter()
        events = None
        if dev.type == "cuda":
            # The forward only queues kernels; the host waits for them at the sampler's sync. CUDA events
            # time the forward on the GPU without a sync of their own, so verify is not booked as sample.
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        logits = self.runner.forward_chunks(chunks, device_tokens)  # [sum of num_logits, V]
        if events is not None:
            events[1].record()
        t1 = time.perf_counter()
        result = self._sample(plan, proposal, draft_ids, counts, logits)
        t2 = time.perf_counter()
        # After the sampler's .tolist() both events have completed and elapsed_time does not wait; a step that
        # sampled nothing (mid-prefill) did not sync, and keeps the host's figure rather than add a sync.
        done = events is not None and events[1].query()
        verify = events[0].elapsed_time(events[1]) / 1e3 if done else t1 - t0
        # prepare: the host's work before the forward (draft ids to lists, chunks), in-process or on a worker.
        result.phase_seconds = {"prepare": t0 - t_in, "verify": verify, "sample": max(0.0, t2 - t0 - verify)}
        return result

    def ids_on_device(self, proposal: DraftProposal) -> bool:
        """Whether the proposal's ids are on this model's device (a draft in the same process), so the verify
        input takes them there; otherwise (a remote draft's host tensors on a GPU target) via host lists."""
        return proposal.draft_token_ids.device == self._device

    def _device_tokens(self, reqs: list, counts: list[int], draft_ids: torch.Tensor) -> DeviceTokens | None:
        """Where each request's drafts go in the step's flat input, gathered from draft_ids [num_reqs, max_k]."""
        max_k = draft_ids.shape[1]
        if max(counts, default=0) > max_k:
            raise ValueError(f"the plan asks for {max(counts)} drafts, the proposal has {max_k}")
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for i, (r, k) in enumerate(zip(reqs, counts)):
            start = offset + len(r.token_ids)
            dst.extend(range(start, start + k))
            src.extend(range(i * max_k, i * max_k + k))
            offset = start + k
        if not dst:
            return None
        index = to_device([dst, src], torch.int64, self.runner.device)
        return DeviceTokens(index[0], draft_ids.reshape(-1).index_select(0, index[1]))

    def _sample(self, plan: StepPlan, proposal: DraftProposal | None, draft_ids: torch.Tensor | None,
                counts: list[int], logits: torch.Tensor) -> StepResult:
        """logits: [sum of num_logits, V]; draft_ids: [num_reqs, >= max k] int64 on the device, or None."""
        dev = self.runner.device
        reqs = plan.requests
        rows = [i for i, r in enumerate(reqs) if r.sample]
        sampled: list[list[int] | None] = [None] * len(reqs)
        accepted = [0] * len(reqs)
        if not rows:
            return StepResult(sampled, accepted)
        md = sampling_metadata([reqs[i] for i in rows], TARGET_STREAM, self.generator, dev)
        if plan.rejection_sampling is None or draft_ids is None or not any(counts[i] for i in rows):
            # No drafts this step (no draft model, or a load-adaptive k of 0): plain sampling, so that
            # speculation switched off costs what no speculation costs.
            # SYNC: new tokens go to the host to be appended, detokenized and checked for stops.
            for i, t in zip(rows, self.sampler(logits, md).tolist()):
                sampled[i] = [t]
            return StepResult(sampled, accepted)
        widths = [1 + counts[i] for i in rows]
        max_k = max(widths) - 1
        all_rows = len(rows) == len(reqs)
        row_index = None if all_rows else to_device(rows, torch.int64, dev)
        if all_rows and min(widths) == max_k + 1:
            # Every request verifies the same number of drafts (always so at batch 1): the logits already
            # have the padded layout.
            target_logits = logits.view(len(rows), max_k + 1, logits.shape[-1])
        else:
            # Verify logits padded to [num_rows, max_k + 1, V]; padding rows are never read.
            target_logits = logits.new_zeros(len(rows), max_k + 1, logits.shape[-1])
            row_of = [n for n, w in enumerate(widths) for _ in range(w)]
            where = to_device([row_of, [j for w in widths for j in range(w)]], torch.int64, dev)
            target_logits[where[0], where[1]] = logits
        row_ids = (draft_ids if all_rows else draft_ids.index_select(0, row_index))[:, :max_k]
        q = None
        if proposal is not None and proposal.draft_probs is not None and max_k:
            q = (proposal.draft_probs if all_rows else proposal.draft_probs.index_select(0, row_index))[:, :max_k]
        num_drafts = to_device([w - 1 for w in widths], torch.int64, dev)
        out = rejection_sample(row_ids, num_drafts, q, target_logits, md, plan.rejection_sampling,
                               plan.synthetic_acceptance_rate)
        # SYNC: accepted tokens go to the host to be appended, detokenized and checked for stops (one copy).
        packed = torch.cat([out.num_accepted[:, None], out.output_token_ids], dim=1).tolist()
        for row, i in zip(packed, rows):
            sampled[i] = row[1:row[0] + 2]
            accepted[i] = row[0]
        return StepResult(sampled, accepted)
