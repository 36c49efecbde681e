"""Speculation ahead's window mode (the default; engine/speculation/ahead/proposer.py): after proposing d_1..d_k
for a request, the draft drafts a whole window for each of the likeliest outcomes of its verify, as the next
proposal after that outcome would, in one draft-loop run with a row per window.

The outcomes (engine/speculation/ahead/branches.py, ranked by the running estimates): every draft accepted with the
bonus token the draft's argmax (then its runner-up), and a rejection after a accepted drafts with the draft's
runner-up there as the target's token. A window's input is that outcome's catch-up: (d_k, guess) from d_k's position
after all accepted (the loop's column 0 is the guess, drawn as its argmax or runner-up), the single token t at
frontier + a after a rejection; its k' is shrunk from its own token count, and a seeded request draws from its
generator at its own output position (num_output_tokens + a + 1). Every window but the argmax bonus one writes
scratch KV blocks (engine/speculation/ahead/scratch_blocks.py), forked copy-on-write from the request's blocks: a hit
copies them back before anything reads them (AheadProposer.propose). Windows past the draft loop's largest graph batch
or past the scratch reserve are skipped and counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.speculation.ahead.branches import ACCEPT, Branch
from engine.speculation.ahead.cache import AheadCounters, AheadEntry, SpeculationCache, request_scope
from engine.speculation.ahead.scratch_blocks import ScratchBlocks, ScratchFork, copy_blocks
from engine.speculation.proposer import DraftProposer
from engine.step.plan import PlannedRequest, StepPlan


@dataclass
class _Window:
    """A branch chosen for drafting: its row of the draft-loop run."""

    row: int  # the request's index in the plan
    branch: Branch
    entry: PlannedRequest  # the next step's draft input for this outcome, as the proposal would get it
    guess: int  # the row's column 0: 0 drawn, 1 argmax, 2 runner-up
    k_next: int
    fork: ScratchFork | None


class WindowAhead:
    """Window-mode pre-drafting for an AheadProposer: `speculate_ahead` drafts the chosen windows into its cache."""

    def __init__(self, proposer: DraftProposer, cache: SpeculationCache, counters: AheadCounters,
                 scratch: ScratchBlocks, num_branches: int) -> None:
        self.proposer, self.cache, self.counters = proposer, cache, counters
        self.scratch, self.num_branches = scratch, num_branches

    def speculate_ahead(self, plan: StepPlan, rows: list[int], ranked: dict[int, list[Branch]], host: list[list[int]],
                 host_alt: list[list[int]] | None, bonus_guesses: dict[str, list[int | None]],
                 scoped: bool) -> int:
        """The windows of `ranked` (per plan row, its branches likeliest first) for the requests at `rows`, whose
        proposals were host[i] (runner-ups host_alt[i]); records each request's guessed bonus tokens in
        bonus_guesses[request_id] ([argmax, runner-up]). Returns the windows drafted."""
        windows = self._choose(plan, rows, ranked, host, host_alt, scoped)
        if not windows:
            return 0
        runner = self.proposer.runner
        groups = range(len(runner.kv_groups))
        # Forks: each scratch window's first block starts as a copy of the request's own block it stands for.
        fork_src = [[plan.requests[w.row].draft_block_tables[g][w.fork.first_block] for w in windows if w.fork]
                    for g in groups]
        fork_dst = [[w.fork.blocks[g][0] for w in windows if w.fork] for g in groups]
        if any(fork_src):
            copy_blocks(runner.kv_caches, fork_src, fork_dst)
        chain_plan = dataclasses.replace(plan, requests=[w.entry for w in windows], finished_ids=[])
        chain = self.proposer.propose(chain_plan, guesses=[w.guess for w in windows])
        chain_ids = chain.draft_token_ids
        assert isinstance(chain_ids, torch.Tensor)
        # Clones (one each): the draft loop's buffers are overwritten by the next proposal (stale q otherwise).
        chain_ids = chain_ids.clone()
        chain_probs = chain.draft_probs.clone() if chain.draft_probs is not None else None
        chain_alt = chain.alt_token_ids.clone() if chain.alt_token_ids is not None else None
        # SYNC: the guessed bonus tokens (and the draft's runner-up there) key the cache (host-side lookups).
        first = (torch.stack([chain_ids[:, 0], chain_alt[:, 0]]) if chain_alt is not None
                 else chain_ids[:, :1].T).tolist()
        for n, w in enumerate(windows):
            p = plan.requests[w.row]
            accept = w.branch.kind == ACCEPT
            off = 1 if accept else 0  # an all-accepted window's column 0 is its guessed bonus token
            cols = slice(off, off + w.k_next)
            if accept:
                tokens: tuple[int, ...] = (w.entry.draft_token_ids[0], first[0][n])
                bonus = bonus_guesses[p.request_id]
                bonus[w.branch.index - 1] = first[0][n]
                if w.branch.index == 1 and chain_alt is not None:
                    bonus[1] = first[1][n]
            else:
                tokens = (w.entry.draft_token_ids[0],)
            self.cache.entries.setdefault(p.request_id, []).append(AheadEntry(
                position=w.entry.draft_start_pos, tokens=tokens, token_ids=chain_ids[n, cols],
                probs=chain_probs[n, cols] if chain_probs is not None and p.temperature > 0 else None,
                alt=chain_alt[n, cols] if chain_alt is not None else None, kind=w.branch.kind, fork=w.fork))
            self.counters.add(p.request_id, "drafted_tokens", w.k_next)
        return len(windows)

    def _choose(self, plan: StepPlan, rows: list[int], ranked: dict[int, list[Branch]], host: list[list[int]],
                host_alt: list[list[int]] | None, scoped: bool) -> list[_Window]:
        """The windows to draft, in rank order across requests (every request's likeliest, then its second, ...),
        as long as the draft loop's rows and the scratch reserve last."""
        max_rows = self._max_rows(len(rows))
        bs = self.proposer.runner.config.block_size
        k_step = plan.max_draft_tokens
        windows: list[_Window] = []
        for rank in range(max(len(b) for b in ranked.values())):
            for i in rows:
                if rank >= len(ranked[i]):
                    continue
                branch = ranked[i][rank]
                p = plan.requests[i]
                assert p.token_ids is not None
                k = p.num_draft_tokens
                frontier = p.start_pos + len(p.token_ids)
                accepted = branch.accepted(k)
                num_tokens_next = frontier + accepted + 1  # after the accepted drafts and the target's token
                # The k the next step drafts after this outcome, shrunk as the scheduler would (max_tokens,
                # max_model_len).
                k_next = min(k_step, p.token_limit - num_tokens_next - 1) if p.token_limit else k_step
                if k_next <= 0:
                    continue
                start = frontier + branch.start_offset(k)
                if branch.kind == ACCEPT:
                    catch_up, guess, width = [host[i][k - 1]], branch.index, 1 + k_next
                elif host_alt is not None:
                    catch_up, guess, width = [host_alt[i][branch.index]], 0, k_next
                else:  # a proposal without runner-ups (none recorded): no guess for the target's token
                    continue
                if len(windows) >= max_rows:
                    self.counters.add(p.request_id, "skipped_branches")
                    continue
                tables, fork = p.draft_block_tables, None
                if not branch.own_blocks:
                    # It writes positions start .. start + width - 1 (the catch-up, then all but its last token).
                    forked = self.scratch.fork(tables, start, start + width - 1, bs,
                                               request_scope(p.request_id) if scoped else None)
                    if forked is None:
                        self.counters.add(p.request_id, "skipped_branches")
                        continue
                    fork, tables = forked
                entry = dataclasses.replace(
                    p, token_ids=[], num_draft_tokens=width, draft_token_ids=catch_up, draft_start_pos=start,
                    draft_block_tables=tables, num_output_tokens=p.num_output_tokens + accepted + 1, logprobs=None,
                    output_token_ids=None)
                windows.append(_Window(i, branch, entry, guess, k_next, fork))
        return windows

    def _max_rows(self, num_requests: int) -> int:
        """Rows of one run drafting ahead: the largest batch the draft loop runs as a graph (a run beyond it would
        run eagerly), never fewer than one per request (fan-out 1 as before), at most what its buffers hold. The
        eager torch path (no loop) has no buffers to outgrow: there the scratch reserve alone bounds the rows."""
        loop = self.proposer.loop
        if loop is None:
            return num_requests * self.num_branches
        cap = max(loop.batch_sizes, default=loop.buffers.max_num_reqs)
        return min(max(cap, num_requests), loop.buffers.max_num_reqs)
