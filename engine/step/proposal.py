"""A step's draft proposal: what the draft side (engine/speculation/proposer.py) hands the target side's verifier,
in process or across workers; a module of its own so that the step's plumbing (plan merging, workers) can read it
without the proposer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftProposal:
    """A step's drafts. In process the ids stay on the draft's device; a draft worker sends them to the target's
    workers as host lists (`to_host`): a few small ints pickle in microseconds, where Ray pickles a CPU tensor
    through torch's own serialization, about 0.2 ms each way."""

    # [num_reqs, max_k] int64 on the draft's device, -1 beyond a request's k; or, from `to_host`, each request's
    # k ids as a host list
    draft_token_ids: torch.Tensor | list[list[int]]
    # [num_reqs, max_k, vocab] float32; q after temperature/top-k/top-p: the distribution each draft was drawn from
    # (with Saguaro sampling, q', the scaled one: engine/sample/saguaro.py)
    draft_probs: torch.Tensor | None
    # [num_reqs, max_k] int64 on the draft's device: per draft, the draft's most likely token other than it there
    # (where a rejection at that draft would most likely leave the target's token); only where speculation ahead
    # drafts branches (engine/speculation/ahead/branches.py), None otherwise. Stays on the draft's side (`to_host`
    # drops it).
    alt_token_ids: torch.Tensor | None = None

    def host_rows(self, counts: list[int]) -> list[list[int]]:
        """Each request's draft ids on the host; counts: the plan's k per request."""
        if isinstance(self.draft_token_ids, list):
            return self.draft_token_ids
        # SYNC: waits for the draft's kernels; only where the ids must leave the draft's device (a draft
        # worker's proposal), or for a caller that asks for them on the host.
        return [row[:k] for row, k in zip(self.draft_token_ids.tolist(), counts)]

    def alt_rows(self, counts: list[int]) -> list[list[int]] | None:
        """Each request's runner-up tokens on the host (None without them)."""
        if self.alt_token_ids is None:
            return None
        # SYNC: speculation ahead builds its rejection branches on the host, after the proposal has gone out.
        return [row[:k] for row, k in zip(self.alt_token_ids.tolist(), counts)]

    def to_host(self, counts: list[int]) -> DraftProposal:
        """What a draft worker sends to the target's workers: ids as host lists, probabilities where they are.
        Copying the ids when the draft finishes times the draft's GPU work where it was spent."""
        return DraftProposal(self.host_rows(counts), self.draft_probs)


def empty_proposal(num_reqs: int, max_k: int, vocab_size: int, keep_probs: bool,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A proposal's buffers before any draft is written: ids [num_reqs, max_k] int64, all -1 (a request's columns
    past its own k stay so); q [num_reqs, max_k, vocab] float32 zeros where q is kept and some request drafts, else
    None."""
    ids = torch.full((num_reqs, max_k), -1, dtype=torch.int64, device=device)
    probs = None
    if keep_probs and max_k:
        probs = torch.zeros(num_reqs, max_k, vocab_size, dtype=torch.float32, device=device)
    return ids, probs
