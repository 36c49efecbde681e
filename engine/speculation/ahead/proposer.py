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

Fan-out (EngineConfig.speculation_ahead_branches = B > 1; the windows' choice and run: engine/speculation/
ahead/window.py): the draft drafts up to B windows per request, for the likeliest outcomes of its verify
(engine/speculation/ahead/branches.py: a second bonus guess, rejections after a accepted drafts with the draft's
runner-up there as the target's token). Each window is exactly what the next proposal would draft after its outcome:
its own catch-up and start position (a rejection's is the single token t at the frontier plus a), its own k' (shrunk
from its own token count), a seeded request's generator at its own output position (num_output_tokens + a + 1), the
same settings; its key is that catch-up, and a hit needs an exact match. Every window but the argmax bonus one runs
in scratch KV blocks (engine/speculation/ahead/scratch_blocks.py), forked copy-on-write from the request's blocks and
copied back over them on a hit, before anything reads them. All windows of all requests are one draft-loop run (a row
per window, capped at the largest batch the loop runs as a graph); windows past that cap or past the scratch reserve are
skipped and counted.

Tree mode (EngineConfig.speculation_ahead_tree_fanout = F > 0, engine/speculation/ahead/tree.py): one tree per
request over every outcome of its verify instead of windows, in scratch slots; the cache, the lookup and the
proposal's merge are the same, a hit copies its branch's slots into the request's blocks.

Windows leave out requests with logits processing (penalties, biases, masks, grammars): their processors read a
token history the chain would have to extend with guessed tokens. Their proposals are drafted as usual, and the ahead
budget does not count them (ahead_budget.drafts_ahead). Tree mode drafts them too, each branch's logits processed
with its own history (engine/speculation/ahead/tree.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from engine.agreement_profile import AgreementProfile
from engine.speculation.ahead.branches import ACCEPT, BranchEstimates
from engine.speculation.ahead.budget import drafts_ahead
from engine.speculation.ahead.cache import AheadCounters, AheadEntry, AheadStats, SpeculationCache, request_scope
from engine.speculation.ahead.merge import merge_hits
from engine.speculation.ahead.scratch_blocks import ScratchBlocks, copy_blocks, scratch_blocks_wanted
from engine.speculation.ahead.synthetic_agreement import SyntheticAgreement
from engine.speculation.ahead.tree import TreeAhead
from engine.speculation.ahead.window import WindowAhead
from engine.speculation.proposer import DraftProposer
from engine.step.plan import PlannedRequest, StepPlan
from engine.step.proposal import DraftProposal


@dataclass
class _Verify:
    """What a request's pending verify was guessed to end with, to score the guesses once its outcome shows."""

    frontier: int  # the position of d_1
    k: int
    last_draft: int  # d_k
    reject_guesses: list[int] | None  # [k] the runner-up at each draft (None without branches)
    bonus_guesses: list[int | None]  # [2] argmax and runner-up after d_k, where a window learnt them


class AheadProposer:
    """A DraftProposer with a speculation cache: `propose` serves hits from the cache and drafts the rest;
    `speculate_ahead` (after the proposal has gone to the target) drafts the next windows into the cache.

    bonus_agreement (benchmarks only): under synthetic rejection the target's tokens are unrelated to the draft's,
    so a guess would never be right; with this rate, a lookup whose outcome has a window (every draft accepted: the
    argmax bonus window; a rejection after a accepted: that rejection's window) counts its guess as right (the
    draft's KV then holds the guess where the target has another token: harmless for a synthetic benchmark, whose
    outputs mean nothing, and refused everywhere else); the branch estimates score the same verdicts, so fan-out
    ranks the windows the setting can credit. agreement_profile (benchmarks only, instead of bonus_agreement):
    the outcome's n candidates hit at a measured pair's top-n rate for that outcome
    (engine/speculation/ahead/synthetic_agreement.py), so a tree's fan-out changes its hits as on a real pair."""

    def __init__(self, proposer: DraftProposer, bonus_agreement: float | None = None, seed: int = 0,
                 agreement_profile: AgreementProfile | None = None) -> None:
        self.proposer = proposer
        self.cache = SpeculationCache()
        self.stats = AheadStats()
        self.counters = AheadCounters(self.stats)
        self.agreement = (SyntheticAgreement(bonus_agreement, agreement_profile, seed)
                          if bonus_agreement is not None or agreement_profile is not None else None)
        cfg = proposer.runner.config
        self.num_branches = cfg.speculation_ahead_branches
        if self.num_branches > 1 and not proposer.alternatives:
            raise ValueError("speculation ahead with branches needs a proposer built with ahead=True")
        self.estimates = BranchEstimates()
        # The last run ahead, (rows, seconds), until `take_window` hands it on (engine/speculation/ahead/budget.py).
        self._window: tuple[int, float] | None = None
        self._pending: dict[str, _Verify] = {}
        groups = proposer.runner.kv_groups
        ids = (proposer.runner.reserve_kv_blocks(scratch_blocks_wanted(
            self.num_branches, cfg.max_num_seqs, cfg.num_speculative_tokens + 1, cfg.block_size))
            if self.num_branches > 1 else [])
        self.scratch = ScratchBlocks([list(ids) for _ in groups])  # [num_groups][n], the same ids in each group
        self.tree = (TreeAhead(proposer, self.cache, self.counters) if cfg.speculation_ahead_tree_fanout > 0
                     else None)
        self.windows = WindowAhead(proposer, self.cache, self.counters, self.scratch, self.num_branches)

    # ---- scopes: a pooled draft's targets -------------------------------------------------------------
    @property
    def scoped(self) -> bool:
        return self.counters.scoped

    def use_scopes(self) -> None:
        """Keep each target's windows apart (a pooled draft, serving/draft_pool/worker.py): request ids are
        `<target>/<id>`, a proposal or pre-draft names the targets whose step it is (`scopes`) and drops only their
        windows, scratch blocks and guesses, and each target's counters are kept too (`stats_of`). Targets' steps
        come at any times: one target's proposal must not drop the windows another's next step is to hit."""
        self.counters.scoped = True

    def stats_of(self, scope: str) -> AheadStats:
        """A target's own counters (scoped)."""
        return self.counters.of(scope)

    def scratch_held(self, scope: str) -> int:
        """Scratch blocks and tree slots a target's windows hold now (scoped)."""
        return self.scratch.reserve.held(scope) + (self.tree.reserve.held(scope) if self.tree is not None else 0)

    def forget(self, scope: str) -> None:
        """A target left: drop its windows (freeing their scratch) and its counters."""
        self.drop({scope})
        self.counters.forget({scope})

    def _in(self, request_id: str, scopes: set[str] | None) -> bool:
        return scopes is None or request_scope(request_id) in scopes

    @property
    def runner(self):  # noqa: ANN201 - the proposer's ModelRunner
        return self.proposer.runner

    # ---- the proposal ---------------------------------------------------------------------------------
    def propose(self, plan: StepPlan, scopes: set[str] | None = None) -> DraftProposal:
        """The step's proposal (plan resolved): cached windows for hits, the draft's forwards for the rest. scopes
        (scoped): the targets whose step this is; their windows are consumed or dropped, the others' kept."""
        hits: dict[int, AheadEntry] = {}
        used: dict[str, int] = {}  # tokens of a hit window proposed, by request
        groups = range(len(self.runner.kv_groups))
        src: list[list[int]] = [[] for _ in groups]  # [num_groups][n] scratch blocks of hit windows ...
        dst: list[list[int]] = [[] for _ in groups]  # ... and the request's own blocks they stand for
        tree_hits: list[tuple[PlannedRequest, AheadEntry]] = []
        for i, p in enumerate(plan.requests):
            if not (p.draft_runs and p.num_draft_tokens):
                continue
            self.counters.add(p.request_id, "lookups")
            self._observe(p, plan)
            entries = self.cache.entries.get(p.request_id)
            entry = self._lookup(entries, p, plan) if entries and p.request_id not in plan.finished_ids else None
            if entry is None:
                continue
            hits[i] = entry
            self.counters.add(p.request_id, "hits")
            self.counters.add(p.request_id, "hits_accept" if entry.kind == ACCEPT else "hits_reject")
            used[p.request_id] = p.num_draft_tokens
            if entry.outcome is not None:
                self.counters.add_outcome(p.request_id, entry.outcome)
            if entry.slots is not None:
                tree_hits.append((p, entry))
            if entry.fork is not None:
                first = entry.fork.first_block
                for g in groups:
                    own = p.draft_block_tables[g]
                    n = min(len(entry.fork.blocks[g]), len(own) - first)
                    src[g] += entry.fork.blocks[g][:n]
                    dst[g] += own[first:first + n]
        if any(src):
            # The window's KV into the request's own blocks, before anything reads them (the rest's proposal
            # below, the next windows ahead): they then hold what drafting it now would have written.
            copy_blocks(self.runner.kv_caches, src, dst)
        if tree_hits:  # as above, a tree branch's slots
            assert self.tree is not None
            self.tree.copy_hits(tree_hits)
        # Every entry (of these targets, scoped) was for this step: what did not hit is stale from now on.
        self.drop(scopes, used)
        if not hits:
            return self.proposer.propose(plan)
        rest = [i for i in range(len(plan.requests)) if i not in hits]
        drafted = (self.proposer.propose(dataclasses.replace(plan, requests=[plan.requests[i] for i in rest]))
                   if rest else None)
        return merge_hits(self.proposer, plan, hits, rest, drafted)

    def _lookup(self, entries: list[AheadEntry], p: PlannedRequest, plan: StepPlan) -> AheadEntry | None:
        """The window drafted for exactly this draft input (position and catch-up tokens), if its k suffices."""
        tokens = tuple(p.draft_token_ids)
        fits = [e for e in entries if e.position == p.draft_start_pos and p.num_draft_tokens <= e.token_ids.shape[0]
                and (e.exact_k is None or e.exact_k == p.num_draft_tokens)]
        for e in fits:
            if e.tokens == tokens:
                return e
        if plan.synthetic_acceptance_rate is None or self.agreement is None:
            return None
        # Benchmarks: the outcome is the window's (same position, same tokens but the guessed one); its guess counts
        # as right at the agreement rate, or one of its candidates at the profile's rate for their number.
        same = [e for e in fits if len(e.tokens) == len(tokens) and e.tokens[:-1] == tokens[:-1]]
        return self.agreement.pick(same, lambda: self._outcome(p, same[0])) if same else None

    def _outcome(self, p: PlannedRequest, entry: AheadEntry) -> tuple[int, int]:
        """(a, k): the drafts accepted in the outcome `entry` was drafted for, of the k its verify had."""
        v = self._pending.get(p.request_id)
        k = v.k if v is not None else p.num_draft_tokens
        if entry.kind == ACCEPT:
            return k, k
        if entry.outcome is not None:
            return entry.outcome, k
        return (p.draft_start_pos - v.frontier if v is not None else 0), k

    def _observe(self, p: PlannedRequest, plan: StepPlan) -> None:
        """Score the guesses made for this request's last verify, from the outcome its draft input shows."""
        v = self._pending.get(p.request_id)
        if v is None:
            return
        toks, start = p.draft_token_ids, p.draft_start_pos
        if start == v.frontier + v.k - 1 and len(toks) == 2 and toks[0] == v.last_draft:
            accepted = v.k
        elif len(toks) == 1 and v.frontier <= start < v.frontier + v.k:
            accepted = start - v.frontier
        else:
            return  # the input follows neither outcome: nothing to score
        if plan.synthetic_acceptance_rate is not None and self.agreement is not None:
            self.estimates.observe_agreement(v.k, accepted, *self.agreement.guess_rates(accepted, v.k))
        elif accepted == v.k:
            self.estimates.observe(v.k, v.k, (v.bonus_guesses[0], v.bonus_guesses[1]), None, toks[1])
        else:
            guess = v.reject_guesses[accepted] if v.reject_guesses is not None else None
            self.estimates.observe(v.k, accepted, (None, None), guess, toks[0])

    def drop_all(self) -> None:
        """Empty the cache (and so the scratch blocks, and the guesses kept to score)."""
        self.drop(None)

    def drop(self, scopes: set[str] | None, used: dict[str, int] | None = None) -> None:
        """Drop the windows (their scratch blocks and tree slots, and the guesses kept to score) of these scopes'
        requests (None: every request); used[request id]: of its tokens, those proposed, the rest count as
        unused."""
        used = used or {}
        for rid in [r for r in self.cache.entries if self._in(r, scopes)]:
            tokens = sum(e.token_ids.shape[0] for e in self.cache.entries.pop(rid))
            self.counters.add(rid, "unused_tokens", tokens - used.get(rid, 0))
        for rid in [r for r in self._pending if self._in(r, scopes)]:
            del self._pending[rid]  # the guesses were for this step's verify outcomes too
        if scopes is None:
            self.scratch.reset()
            if self.tree is not None:
                self.tree.reserve.reset()
        else:
            self.scratch.release(scopes)
            if self.tree is not None:
                self.tree.reserve.release(scopes)

    # ---- drafting ahead -------------------------------------------------------------------------------
    def take_window(self) -> tuple[int, float] | None:
        """The last run ahead as (rows, seconds), once: None if none ran since the last call."""
        window, self._window = self._window, None
        return window

    def speculate_ahead(self, plan: StepPlan, proposal: DraftProposal, scopes: set[str] | None = None) -> int:
        """Draft the next windows of every speculating request of `plan` (resolved) whose proposal is `proposal`:
        for the likeliest outcomes of its verify, up to `plan.ahead_branches` a request (0: the configured count;
        one: every draft accepted and the bonus token the draft's argmax). scopes (scoped): the targets whose step
        `plan` is (every request of it is theirs). Returns the number of windows drafted."""
        started = time.perf_counter()
        # Windows of a pre-draft no proposal came after (none, in the executors' order): the scratch is reused now.
        self.drop(scopes)
        if plan.ahead_off:  # the engine's gate: drafting ahead measured slower at this load (gate.py)
            return 0
        rows = [i for i, p in enumerate(plan.requests)
                if p.draft_runs and p.num_draft_tokens and drafts_ahead(p.sample, p.logits_params is not None,
                                                                        self.tree is not None)]
        if not rows:
            return 0
        counts = [p.num_draft_tokens for p in plan.requests]
        # SYNC: the drafts (and their runner-ups) of each request, on the host, to build the windows' inputs; the
        # target is verifying meanwhile (a draft worker) or has finished (in process): nothing critical waits.
        host = proposal.host_rows(counts)
        host_alt = proposal.alt_rows(counts) if self.num_branches > 1 else None
        for i in rows:
            p = plan.requests[i]
            assert p.token_ids is not None
            self._pending[p.request_id] = _Verify(p.start_pos + len(p.token_ids), counts[i], host[i][-1],
                                                  host_alt[i] if host_alt is not None else None, [None, None])
        if self.tree is not None:
            nodes = self.stats.tree_nodes
            n = self.tree.speculate_ahead(plan, rows, host, self.estimates.alpha, scoped=self.scoped)
            nodes = self.stats.tree_nodes - nodes
            # Tree mode reports its nodes (the rows its forwards fed): a tree's cost grows with them, not its
            # branches alone (engine/speculation/ahead/budget.py). None where no tree ran.
            self._window = (nodes, time.perf_counter() - started) if nodes else None
            return n
        budget = min(plan.ahead_branches, self.num_branches) if plan.ahead_branches > 0 else self.num_branches
        ranked = {i: self.estimates.ranked(counts[i], budget) for i in rows}
        n = self.windows.speculate_ahead(plan, rows, ranked, host, host_alt,
                                  {rid: v.bonus_guesses for rid, v in self._pending.items()}, self.scoped)
        if n:  # timed to the run's sync (its last kernel): its cost as the draft's GPU sees it
            self._window = (n, time.perf_counter() - started)
        return n
