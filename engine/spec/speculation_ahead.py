"""Speculation ahead: while the target verifies window n, the draft drafts window n+1 for the likeliest outcome.

The likeliest outcome of a verify is "every draft accepted, and the bonus token is the draft's own guess for the
position after the last draft" (the draft's argmax there). So after proposing d_1..d_k for a request, the draft
keeps going: it feeds d_k, takes its argmax g as the guessed bonus token, feeds g and samples e_1..e_k' exactly as
the next step's proposal would (same sampling settings, a seeded request's generator seeded at the output position
that step will have). The result is kept in a speculation cache keyed by what the next step must feed the draft:
the position of d_k and the tokens (d_k, g). When the next plan asks the draft to catch up on exactly (d_k, bonus)
from that position with bonus == g, the cached window is the proposal (a hit): the draft's KV already holds
d_k, g and e_1..e_{k'-1} at the right positions, so the proposal costs no draft forward and the target's next
verify can start at once. Any other outcome (a rejection, another bonus token, another draft length, a preempted
or resumed request) is a miss: the draft drafts as it always does, from where its KV is valid; the positions the
chain wrote past that point are rewritten before anything reads them.

Why it stays exact: on a hit, e_1..e_k' were drawn from the draft's distribution given exactly the context the
next step has (the prefix, the accepted drafts and the bonus token), with noise independent of the target's, so
they are distributed as freshly drafted tokens; and the verify uses the probabilities q of the very forward that
produced them (cloned out of the draft loop's static buffers, which the next proposal overwrites). Rejection
sampling then keeps the target's distribution whatever the draft proposed. Greedy drafts are identical to what
the next step would draft, so greedy outputs do not change at all.

The chain's fan-out is 1 (one guessed bonus token per request, no pre-drafted rejection points): another branch
would need KV positions of its own for the same tokens, i.e. copies of the request's KV blocks per branch.

Requests with logits processing (penalties, biases, masks) are not drafted ahead: their processors read a token
history that the chain would have to extend with guessed tokens. Their proposals are drafted as usual.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from engine.spec.proposer import DraftProposal, DraftProposer
from engine.step_plan import PlannedRequest, StepPlan


@dataclass
class AheadEntry:
    """One request's pre-drafted window."""

    position: int  # where the next step's draft input must start: the position of d_k
    tokens: tuple[int, int]  # (d_k, g): the input the next step must feed the draft for this window to hold
    token_ids: torch.Tensor  # [k'] int64 on the draft's device: e_1..e_k'
    probs: torch.Tensor | None  # [k', V] float32 q of each e_j (None: drafted greedily, q is one-hot)


@dataclass
class AheadStats:
    """Counters since the proposer began (monotonic; the engine reports their increase per step)."""

    lookups: int = 0  # speculating requests whose proposal was looked up in the cache
    hits: int = 0  # ... and served from it
    drafted_tokens: int = 0  # tokens drafted ahead (e_1..e_k' of every entry; the guesses not counted)
    unused_tokens: int = 0  # of those, dropped unproposed (a miss, or beyond the k of a hit)

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.lookups, self.hits, self.drafted_tokens, self.unused_tokens


@dataclass
class SpeculationCache:
    """The windows of the last pre-draft, by request id. Only the last pre-draft's entries are kept: a window is
    for the step right after the one it was drafted in, and the next proposal consumes or drops every entry."""

    entries: dict[str, AheadEntry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()


class AheadProposer:
    """A DraftProposer with a speculation cache: `propose` serves hits from the cache and drafts the rest;
    `predraft` (after the proposal has gone to the target) drafts the next windows into the cache.

    bonus_agreement (benchmarks only): under synthetic rejection the target's tokens are unrelated to the draft's,
    so a bonus token would never match a guess; with this rate, a lookup whose drafts were all accepted counts the
    bonus as guessed right (the draft's KV then holds its guess where the target has the bonus: harmless for a
    synthetic benchmark, whose outputs mean nothing, and refused everywhere else)."""

    def __init__(self, proposer: DraftProposer, bonus_agreement: float | None = None, seed: int = 0) -> None:
        self.proposer = proposer
        self.cache = SpeculationCache()
        self.stats = AheadStats()
        self.bonus_agreement = bonus_agreement
        # Every rank of a tensor-parallel draft draws the same numbers, so they agree on hits.
        self._agreement_rng = random.Random(seed)

    @property
    def runner(self):  # noqa: ANN201 - the proposer's ModelRunner
        return self.proposer.runner

    # ---- the proposal ---------------------------------------------------------------------------------
    def propose(self, plan: StepPlan) -> DraftProposal:
        """The step's proposal (plan resolved): cached windows for hits, the draft's forwards for the rest."""
        hits: dict[int, AheadEntry] = {}
        used = 0
        for i, p in enumerate(plan.requests):
            if not (p.draft_runs and p.num_draft_tokens):
                continue
            self.stats.lookups += 1
            entry = self.cache.entries.get(p.request_id)
            if entry is not None and p.request_id not in plan.finished_ids and self._matches(entry, p, plan):
                hits[i] = entry
                self.stats.hits += 1
                used += p.num_draft_tokens
        # Every entry was for this step: what did not hit is stale from now on.
        self.drop_all(used)
        if not hits:
            return self.proposer.propose(plan)
        rest = [i for i in range(len(plan.requests)) if i not in hits]
        drafted = (self.proposer.propose(dataclasses.replace(plan, requests=[plan.requests[i] for i in rest]))
                   if rest else None)
        return self._merge(plan, hits, rest, drafted)

    def _matches(self, entry: AheadEntry, p: PlannedRequest, plan: StepPlan) -> bool:
        if p.draft_start_pos != entry.position or len(p.draft_token_ids) != 2:
            return False  # not "every draft accepted": the catch-up is the bonus alone, or from elsewhere
        if p.num_draft_tokens > entry.token_ids.shape[0]:
            return False  # this step drafts more than was drafted ahead
        if p.draft_token_ids[0] != entry.tokens[0]:
            return False
        if p.draft_token_ids[1] == entry.tokens[1]:
            return True
        rate = self.bonus_agreement if plan.synthetic_acceptance_rate is not None else None
        return rate is not None and self._agreement_rng.random() < rate

    def _merge(self, plan: StepPlan, hits: dict[int, AheadEntry], rest: list[int],
               drafted: DraftProposal | None) -> DraftProposal:
        dev = self.runner.device
        reqs = plan.requests
        max_k = plan.max_draft_tokens
        ids = torch.full((len(reqs), max_k), -1, dtype=torch.int64, device=dev)
        want_probs = self.proposer.keep_probs and (
            any(e.probs is not None for e in hits.values())
            or (drafted is not None and drafted.draft_probs is not None))
        probs = (torch.zeros(len(reqs), max_k, self.runner.vocab_size, dtype=torch.float32, device=dev)
                 if want_probs else None)
        for i, e in hits.items():
            k = reqs[i].num_draft_tokens
            ids[i, :k] = e.token_ids[:k]
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
            if probs is not None and width:
                if drafted.draft_probs is not None:
                    probs[row, :width] = drafted.draft_probs
                else:
                    for n, i in enumerate(rest):
                        k = reqs[i].num_draft_tokens
                        probs[i, torch.arange(k, device=dev), sub_ids[n, :k]] = 1.0
        return DraftProposal(ids, probs)

    def drop_all(self, used: int = 0) -> None:
        """Empty the cache; `used` of its tokens were proposed, the rest count as unused."""
        self.stats.unused_tokens += sum(e.token_ids.shape[0] for e in self.cache.entries.values()) - used
        self.cache.clear()

    # ---- drafting ahead -------------------------------------------------------------------------------
    def predraft(self, plan: StepPlan, proposal: DraftProposal) -> int:
        """Draft the next window of every speculating request of `plan` (resolved) whose proposal is `proposal`,
        assuming all its drafts are accepted and the bonus token is the draft's guess. Returns the number of
        requests drafted ahead."""
        rows = [i for i, p in enumerate(plan.requests)
                if p.draft_runs and p.num_draft_tokens and p.sample and p.logits_params is None]
        if not rows:
            return 0
        k_step = plan.max_draft_tokens
        counts = [p.num_draft_tokens for p in plan.requests]
        # SYNC: the last draft of each request, on the host, to build the chain's input; the target is verifying
        # meanwhile (a draft worker) or has finished (in process), so nothing on the critical path waits.
        host = proposal.host_rows(counts)
        entries: list[PlannedRequest] = []
        for i in rows:
            p = plan.requests[i]
            assert p.token_ids is not None
            k = p.num_draft_tokens
            frontier = p.start_pos + len(p.token_ids)
            num_tokens_next = frontier + k + 1  # after every draft and the bonus token
            # The k the next step drafts, shrunk as the scheduler would (max_tokens, max_model_len).
            k_next = min(k_step, p.token_limit - num_tokens_next - 1) if p.token_limit else k_step
            if k_next <= 0:
                continue
            entries.append(dataclasses.replace(
                p, token_ids=[], num_draft_tokens=1 + k_next, draft_token_ids=[host[i][k - 1]],
                draft_start_pos=frontier + k - 1, num_output_tokens=p.num_output_tokens + k + 1, logprobs=None,
                output_token_ids=None))
        if not entries:
            return 0
        chain_plan = dataclasses.replace(plan, requests=entries, finished_ids=[])
        chain = self.proposer.propose(chain_plan, guess_first=True)
        chain_ids = chain.draft_token_ids
        assert isinstance(chain_ids, torch.Tensor)
        # SYNC: the guesses key the cache (host-side lookups next step).
        guesses = chain_ids[:, 0].tolist()
        for n, e in enumerate(entries):
            k_next = e.num_draft_tokens - 1
            probs = chain.draft_probs
            self.cache.entries[e.request_id] = AheadEntry(
                position=e.draft_start_pos, tokens=(e.draft_token_ids[0], guesses[n]),
                # Clones: the draft loop's buffers are overwritten by the next proposal (stale q otherwise).
                token_ids=chain_ids[n, 1:1 + k_next].clone(),
                probs=probs[n, 1:1 + k_next].clone() if probs is not None and e.temperature > 0 else None)
            self.stats.drafted_tokens += k_next
        return len(entries)
