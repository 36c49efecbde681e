"""A step's proposal when some of its requests hit a window drafted ahead (engine/speculation/ahead/proposer.py):
the hit windows' drafts and q, and the draft's own proposal for the rest, merged row by row."""

from __future__ import annotations

import torch

from engine.speculation.ahead.cache import AheadEntry
from engine.speculation.proposer import DraftProposer
from engine.step.plan import StepPlan
from engine.step.proposal import DraftProposal


def merge_hits(proposer: DraftProposer, plan: StepPlan, hits: dict[int, AheadEntry], rest: list[int],
               drafted: DraftProposal | None) -> DraftProposal:
    """The proposal of `plan`: the windows of its rows that hit (`hits`, by row) and `drafted`, the draft's own
    proposal for the `rest` of its rows, in one DraftProposal of the plan's rows."""
    runner = proposer.runner
    dev = runner.device
    reqs = plan.requests
    max_k = plan.max_draft_tokens
    ids = torch.full((len(reqs), max_k), -1, dtype=torch.int64, device=dev)
    # q wherever the verify reads it: a sampled request of the plan makes it (even one that drafts nothing this
    # step, beside greedy hits), as it makes the proposer's own.
    want_probs = proposer.keep_probs and (
        any(e.probs is not None for e in hits.values())
        or (drafted is not None and drafted.draft_probs is not None)
        or any(r.sample and r.temperature > 0 for r in reqs))
    probs = (torch.zeros(len(reqs), max_k, runner.vocab_size, dtype=torch.float32, device=dev)
             if want_probs else None)
    alt = torch.zeros(len(reqs), max_k, dtype=torch.int64, device=dev) if proposer.alternatives else None
    for i, e in hits.items():
        k = reqs[i].num_draft_tokens
        ids[i, :k] = e.token_ids[:k]
        if alt is not None and e.alt is not None:
            alt[i, :k] = e.alt[:k]
        if probs is not None:
            if e.probs is not None:
                probs[i, :k] = e.probs[:k]
            else:  # drafted greedily: q is one-hot at each token
                probs[i, torch.arange(k, device=dev), e.token_ids[:k]] = 1.0
    if drafted is not None and rest:
        sub_ids = drafted.draft_token_ids
        if isinstance(sub_ids, list):
            raise TypeError("the draft's own proposal is expected on its device here")
        row = torch.tensor(rest, dtype=torch.int64, device=dev)
        width = sub_ids.shape[1]
        if width:
            ids[row, :width] = sub_ids
            if alt is not None and drafted.alt_token_ids is not None:
                alt[row, :width] = drafted.alt_token_ids
        if probs is not None and width:
            if drafted.draft_probs is not None:
                probs[row, :width] = drafted.draft_probs
            else:
                for n, i in enumerate(rest):
                    k = reqs[i].num_draft_tokens
                    probs[i, torch.arange(k, device=dev), sub_ids[n, :k]] = 1.0
    return DraftProposal(ids, probs, alt)
