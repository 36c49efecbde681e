"""Several engines' draft plans as one: the plan a shared draft runs for all of them in one forward, and its proposal
cut back into each engine's.

A pooled draft group (serving/draft_pool/worker.py) serves several target engines; when more than one of them waits
for a proposal, one draft step drafts for all of them. Each engine's plan is resolved by that engine's own request
table first (every side keeps per-engine state: step ids, tokens, settings), with its request ids already under the
engine's name and its draft block ids already in its share of the draft's KV blocks, so the merged plan's requests
never clash. The proposer reads nothing but the requests' own entries (a seeded request draws from generators of
its seed and output position, engine/step/plan_sampling.py), so each engine's part of the merged proposal is what the
draft would have proposed for its plan alone (up to the forward's floating point on batches of another size), while
the merged plan takes the path the plan alone would: a grammar request in any engine's part sends the whole batch
down the draft's eager path (engine/speculation/proposer.py), whose seeded draws differ from the loop's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.step.plan import StepPlan
from engine.step.proposal import DraftProposal


@dataclass
class MergedPlan:
    """The merged plan, and where each part's requests lie in it."""

    plan: StepPlan
    spans: list[tuple[int, int]]  # [num_parts] (start, end): part i's requests are plan.requests[start:end]


def merge_plans(plans: list[StepPlan]) -> MergedPlan:
    """One plan of every part's requests, in the parts' order. The parts are resolved plans (no open entries) with
    disjoint request ids and block ids; they must agree on what is engine-wide (the rejection mode). The merged
    plan's step id is the first part's: no table records the merged plan (each part's did)."""
    if not plans:
        raise ValueError("merge_plans needs at least one plan")
    first = plans[0]
    for p in plans[1:]:
        if (p.rejection_sampling, p.synthetic_acceptance_rate) != (first.rejection_sampling,
                                                                  first.synthetic_acceptance_rate):
            raise ValueError(f"plans of different rejection modes cannot share a draft step: "
                             f"{first.rejection_sampling!r} (rate {first.synthetic_acceptance_rate}) and "
                             f"{p.rejection_sampling!r} (rate {p.synthetic_acceptance_rate})")
    if len(plans) == 1:
        return MergedPlan(first, [(0, len(first.requests))])
    spans, requests, finished = [], [], []
    for p in plans:
        spans.append((len(requests), len(requests) + len(p.requests)))
        requests.extend(p.requests)
        finished.extend(p.finished_ids)
    # Speculation ahead's budgets are per step: the merged step may fan out as far as its parts together.
    tree_nodes = [p.ahead_tree_nodes for p in plans]
    merged = dataclasses.replace(
        first, requests=requests,  # [sum of parts' requests]
        finished_ids=finished,  # [sum of parts' finished ids]
        sent_at=min(p.sent_at for p in plans),
        ahead_branches=max(p.ahead_branches for p in plans),
        ahead_tree_nodes=None if any(n is None for n in tree_nodes) else sum(tree_nodes),
        ahead_off=all(p.ahead_off for p in plans))
    return MergedPlan(merged, spans)


def split_proposal(proposal: DraftProposal, merged: MergedPlan) -> list[DraftProposal]:
    """Each part's proposal, as the draft would have proposed for its plan alone: its rows, as wide as its own
    largest k. Tensors are copied out, so that sending a part sends only its rows (a view pickles its whole storage).
    A merged plan of one part gives the proposal back as it is."""
    if len(merged.spans) == 1:
        return [proposal]
    reqs = merged.plan.requests
    parts = []
    for start, end in merged.spans:
        width = max((r.num_draft_tokens for r in reqs[start:end]), default=0)
        ids = proposal.draft_token_ids
        parts.append(DraftProposal(
            # [part's requests] lists of its k ids, or [part's requests, width] int64
            ids[start:end] if isinstance(ids, list) else _rows(ids, start, end, width),
            # [part's requests, width, V] float32
            _rows(proposal.draft_probs, start, end, width) if proposal.draft_probs is not None else None,
            # [part's requests, width] int64
            _rows(proposal.alt_token_ids, start, end, width) if proposal.alt_token_ids is not None else None))
    return parts


def _rows(t: torch.Tensor, start: int, end: int, width: int) -> torch.Tensor:
    return t[start:end, :width].clone(memory_format=torch.contiguous_format)
