"""The draft proposer: k draft tokens per decoding request, from the draft model's own KV cache.

Step 0 catches the draft up to the target's frontier for every scheduled request (the tokens it has
not seen: a prefill chunk, or the last accepted token and the bonus token) and samples the first
draft token of each decoding request. Steps 1..k-1 feed one draft token each. Between steps the
attention metadata of EVERY draft KV-cache group is rebuilt: positions advance, a step may cross a
block boundary (new slot), and a sliding window's start moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, build_step_input
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.scheduler import ScheduledRequest


@dataclass
class DraftProposal:
    draft_token_ids: torch.Tensor  # [num_reqs, max_k] int64; -1 beyond num_draft_tokens
    num_draft_tokens: torch.Tensor  # [num_reqs] int64
    draft_probs: torch.Tensor | None  # [num_reqs, max_k, vocab] float32; q after temperature/top-k/top-p

    def draft_token_lists(self) -> list[list[int]]:
        # SYNC: the target's verify input is built on the host from these ids.
        ids, n = self.draft_token_ids.tolist(), self.num_draft_tokens.tolist()
        return [row[:k] for row, k in zip(ids, n)]


class DraftProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, keep_probs: bool) -> None:
        self.runner = runner
        self.sampler = sampler
        self.keep_probs = keep_probs  # only probabilistic rejection reads q

    def propose(self, scheduled: list[ScheduledRequest], md: SamplingMetadata) -> DraftProposal:
        """md: one row per scheduled request (the draft's own generators for seeded requests)."""
        dev = self.runner.device
        num_reqs = len(scheduled)
        ks = [s.num_draft_tokens for s in scheduled]
        max_k = max(ks)
        ids = torch.full((num_reqs, max(max_k, 1)), -1, dtype=torch.int64, device=dev)
        probs = None
        if self.keep_probs and max_k:
            probs = torch.zeros(num_reqs, max_k, self.runner.vocab_size, dtype=torch.float32, device=dev)

        chunks = []
        frontiers = []
        for s in scheduled:
            r = s.request
            frontier = r.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens
            frontiers.append(frontier)
            toks = r.all_token_ids[r.num_draft_computed_tokens:frontier]
            chunks.append(Chunk(r.request_id, toks, r.num_draft_computed_tokens, 1 if s.num_draft_tokens else 0))
        rows = [i for i, k in enumerate(ks) if k > 0]
        last: list[int] = []
        for j in range(max_k):
            if j > 0:
                rows = [i for i in rows if ks[i] > j]
                chunks = [Chunk(scheduled[i].request.request_id, [last[i]], frontiers[i] + j - 1, 1) for i in rows]
            # Metadata for every draft KV-cache group is rebuilt from this step's positions.
            logits = self.runner.execute(build_step_input(chunks, self.runner.kv_manager, dev))
            sub = _select_rows(md, rows)
            tok, p = self.sampler.sample_with_probs(logits, sub)
            row_idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            ids[row_idx, j] = tok
            if probs is not None:
                probs[row_idx, j] = p
            # SYNC: the next draft step's input ids are built on the host.
            last = ids[:, j].tolist()
        if max_k == 0 and chunks:
            # Only catch-up work (prefill chunks, k = 0 decodes): keep the draft's KV in step.
            self.runner.execute(build_step_input(chunks, self.runner.kv_manager, dev))
        return DraftProposal(ids[:, :max_k], torch.tensor(ks, dtype=torch.int64, device=dev), probs)


def _select_rows(md: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    idx = torch.tensor(rows, dtype=torch.int64, device=md.temperature.device)
    temps = md.temperature[idx]
    top_p, top_k = md.top_p[idx], md.top_k[idx]
    gens = {n: md.generators[i] for n, i in enumerate(rows) if i in md.generators}
    return SamplingMetadata(temps, top_p, top_k, md.all_greedy, md.all_random, md.no_top_p, md.no_top_k,
                            gens, md.default_generator)
