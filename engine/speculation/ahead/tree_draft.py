"""Tree-batched pre-drafting: every verify outcome of a window drafted D deep, one draft forward per depth.

After the draft proposed a window d_1..d_k after a request's committed prefix, the verify accepts some a in 0..k
drafts and then emits one token of the target's at position prefix_len + a (the bonus token after a full window, a
replacement after a rejection). Pre-drafting covers those outcomes before the verify has decided: for each a, a few
candidate tokens (`roots[a]`, e.g. the draft's top-F at that position other than d_{a+1}), each the root of a branch
that is then drafted `depth` tokens deep. All branches of all requests are one tree per request:

    prefix ... -- d_1 -- d_2 -- ... -- d_k              (the window: a chain of nodes)
              \\        \\               \\
               roots[0]  roots[1] ...     roots[k]       (each root: a branch of `depth` drafted tokens)

The first forward feeds the window and every root (each row sees the prefix and its own chain only: tree attention,
engine/attention/tree_metadata.py) and yields every branch's first draft; each later forward feeds every branch's
newest draft at once. The prefix's KV is read in place from the request's own paged blocks (every KV-cache group,
sliding windows included); every node's KV goes to a scratch slot the caller gives, so nothing of the request's own
KV changes. So a request costs `depth` forwards whatever its number of branches.

Roots chosen from the window's own logits (`choose_roots` on the host, or `root_fanouts`: each outcome's top-F
picked on the device, with no wait for the host inside a tree): the first forward then feeds the window alone, the
roots come from the logits after each window token, and `depth` more forwards draft the branches (the first feeds
the roots). Speculation ahead's tree mode (engine/speculation/ahead/tree.py) drafts so,
with the window led by the last committed token, so that its logits cover every outcome of the verify.

Each forward replays a CUDA graph of its (trees, rows a tree) bucket where the runner captured one
(engine/runner/tree_graphs.py: ModelRunner.build_tree_graphs, which speculation ahead's tree mode calls at start-up),
else runs eagerly on either attention path (the torch reference, or the Triton tree kernel,
engine/kernels/attention/tree.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, CommonAttentionMetadata, GroupAttentionMetadata
from engine.attention.tree_metadata import TreeNodes
from engine.host_copy import tensor_to_device, to_device
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import StepInput
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.saguaro import SaguaroSampling, saguaro_probs, sample_saguaro
from engine.sample.sampler import exponential_race, random_exponential, sample_from_probs
from engine.speculation.ahead.tree_roots import top_f_roots_on_device

# process(depth, logits [branches, V], drafts so far [branches, depth] int64, columns < depth valid) -> the logits the
# branches draw from at that depth (a request's logits processing along its branch).
ProcessHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# noise(depth, exponentials [branches, V] float32) overwrites, in place, the rows that draw from generators of their
# own (a seeded request's), before the race.
NoiseHook = Callable[[int, torch.Tensor], None]


@dataclass
class TreeDraftRequest:
    """One request's tree: its committed prefix, the window whose outcomes it covers, the branch roots."""

    prefix_len: int  # committed tokens, positions 0..prefix_len - 1, their KV in the request's own blocks
    block_tables: list[list[int]]  # [num_kv_groups][num_blocks]; the request's own blocks, covering prefix_len
    window: list[int]  # the k drafts d_1..d_k at positions prefix_len..prefix_len + k - 1
    roots: list[list[int]]  # [k + 1][F_a]: candidates for the token at position prefix_len + a after a accepted
    # [num_kv_groups][>= num_nodes] flat scratch slots (block * block_size + offset), num_nodes = `num_tree_nodes`:
    # the window's, the roots', then each later depth's, branch by branch (slots past num_nodes stay unused). None
    # of them may be the request's own.
    scratch_slots: list[list[int]]
    temperature: float = 0.0  # 0: greedy (argmax, q one-hot); else drafts are drawn from q
    top_p: float = 1.0
    top_k: int = 0


def num_tree_nodes(window_len: int, num_branches: int, depth: int) -> int:
    """Nodes (and scratch slots per KV-cache group) one request's tree feeds: the window, each branch's root and
    its first depth - 1 drafts (the last draft is never fed)."""
    return window_len + num_branches * depth


@dataclass
class TreeDraft:
    """One request's pre-drafted branches, in the order of its roots (outcome 0's first)."""

    outcome: list[int]  # [num_branches]; the accepted count a each branch assumes
    root: list[int]  # [num_branches]; the branch's root token (the target's token at position prefix_len + a)
    tokens: torch.Tensor  # [num_branches, depth] int64; the drafts after the root
    # [num_branches, depth, V] float32; the draft's logits each draft was drawn from (None: not kept)
    logits: torch.Tensor | None
    # [num_branches, depth, V] float32; q of each draft (one-hot when greedy; None: not kept)
    probs: torch.Tensor | None
    window_logits: torch.Tensor  # [k, V] float32; the logits after each window token d_1..d_k


def _tree_layout(req: TreeDraftRequest, depth: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(parents of every node, tokens of the window's and the roots' nodes, branch outcome, branch root)."""
    k = len(req.window)
    if len(req.roots) != k + 1:
        raise ValueError(f"a window of {k} drafts has {k + 1} outcomes, got roots for {len(req.roots)}")
    parents = [i - 1 for i in range(k)]  # the window: a chain off the prefix's end
    outcome: list[int] = []
    root: list[int] = []
    for a, cands in enumerate(req.roots):
        for tok in cands:
            parents.append(a - 1)  # after a accepted drafts the root follows d_a (the prefix's end for a = 0)
            outcome.append(a)
            root.append(tok)
    b = len(root)
    for dpt in range(1, depth):
        first = k + (dpt - 1) * b  # the previous depth's nodes of the branches, in branch order
        parents.extend(range(first, first + b))
    return parents, list(req.window) + root, outcome, root


class TreeForwards:
    """The forwards over one layout of trees: its nodes walked once (TreeNodes), then each forward a CUDA graph's
    replay where the runner has one that fits (engine/runner/tree_graphs.py), else eager."""

    def __init__(self, runner: ModelRunner, reqs: list[TreeDraftRequest], parents: list[list[int]]) -> None:
        self.runner, self.reqs, self.parents = runner, reqs, parents
        self.nodes = TreeNodes([r.prefix_len for r in reqs], parents,
                               [[s[:len(p)] for s in r.scratch_slots] for r, p in zip(reqs, parents)])
        self.loaded = False

    def __call__(self, rows: list[list[int]], tokens: list[torch.Tensor]) -> torch.Tensor:
        """One forward over the given nodes of every tree -> logits [sum of rows, V]."""
        runner, reqs = self.runner, self.reqs
        feed = tensor_to_device(torch.cat(tokens), runner.device)
        graphs = runner.tree_graphs
        key = (graphs.bucket(len(reqs), max(len(r) for r in rows), self.nodes.seen.shape[1])
               if graphs is not None else None)
        if key is not None:
            if not self.loaded:
                graphs.load_nodes(self.nodes, [r.block_tables for r in reqs])
                self.loaded = True
            return graphs.run(key, rows, feed)
        return runner.execute(self.eager_step(rows, feed))

    def eager_step(self, rows: list[list[int]], feed: torch.Tensor) -> StepInput:
        runner, reqs, dev = self.runner, self.reqs, self.runner.device
        fed = self.nodes.fed(rows)
        tree = self.nodes.metadata(fed, dev)
        positions = tree.positions
        num_rows = int(positions.shape[0])
        groups = []
        for g in runner.kv_groups:
            bs = g.spec.block_size
            max_blocks = max(-(-r.prefix_len // bs) for r in reqs) or 1
            table = torch.full((len(reqs), max_blocks), NULL_BLOCK, dtype=torch.int64)
            for i, r in enumerate(reqs):
                own = r.block_tables[g.group_id][:max_blocks]
                table[i, :len(own)] = torch.tensor(own, dtype=torch.int64)
            slots = torch.from_numpy(fed.slots[g.group_id][fed.valid])
            groups.append(GroupAttentionMetadata(group_id=g.group_id, block_table=tensor_to_device(table, dev),
                                                 slot_mapping=tensor_to_device(slots, dev),
                                                 sliding_window=g.spec.sliding_window, block_size=bs))
        counts = [len(rs) for rs in rows]
        qsl = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
        common = CommonAttentionMetadata(query_start_loc=tensor_to_device(qsl, dev), seq_lens=tree.prefix_lens,
                                         positions=positions, num_reqs=len(reqs), num_tokens=num_rows,
                                         max_query_len=max(counts),
                                         max_seq_len=max(r.prefix_len + len(r.window) + len(p) for r, p in
                                                         zip(reqs, self.parents)))  # an upper bound, from the host
        return StepInput(input_ids=feed, positions=positions,
                         attn=AttentionMetadata(common=common, groups=groups, backend=runner.backend, tree=tree),
                         logits_indices=torch.arange(num_rows, device=dev), num_logits_per_req=counts)


@torch.inference_mode()
def draft_tree(runner: ModelRunner, reqs: list[TreeDraftRequest], depth: int,
               generator: torch.Generator | None = None,
               choose_roots: Callable[[list[torch.Tensor]], list[list[list[int]]]] | None = None,
               root_fanouts: list[list[int]] | None = None,
               keep_logits: bool = True, keep_probs: bool = True,
               saguaro: SaguaroSampling | None = None, process: ProcessHook | None = None,
               noise: NoiseHook | None = None) -> list[TreeDraft]:
    """Draft every branch of every request `depth` tokens deep. Greedy requests take the argmax; others draw from
    their q (temperature, top-k, top-p) with `generator`.

    choose_roots None: each request's `roots` are given; `depth` batched forwards in all, the first feeding the
    windows and the roots. Else choose_roots(logits) gives every request's roots ([len(window) + 1][F] each, as
    `roots`) from the logits after each of its window tokens (per request [len(window), V] float32): a first
    forward feeds the windows alone, then `depth` forwards draft the branches. root_fanouts (instead of
    choose_roots): the same, with request i's roots off window node j its top root_fanouts[i][j] tokens there,
    window[j + 1] excluded (tree_roots.top_f_roots_on_device), picked on the device: nothing waits for the host
    between the forwards, and the host builds the branches' layout while the window's forward runs. For logits no
    processing masks (a -inf candidate would still be drafted). keep_logits / keep_probs False: those outputs are
    None (two [branches, depth, V] float32 tensors a caller may not need). saguaro: sampled rows draw from q'
    (engine/sample/saguaro.py) and `probs` holds q'. process: applied to each depth's logits before q (and `logits`
    holds its result). noise: sampled rows race with Exp(1) noise from `generator` that this hook may
    overwrite row by row (per-branch generators); None: `generator` for every row."""
    if depth < 1:
        raise ValueError("depth must be at least 1")
    dev = runner.device
    ks = [len(r.window) for r in reqs]
    if choose_roots is not None and root_fanouts is not None:
        raise ValueError("choose_roots and root_fanouts are two ways to pick the roots: give one")
    window_logits: list[torch.Tensor] = []
    device_roots: torch.Tensor | None = None
    if root_fanouts is not None and any(len(f) != k for f, k in zip(root_fanouts, ks, strict=True)):
        raise ValueError("root_fanouts: one count a window node")
    if choose_roots is not None or root_fanouts is not None:
        chains = [[j - 1 for j in range(k)] for k in ks]
        for r, p in zip(reqs, chains):
            _check_slots(runner, r, len(p))
        logits = TreeForwards(runner, reqs, chains)([list(range(k)) for k in ks],
                                                 [to_device(r.window, torch.int64, dev) for r in reqs])
        window_logits = list(logits.split(ks))
        if choose_roots is not None:
            roots = choose_roots(window_logits)
        else:
            # Queued behind the window's forward, with no wait for it: the layout needs only the counts (placeholder
            # roots), so the host builds it while the GPU runs that forward.
            device_roots = top_f_roots_on_device(window_logits, [r.window[1:] for r in reqs], root_fanouts)
            roots = [[[], *[[0] * n for n in f]] for f in root_fanouts]
        reqs = [dataclasses.replace(r, roots=rs) for r, rs in zip(reqs, roots, strict=True)]
    layouts = [_tree_layout(r, depth) for r in reqs]
    parents = [lay[0] for lay in layouts]
    for r, p in zip(reqs, parents):
        _check_slots(runner, r, len(p))
    nbs = [len(lay[2]) for lay in layouts]
    md = SamplingMetadata.from_lists([r.temperature for r in reqs], [r.top_p for r in reqs],
                                     [r.top_k for r in reqs], default_generator=generator, device=dev)
    # Per request, the rows' sampling settings repeat over its branches.
    branch_req = [i for i, nb in enumerate(nbs) for _ in range(nb)]
    branch_md = md.select(branch_req)
    tokens = torch.empty(sum(nbs), depth, dtype=torch.int64, device=dev)
    logits_out = (torch.empty(sum(nbs), depth, runner.vocab_size, dtype=torch.float32, device=dev) if keep_logits
                  else None)
    probs_out = (torch.empty(sum(nbs), depth, runner.vocab_size, dtype=torch.float32, device=dev) if keep_probs
                 else None)
    offsets = [0]
    for nb in nbs:
        offsets.append(offsets[-1] + nb)
    forward = TreeForwards(runner, reqs, parents)
    windows_fed = choose_roots is not None or root_fanouts is not None
    for dpt in range(depth):
        if dpt == 0 and not windows_fed:  # the window and every root
            rows = [list(range(k + nb)) for k, nb in zip(ks, nbs)]
            feed = [to_device(lay[1], torch.int64, dev) for lay in layouts]
        elif dpt == 0:  # every root (the window was fed above)
            rows = [list(range(k, k + nb)) for k, nb in zip(ks, nbs)]
            feed = (list(device_roots.split(nbs)) if device_roots is not None
                    else [to_device(lay[3], torch.int64, dev) for lay in layouts])
        else:  # every branch's newest draft
            rows = [list(range(k + dpt * nb, k + (dpt + 1) * nb)) for k, nb in zip(ks, nbs)]
            feed = [tokens[offsets[i]:offsets[i + 1], dpt - 1] for i in range(len(reqs))]
        logits = forward(rows, feed)
        if dpt == 0 and not windows_fed:
            per_req = logits.split([k + nb for k, nb in zip(ks, nbs)])
            window_logits = [x[:k] for x, k in zip(per_req, ks)]
            logits = torch.cat([x[k:] for x, k in zip(per_req, ks)])
        if process is not None:
            logits = process(dpt, logits, tokens)
        probs = logits_to_probs(logits, branch_md)
        if noise is not None:  # as below, with the hook's noise
            if saguaro is not None and not branch_md.all_greedy:
                probs = saguaro_probs(probs, saguaro.top_f, saguaro.factor,
                                      None if branch_md.all_random else branch_md.temperature == 0)
            if branch_md.all_greedy:
                tokens[:, dpt] = probs.argmax(dim=-1)
            else:
                exps = random_exponential(branch_md, probs.shape[1:], dev)
                noise(dpt, exps)
                tokens[:, dpt] = exponential_race(probs, exps.clamp_(min=torch.finfo(torch.float32).tiny))
        elif saguaro is None:
            tokens[:, dpt] = sample_from_probs(probs, branch_md)
        else:  # drawn from q' and q' kept: a hit's verify must read the distribution its drafts came from
            tokens[:, dpt], probs = sample_saguaro(probs, branch_md, saguaro.top_f, saguaro.factor)
        if logits_out is not None:
            logits_out[:, dpt] = logits
        if probs_out is not None:
            probs_out[:, dpt] = probs
    def part(x: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return x[offsets[i]:offsets[i + 1]] if x is not None else None

    if device_roots is not None:
        # SYNC: the roots are the cache's keys, kept on the host; queued after the last forward, so the host waits
        # for the whole tree (what the next proposal would wait for anyway), not between its forwards.
        host_roots = device_roots.tolist()
        layouts = [(lay[0], lay[1], lay[2], host_roots[offsets[i]:offsets[i + 1]]) for i, lay in enumerate(layouts)]
    return [TreeDraft(outcome=lay[2], root=lay[3], tokens=tokens[offsets[i]:offsets[i + 1]],
                      logits=part(logits_out, i), probs=part(probs_out, i), window_logits=window_logits[i])
            for i, lay in enumerate(layouts)]


def _check_slots(runner: ModelRunner, req: TreeDraftRequest, num_nodes: int) -> None:
    if len(req.scratch_slots) != len(runner.kv_groups) or any(len(s) < num_nodes for s in req.scratch_slots):
        raise ValueError(f"a tree of {num_nodes} nodes needs that many scratch slots in each KV-cache group")
