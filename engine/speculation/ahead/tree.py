"""Speculation ahead's tree mode (EngineConfig.speculation_ahead_tree_fanout = F > 0): after proposing d_1..d_k for a
request, the draft drafts ONE tree covering every outcome of its verify, instead of a window per guessed outcome.

The verify accepts a = 0..k drafts and then emits the target's token t at position frontier + a (frontier: the
position of d_1): a replacement of d_{a+1} for a < k, the bonus token for a = k. The tree (engine/speculation/
ahead/tree_draft.py, `draft_tree` with its roots from the window's logits: picked on the device, `root_fanouts`, or on
the host, `choose_roots`, for requests with logits processing or a seed):
- forward 0 feeds the chain [c, d_1..d_k] over the committed prefix (prefix_len = frontier - 1, its KV read in place
  from the request's own draft blocks; c is the last catch-up token, at frontier - 1, fed again for its logits): its
  k + 1 logits rows are the draft's at positions frontier .. frontier + k, i.e. at every outcome's t;
- the roots of outcome a are the draft's top-F_a tokens there, d_{a+1} excluded for a < k (engine/speculation/
  ahead/tree_roots.py); F_a follows engine/speculation/ahead/tree_schedule.py, cut to the step's row budget (or to the
  plan's node cap from the engine's ahead budget, engine/speculation/ahead/budget.py: StepPlan.ahead_tree_nodes);
- every branch is then drafted D deep (D = the step's k) with one batched forward per depth over all branches of all
  requests; greedy rows take the argmax, sampled rows draw from their q with the proposer's generator.
Every node's KV goes to scratch slots reserved once at start-up (ModelRunner.reserve_kv_blocks, the same ids in
every KV-cache group), reused at every pre-draft; nothing of the request's own KV is written.

The cache (engine/speculation/ahead/cache.py) keeps a branch as the entry the next proposal looks up: its key
is the draft input that outcome gives the next step, (position, tokens) = (frontier + k - 1, (d_k, t)) after all
accepted, (frontier + a, (t,)) after a rejection, which is (request, a, t). A hit needs the branch's depth to cover
the step's k. Its drafts and their q (one-hot when greedy) are the proposal, and before anything reads the draft's KV
(AheadProposer.propose) the branch's slots for the positions the ordinary proposal would write (from the catch-up's
start: d_k's node too after all accepted, then the root and e_1..e_{k-1}) are copied into the request's own blocks,
every group; the prefix is never touched. A miss drafts just in time, as always.

Exactness: a branch's drafts are drawn from the draft's distribution given exactly the context the next step has
(prefix, accepted drafts, the target's token), with the draft's own noise; rejection sampling reads their own q. The
roots are chosen from the draft's logits alone, never from the target's. Every kind of request gets a tree, and
its branches are what the next proposal after their outcome would draft (engine/speculation/proposer.py), drawn the
same way:
- logits processing (penalties, logit_bias, bad words, min_tokens, min_p, allowed tokens) and grammars (structured
  outputs): where the proposal processes its logits (the eager path; the draft loop does not), the roots of outcome
  a come from the draft's logits processed as the target's verify row a is, with d_1..d_a in the history (a
  grammar's matcher after a accepted drafts), and a token masked there is never a root: a grammar request's
  branches start only from tokens its grammar allows after the accepted prefix. Each branch's drafts are drawn from
  logits processed with the history that proposal would have (output, d_1..d_a, t, the branch's drafts so far), so
  a grammar masks along the branch as it masks the proposal's drafts (_BranchProcessing);
- seeded sampled requests: a branch of outcome a draws from the generator seeded at the output position that
  proposal has (num_output_tokens + a + 1), one [V] draw a draft as the eager path does, or [k, V] up front as the
  draft loop does (such a branch serves a proposal of exactly that k only: AheadEntry.exact_k) (_SeededNoise).
  Seeded outputs then equal plain speculation's, where the next proposal takes the path this plan's would (a
  grammar request in the batch sends the draft loop's steps to the eager path).
Outcomes whose branches would run past max_model_len (the draft's position tables) or past the request's token
limit get no branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache.block_pool import NULL_BLOCK
from engine.runner.tree_graphs import tree_row_buckets
from engine.speculation.ahead.branches import ACCEPT, REJECT
from engine.speculation.ahead.cache import AheadCounters, AheadEntry, SpeculationCache, request_scope
from engine.speculation.ahead.scratch_blocks import ScratchReserve, copy_slots
from engine.speculation.ahead.tree_draft import TreeDraftRequest, draft_tree, num_tree_nodes
from engine.speculation.ahead.tree_roots import top_f_roots_many
from engine.speculation.ahead.tree_schedule import TreeSchedule
from engine.speculation.proposer import DraftProposer
from engine.step.logits_processors import process_target_logits
from engine.step.plan import PlannedRequest, StepPlan
from engine.step.plan_sampling import DRAFT_STREAM, request_generator

# Rows of a tree forward a CUDA graph covers at most: its logits ([rows, V] float32) are 311 MB at a 152k vocabulary.
TREE_GRAPH_ROWS = 512
# The largest q a step's trees may keep: 1 GiB (at k=4, 441 branches of a 152k vocabulary, 2048 of a 32k one).
TREE_Q_BYTES = 1 << 30


def tree_slots_wanted(max_num_seqs: int, max_k: int, fanout: int, max_rows: int) -> int:
    """Scratch slots (per group) for the trees of a full batch: a tree of k drafts, B branches and depth k has
    k + 1 + B x k nodes; B is at most fanout x (k + 1) a request and max_rows a step."""
    per_tree = num_tree_nodes(max_k + 1, fanout * (max_k + 1), max_k)
    return min(max_num_seqs * per_tree, max_num_seqs * (max_k + 1) + max_rows * max_k)


class TreeAhead:
    """Tree-mode pre-drafting for an AheadProposer: `speculate_ahead` fills its cache with branches, `copy_hits` moves a
    hit branch's KV into the request's own blocks."""

    def __init__(self, proposer: DraftProposer, cache: SpeculationCache, counters: AheadCounters) -> None:
        runner = proposer.runner
        cfg = runner.config
        self.proposer, self.cache, self.counters = proposer, cache, counters
        self.schedule = TreeSchedule(cfg.speculation_ahead_tree_fanout, runner.vocab_size)
        # Branches (rows of a forward past the first) per step at most: the step's token budget, which the draft's
        # forwards are sized for, and no more than keeps the q of sampled branches ([branches, k, V] float32) within
        # TREE_Q_BYTES: the KV cache was sized without it, so it must fit in what the memory headroom leaves.
        q_rows = TREE_Q_BYTES // (4 * runner.vocab_size * max(1, cfg.num_speculative_tokens))
        self.max_rows = max(1, min(cfg.max_num_batched_tokens, q_rows))
        bs = cfg.block_size
        wanted = tree_slots_wanted(cfg.max_num_seqs, cfg.num_speculative_tokens, self.schedule.max_fanout,
                                   self.max_rows)
        ids = runner.reserve_kv_blocks(-(-wanted // bs))
        self.slots = [b * bs + o for b in ids for o in range(bs)]  # flat scratch slots, the same in every group
        self.reserve = ScratchReserve(len(self.slots))  # which of them the trees drafted ahead hold
        # CUDA graphs of the tree forwards (engine/runner/tree_graphs.py): rows a tree up to its most branches,
        # and the window's k + 1; forwards past TREE_GRAPH_ROWS rows (the graphs' logits are [rows, V] float32)
        # run eagerly, as every tree forward does where the runner captures no graphs.
        k = cfg.num_speculative_tokens
        widest = max(1, min(self.schedule.max_fanout * (k + 1), self.max_rows))
        if runner.captures_graphs:
            runner.build_tree_graphs(tree_row_buckets(k + 1, max(widest, k + 1)), num_tree_nodes(k + 1, widest, k),
                                     min(TREE_GRAPH_ROWS, max(self.max_rows, k + 1)))

    def speculate_ahead(self, plan: StepPlan, rows: list[int], host: list[list[int]], alpha: float,
                 scoped: bool = False) -> int:
        """One tree for each request of `plan` at `rows`, whose proposal was host[i] (d_1..d_k); alpha: the running
        per-token acceptance (the schedule's). scoped: each tree's slots are held under its request's scope (its
        target, under a pooled draft) until that scope is released (AheadProposer.drop); otherwise until the next
        reset. Returns the branches drafted."""
        runner = self.proposer.runner
        cfg = runner.config
        depth = plan.max_draft_tokens
        if depth < 1 or not rows:
            return 0
        groups = len(runner.kv_groups)
        own = max(1, self.max_rows // len(rows))  # branches a request within the draft's own row cap
        per_req = self._branch_budget(plan, rows, host, depth, own)
        if per_req < 1:  # the engine's ahead budget leaves no room for even one branch a request: no tree
            for i in rows:
                rid = plan.requests[i].request_id
                self.counters.add(rid, "skipped_trees")
                self.counters.add(rid, "skipped_branches", sum(self.schedule.fanout(len(host[i]), alpha, own)))
            return 0
        reqs: list[TreeDraftRequest] = []
        metas: list[_Tree] = []
        fans: dict[int, list[int]] = {}  # k -> the schedule's F_a (the same for every request of that k)
        cut: dict[int, int] = {}  # k -> branches of a request the budget cut
        for i in rows:
            p = plan.requests[i]
            assert p.token_ids is not None
            d = host[i]
            k = len(d)
            frontier = p.start_pos + len(p.token_ids)
            if not p.draft_token_ids or p.draft_start_pos + len(p.draft_token_ids) != frontier:
                continue  # the draft did not catch up to the frontier: no chain to grow the tree from
            if k not in fans:
                fans[k] = self.schedule.fanout(k, alpha, per_req)
                # Branches the engine's budget took away (against the draft's own cap) count as skipped.
                cut[k] = sum(self.schedule.fanout(k, alpha, own)) - sum(fans[k]) if per_req < own else 0
            fan = list(fans[k])
            self.counters.add(p.request_id, "skipped_branches", cut[k])
            k_next = [min(depth, p.token_limit - (frontier + a + 1) - 1) if p.token_limit else depth
                      for a in range(k + 1)]  # the k the next step drafts after outcome a, as the scheduler shrinks it
            for a in range(k + 1):
                if k_next[a] <= 0 or frontier + a + depth > cfg.max_model_len:
                    fan[a] = 0  # the next step drafts nothing there, or the branch would pass max_model_len
            nb = sum(fan)
            if nb == 0:
                continue
            nodes = num_tree_nodes(k + 1, nb, depth)
            taken = self.reserve.take(nodes, request_scope(p.request_id) if scoped else None)
            if taken is None:
                self.counters.add(p.request_id, "skipped_branches", nb)
                continue
            slots = [self.slots[x] for x in taken]
            reqs.append(TreeDraftRequest(prefix_len=frontier - 1, block_tables=p.draft_block_tables,
                                         window=[p.draft_token_ids[-1], *d], roots=[], scratch_slots=[slots] * groups,
                                         temperature=p.temperature, top_p=p.top_p, top_k=p.top_k))
            metas.append(_Tree(p, frontier, d, fan, slots, k_next))
        if not reqs:
            return 0
        # What the next proposal will do, judged from this plan's requests (engine/speculation/proposer.py): on the
        # eager path it processes the requests' logits and draws a seeded row's noise draft by draft; on the loop,
        # neither (a seeded row's noise up front). The branches do the same, so that a branch is what that proposal
        # would draft after its outcome.
        eager = self.proposer.eager(plan)
        process = eager and any(m.p.logits_params is not None for m in metas)
        branches: list[tuple[_Tree, int, int]] = []  # (tree, outcome a, root t) of every branch, in draft_tree's order

        def choose_roots(logits: list[torch.Tensor]) -> list[list[list[int]]]:
            # Per tree [k + 1, V]: after c (outcome 0's position) .. after d_k (the bonus). Nothing hangs off the
            # prefix's end itself (the chain's first node c is committed). Row a follows d_1..d_a, as the target's
            # verify row a does: a request's logits processing (a grammar's matcher after a accepted drafts, its
            # penalties over that history) applies there as it does to the target's, so masked tokens are no roots.
            if process:
                logits = [process_target_logits(x[None], [m.p], [m.d])[0] if m.p.logits_params is not None else x
                          for m, x in zip(metas, logits)]
            roots = top_f_roots_many(logits, [m.d for m in metas], [m.fan for m in metas])
            for m, r in zip(metas, roots):
                if not any(r):  # every candidate masked: keep one (a tree has a branch; this one never hits)
                    r[max(range(len(m.fan)), key=lambda a: m.fan[a])] = [0]
                branches.extend((m, a, t) for a, cands in enumerate(r) for t in cands)
            return [[[], *r] for r in roots]

        # q only where a sampled request's verify reads it (greedy drafts are one-hot: the merge builds them).
        sampled = self.proposer.keep_probs and any(r.temperature > 0 for r in reqs)
        seeded = any(m.p.seed is not None and m.p.temperature > 0 for m in metas)
        noise = _SeededNoise(branches, eager, runner.device) if seeded else None
        # Roots picked on the device where no hook needs them on the host (logits processing masks candidates and
        # walks each branch's history; a seeded row's noise follows its branch's outcome): no host round trip
        # between the window's forward and the branches'.
        picks = (dict(root_fanouts=[m.fan for m in metas]) if not process and noise is None
                 else dict(choose_roots=choose_roots))
        trees = draft_tree(runner, reqs, depth, self.proposer.generator, keep_logits=False, keep_probs=sampled,
                           saguaro=self.proposer.saguaro, process=_BranchProcessing(branches) if process else None,
                           noise=noise, **picks)
        if plan.ahead_tree_nodes is not None and runner.device.type == "cuda":
            # SYNC: an engine that sizes the trees (plan.ahead_tree_nodes) times them; the draft's own GPU, after its
            # proposal went to the target: it waits for its own tree, which the next proposal would wait for anyway.
            torch.cuda.synchronize(runner.device)
        drafted = 0
        for m, tree in zip(metas, trees):
            p, frontier, d, slots = m.p, m.frontier, m.d, m.slots
            k, nb = len(d), len(tree.root)
            # A seeded sampled branch drawn as the loop draws (up front) serves only a proposal of the k it drew for.
            exact = not eager and p.seed is not None and p.temperature > 0
            token_rows = tree.tokens.unbind(0)
            prob_rows = tree.probs.unbind(0) if tree.probs is not None and p.temperature > 0 else None
            self.counters.add(p.request_id, "trees")
            self.counters.add(p.request_id, "tree_nodes", num_tree_nodes(k + 1, nb, depth))
            for b, (where, t) in enumerate(zip(tree.outcome, tree.root)):
                a = where - 1  # roots[a + 1] hang off window node a (c, d_1, ..): outcome a
                nodes = [k + 1 + b] + [k + 1 + j * nb + b for j in range(1, depth)]  # root, e_1..e_{depth-1}
                if a == k:  # all accepted: the next catch-up is (d_k, t) from d_k's position
                    position, tokens, nodes = frontier + k - 1, (d[k - 1], t), [k, *nodes]
                else:
                    position, tokens = frontier + a, (t,)
                self.cache.entries.setdefault(p.request_id, []).append(AheadEntry(
                    position=position, tokens=tokens, token_ids=token_rows[b],
                    probs=prob_rows[b] if prob_rows is not None else None, kind=ACCEPT if a == k else REJECT,
                    slots=[slots[x] for x in nodes], outcome=a, exact_k=m.k_next[a] if exact else None))
                self.counters.add(p.request_id, "drafted_tokens", depth)
                drafted += 1
        return drafted

    @staticmethod
    def _branch_budget(plan: StepPlan, rows: list[int], host: list[list[int]], depth: int, own: int) -> int:
        """Branches a request this step: the draft's own cap, or less where the plan caps the step's tree nodes
        (engine/speculation/ahead/budget.py): what the nodes leave after every request's chain (k + 1 nodes), shared
        evenly, each branch `depth` nodes."""
        cap = plan.ahead_tree_nodes
        if cap is None:
            return own
        left = cap - sum(len(host[i]) + 1 for i in rows)
        return min(own, max(0, left // (len(rows) * depth)))

    def copy_hits(self, hits: list[tuple[PlannedRequest, AheadEntry]]) -> None:
        """Each hit branch's KV into its request's own blocks, every KV-cache group: the positions the ordinary
        proposal would write for this draft input (the catch-up, then k - 1 drafts)."""
        runner = self.proposer.runner
        bs = runner.config.block_size
        groups = range(len(runner.kv_groups))
        src: list[list[int]] = [[] for _ in groups]  # [num_groups][n] scratch slots ...
        dst: list[list[int]] = [[] for _ in groups]  # ... and the request's own slots they stand for
        for p, e in hits:
            assert e.slots is not None
            n = len(p.draft_token_ids) + p.num_draft_tokens - 1
            for g in groups:
                table = p.draft_block_tables[g]
                for j, slot in enumerate(e.slots[:n]):
                    pos = e.position + j
                    block = table[pos // bs]
                    if block != NULL_BLOCK:
                        src[g].append(slot)
                        dst[g].append(block * bs + pos % bs)
        copy_slots(runner.kv_caches, src, dst)


@dataclass
class _Tree:
    """One request's tree being drafted."""

    p: PlannedRequest
    frontier: int  # the position of d_1
    d: list[int]  # [k] its proposal d_1..d_k
    fan: list[int]  # [k + 1] F_a, branches of outcome a at most
    slots: list[int]  # its scratch slots
    k_next: list[int]  # [k + 1] the k the next step drafts after outcome a


class _BranchProcessing:
    """draft_tree's `process` hook: each branch of a request with logits processing gets the processed logits the
    next proposal after its outcome would draw from. That proposal's history (engine/step/logits_processors.py)
    is the output so far, d_1..d_a, the target's token t (the root), then its own drafts: here the committed output
    with d_1..d_a, t and the branch's drafts as the drafts to follow, so a grammar's matcher walks them from its
    committed state and rolls back, and the penalties, bad words and min_tokens count the same tokens at the same
    output positions."""

    def __init__(self, branches: list[tuple[_Tree, int, int]]) -> None:
        self.branches = branches

    def __call__(self, depth: int, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        rows = [n for n, (m, _, _) in enumerate(self.branches) if m.p.logits_params is not None]
        # SYNC: the processors read each branch's history on the host (only requests with logits processing).
        host = drafts[rows, :depth].tolist() if depth else [[] for _ in rows]
        groups: dict[int, list[tuple[int, list[int]]]] = {}  # drafts followed -> (branch, its history past output)
        for n, own in zip(rows, host):
            m, a, t = self.branches[n]
            groups.setdefault(a + 1 + depth, []).append((n, [*m.d[:a], t, *own]))
        out = logits.float().clone()
        for start, group in groups.items():
            idx = torch.tensor([n for n, _ in group], dtype=torch.int64, device=logits.device)
            out[idx] = process_target_logits(out[idx][:, None], [self.branches[n][0].p for n, _ in group],
                                             [h for _, h in group], start=start)[:, 0]
        return out


class _SeededNoise:
    """draft_tree's `noise` hook: a seeded sampled request's branch of outcome a draws from the generator the next
    proposal after that outcome would (engine/step/plan_sampling.py: its seed at output position
    num_output_tokens + a + 1), as that proposal would: one [V] draw a draft on the eager path, or [k_next, V] at
    once before the first as the draft loop does. A root drawn differently than the proposal would (the target's
    token) does not matter: the proposal's own draws begin after it."""

    def __init__(self, branches: list[tuple[_Tree, int, int]], eager: bool, device: torch.device) -> None:
        self.branches, self.eager, self.device = branches, eager, device  # branches: filled once the roots are
        self.rows: list[tuple[int, torch.Generator, int]] = []  # (branch, its generator, k_next)
        self.upfront: dict[int, torch.Tensor] = {}  # branch -> [k_next, V] float32 (the loop's way)

    def __call__(self, depth: int, exps: torch.Tensor) -> None:
        if depth == 0:
            self.rows = [(n, request_generator(m.p.seed, m.p.num_output_tokens + a + 1, DRAFT_STREAM, self.device),
                          m.k_next[a]) for n, (m, a, _) in enumerate(self.branches)
                         if m.p.seed is not None and m.p.temperature > 0]
        for n, gen, k_next in self.rows:
            if self.eager:
                exps[n].exponential_(generator=gen)
                continue
            if depth == 0:
                self.upfront[n] = torch.empty(k_next, exps.shape[1], dtype=torch.float32,
                                              device=self.device).exponential_(generator=gen)
            if depth < k_next:
                exps[n] = self.upfront[n][depth]
