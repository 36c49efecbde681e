"""The target's side of a step: one forward over every planned request (prefill chunks, plain decodes,
and [last token + k drafts] for speculating requests), then sampling or rejection sampling."""

from __future__ import annotations

import time

import torch

from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.sample.from_plan import TARGET_STREAM, sampling_metadata
from engine.sample.sampler import Sampler
from engine.spec.proposer import DraftProposal
from engine.spec.rejection_sampler import rejection_sample
from engine.step_plan import StepPlan, StepResult


class Verifier:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.sampler = Sampler()
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed)
        k = runner.config.num_speculative_tokens
        # Every verify width up to k + 1: a load-adaptive draft length may pick any k per step.
        runner.capture_graphs(list(range(1, k + 2)))

    @torch.inference_mode()
    def verify(self, plan: StepPlan, proposal: DraftProposal | None) -> StepResult:
        t_in = time.perf_counter()
        drafts = proposal.draft_token_lists() if proposal is not None else [[] for _ in plan.requests]
        chunks = [Chunk(r.token_ids + d, r.start_pos, 1 + len(d) if r.sample else 0, r.block_tables)
                  for r, d in zip(plan.requests, drafts)]
        t0 = time.perf_counter()
        events = None
        if self.runner.device.type == "cuda":
            # The forward only queues kernels; the host waits for them at the sampler's sync. CUDA events
            # time the forward on the GPU without a sync of their own, so verify is not booked as sample.
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        logits = self.runner.forward_chunks(chunks)  # [sum of num_logits, V]
        if events is not None:
            events[1].record()
        t1 = time.perf_counter()
        result = self._sample(plan, proposal, drafts, logits)
        t2 = time.perf_counter()
        # After the sampler's .tolist() both events have completed and elapsed_time does not wait; a step that
        # sampled nothing (mid-prefill) did not sync, and keeps the host's figure rather than add a sync.
        done = events is not None and events[1].query()
        verify = events[0].elapsed_time(events[1]) / 1e3 if done else t1 - t0
        # prepare: the host's work before the forward (draft ids to lists, chunks), in-process or on a worker.
        result.phase_seconds = {"prepare": t0 - t_in, "verify": verify, "sample": max(0.0, t2 - t0 - verify)}
        return result

    def _sample(self, plan: StepPlan, proposal: DraftProposal | None, drafts: list[list[int]],
                logits: torch.Tensor) -> StepResult:
        dev = self.runner.device
        rows = [i for i, r in enumerate(plan.requests) if r.sample]
        sampled: list[list[int] | None] = [None] * len(plan.requests)
        accepted = [0] * len(plan.requests)
        if not rows:
            return StepResult(sampled, accepted)
        md = sampling_metadata([plan.requests[i] for i in rows], TARGET_STREAM, self.generator, dev)
        if plan.rejection_sampling is None or not any(drafts[i] for i in rows):
            # No drafts this step (no draft model, or a load-adaptive k of 0): plain sampling, so that
            # speculation switched off costs what no speculation costs.
            # SYNC: new tokens go to the host to be appended, detokenized and checked for stops.
            for i, t in zip(rows, self.sampler(logits, md).tolist()):
                sampled[i] = [t]
            return StepResult(sampled, accepted)
        counts = [1 + len(drafts[i]) for i in rows]
        max_k = max(counts) - 1
        # Verify logits padded to [num_rows, max_k + 1, V]; padding rows are never read.
        target_logits = logits.new_zeros(len(rows), max_k + 1, logits.shape[-1])
        row_of = torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(counts, device=dev))
        col_of = torch.cat([torch.arange(c, device=dev) for c in counts])
        target_logits[row_of, col_of] = logits
        row_idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        if proposal is not None:  # the ids may be on the host (DraftProposal.to_host)
            ids = proposal.draft_token_ids
            draft_ids = ids[torch.tensor(rows, device=ids.device), :max_k].to(dev)  # no device-to-host index
        else:
            draft_ids = torch.empty(len(rows), 0, dtype=torch.int64, device=dev)
        q = None
        if proposal is not None and proposal.draft_probs is not None and max_k:
            q = proposal.draft_probs[row_idx, :max_k]
        num_drafts = torch.tensor([c - 1 for c in counts], dtype=torch.int64, device=dev)
        out = rejection_sample(draft_ids, num_drafts, q, target_logits, md, plan.rejection_sampling,
                               plan.synthetic_acceptance_rate)
        # SYNC: accepted tokens go to the host to be appended, detokenized and checked for stops.
        num_acc = out.num_accepted.tolist()
        toks = out.output_token_ids.tolist()
        for j, i in enumerate(rows):
            sampled[i] = toks[j][:num_acc[j] + 1]
            accepted[i] = num_acc[j]
        return StepResult(sampled, accepted)
