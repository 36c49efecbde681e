"""Input buffers at fixed device addresses for the kernel path, and the host code that fills them.

Every kernel-path step, eager or a CUDA-graph replay, reads its inputs from these tensors: a graph
captured once keeps reading the same addresses, so a step only rewrites their contents (one host-to-device
copy per tensor). Requests past the step's real ones are padding (no query tokens, seq_len 0), and tokens
past the real ones have slot -1, which the KV-store kernel skips.

The host's share sits between two graph replays with the GPU idle (at batch 1 an 8B model's step is 6.5 ms of GPU
time), so it is kept lean: NumPy views of the pinned staging memory are made once, and the step views and copy pairs
are built once per step shape and reused. Block tables, which grow with the context (a 32k-token request holds 2048
blocks of 16 per KV-cache group), persist in the staging rows across steps: a step writes only the entries that
changed since the slot's last step, so its host work grows with the blocks added, not with the context.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata, CommonAttentionMetadata, GroupAttentionMetadata
from engine.kv_cache.block_pool import NULL_BLOCK
from engine.kv_cache.spec import KVCacheGroupSpec
from engine.runner.step_input import Chunk, StepInput


class InputBuffers:
    """Device tensors a step reads, sized for the largest step; the KV-cache group is their first dim."""

    # Steps of up to this many tokens are staged in plain Python (`_fill_few`), larger ones in NumPy passes
    # (`_fill_many`): a NumPy call costs 1-4 us of fixed host time, and a batch-1 draft step made two dozen of them
    # (70-90 us of its 140-170 us `load` on an H200 machine's host) to write a few ints.
    few_tokens = 64

    def __init__(self, groups: list[KVCacheGroupSpec], max_num_reqs: int, max_num_tokens: int,
                 max_model_len: int, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        # One spare block: a draft loop may look one position past the last allocated one.
        self.max_blocks = max(-(-max_model_len // g.spec.block_size) for g in groups) + 1
        g, r, t, b = len(groups), max_num_reqs, max_num_tokens, self.max_blocks
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(t, dtype=i64, device=device)  # [max_num_tokens] int64
        self.positions = torch.zeros(t, dtype=i64, device=device)  # [max_num_tokens] int64
        self.query_start_loc = torch.zeros(r + 1, dtype=i32, device=device)  # [max_num_reqs + 1] int32
        self.seq_lens = torch.zeros(r, dtype=i32, device=device)  # [max_num_reqs] int32
        self.block_tables = torch.zeros(g, r, b, dtype=i32, device=device)  # [num_groups, max_num_reqs, max_blocks]
        self.slot_mappings = torch.full((g, t), -1, dtype=i64, device=device)  # [num_groups, max_num_tokens]
        self.logits_indices = torch.zeros(t, dtype=i64, device=device)  # [max_num_tokens] int64
        pin = device.type == "cuda"
        # Host staging of the same shapes: pinned, so the copies are asynchronous DMA.
        self._host = {name: torch.zeros_like(getattr(self, name), device="cpu").pin_memory() if pin
                      else torch.zeros_like(getattr(self, name), device="cpu")
                      for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
                                   "slot_mappings", "logits_indices")}
        # NumPy views of the staging tensors, made once: the host fills them every step.
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._np["block_tables"][:] = NULL_BLOCK
        # [num_groups][max_num_reqs] -> the blocks the staging row of that request slot holds (NULL_BLOCK after
        # them): our own lists, never the chunks', which their owners may change in place. A step compares a
        # chunk's table with its slot's (a C-level list compare, no conversion) and writes only the difference.
        self._rows: list[list[list[int]]] = [[[] for _ in range(r)] for _ in range(g)]
        # Recorded after each upload: the staging memory may be rewritten only once the copies have read it.
        self._uploaded = torch.cuda.Event() if pin else None
        # Step views by (num_reqs, num_tokens, max_query_len, num_logits): views of fixed buffers, so they are
        # built once per shape and only their max_seq_len and num_logits_per_req change from step to step.
        self._views: dict[tuple[int, int, int, int], StepInput] = {}
        self._copies: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def view(self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
             num_logits: int) -> StepInput:
        """A StepInput whose tensors are views of the buffers (what a graph is captured with)."""
        key = (num_reqs, num_tokens, max_query_len, num_logits)
        step = self._views.get(key)
        if step is None:
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[:num_reqs + 1], seq_lens=self.seq_lens[:num_reqs],
                positions=self.positions[:num_tokens], num_reqs=num_reqs, num_tokens=num_tokens,
                max_query_len=max_query_len, max_seq_len=max_seq_len)
            groups = [GroupAttentionMetadata(group_id=g.group_id,
                                             block_table=self.block_tables[g.group_id, :num_reqs],
                                             slot_mapping=self.slot_mappings[g.group_id, :num_tokens],
                                             sliding_window=g.spec.sliding_window, block_size=g.spec.block_size)
                      for g in self.groups]
            step = StepInput(input_ids=self.input_ids[:num_tokens], positions=self.positions[:num_tokens],
                             attn=AttentionMetadata(common, groups, backend="triton"),
                             logits_indices=self.logits_indices[:num_logits], num_logits_per_req=[])
            self._views[key] = step
        step.attn.common.max_seq_len = max_seq_len
        step.num_logits_per_req = []
        for g in step.attn.groups:
            g.cache.clear()  # derived tensors belong to one step
        return step

    def load(self, chunks: list[Chunk], num_reqs: int | None = None, num_tokens: int | None = None,
             max_query_len: int | None = None, num_logits_padded: int | None = None) -> StepInput:
        """Write the chunks into the buffers, padded to num_reqs requests and num_tokens tokens, and
        return the step's view. Logits rows are the chunks' last num_logits tokens, in order, then token 0
        up to num_logits_padded rows (so a graph's fixed-size gather stays in bounds)."""
        if not chunks:
            raise ValueError("a step needs at least one request")
        n_real = len(chunks)
        t_real = sum(len(c.token_ids) for c in chunks)
        for c in chunks:
            if not 0 <= c.num_logits <= len(c.token_ids):
                raise ValueError("each chunk needs 0 <= num_logits <= its number of tokens")
        r = n_real if num_reqs is None else num_reqs
        t = t_real if num_tokens is None else num_tokens
        if r > self.max_num_reqs or t > self.max_num_tokens or r < n_real or t < t_real:
            raise ValueError(f"step of {n_real} requests / {t_real} tokens (padded {r} / {t}) does not fit the "
                             f"input buffers ({self.max_num_reqs} / {self.max_num_tokens})")
        self._wait_for_upload()
        num_logits = sum(c.num_logits for c in chunks)
        padded = max(num_logits, num_logits_padded or 0)
        fill = self._fill_few if t_real <= self.few_tokens else self._fill_many
        max_q, max_seq = fill(chunks, r, t, t_real, num_logits, padded)
        self._upload(r, t, padded)
        step = self.view(r, t, max_query_len if max_query_len is not None else max_q, max_seq, padded)
        step.num_logits_per_req = [c.num_logits for c in chunks]
        return step

    def _fill_many(self, chunks: list[Chunk], r: int, t: int, t_real: int, num_logits: int,
                   padded: int) -> tuple[int, int]:
        """`load`'s staging writes in NumPy passes over the tokens; returns (longest query, longest KV)."""
        n_real = len(chunks)
        qlens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=n_real)
        starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n_real)
        nlog = np.fromiter((c.num_logits for c in chunks), dtype=np.int64, count=n_real)
        h = self._np
        qsl = h["query_start_loc"][:r + 1]
        qsl[0] = 0
        np.cumsum(qlens, out=qsl[1:n_real + 1])
        qsl[n_real + 1:] = t_real
        seq = h["seq_lens"][:r]
        np.add(starts, qlens, out=seq[:n_real], casting="unsafe")
        seq[n_real:] = 0
        ids = h["input_ids"][:t]
        ids[:t_real] = np.fromiter((tok for c in chunks for tok in c.token_ids), dtype=np.int64, count=t_real)
        ids[t_real:] = 0
        req_of_tok = np.repeat(np.arange(n_real), qlens)
        pos = h["positions"][:t]
        # token j of request i sits at starts[i] + j, and request i's tokens start at qsl[i]
        pos[:t_real] = np.arange(t_real) + np.repeat(starts - qsl[:n_real], qlens)
        pos[t_real:] = 0
        real_pos = pos[:t_real]
        for g in self.groups:
            gid, bs = g.group_id, g.spec.block_size
            bt = self._stage_block_tables(chunks, r, gid)
            blk = bt[req_of_tok, np.minimum(real_pos // bs, self.max_blocks - 1)]
            if (blk == NULL_BLOCK).any():
                raise RuntimeError(f"a new token maps to a released or unallocated block in group {gid}")
            slots = h["slot_mappings"][gid, :t]
            slots[:t_real] = blk.astype(np.int64) * bs + real_pos % bs
            slots[t_real:] = -1
        li = h["logits_indices"][:padded]
        # a chunk's logits rows are its last num_logits tokens: ends - num_logits + 0 .. num_logits - 1
        li[:num_logits] = np.repeat(qsl[1:n_real + 1] - np.cumsum(nlog), nlog) + np.arange(num_logits)
        li[num_logits:] = 0
        return int(qlens.max()), int(seq.max())

    def _fill_few(self, chunks: list[Chunk], r: int, t: int, t_real: int, num_logits: int,
                  padded: int) -> tuple[int, int]:
        """What `_fill_many` writes, in plain Python over the tokens: for the few tokens of a decode, verify or draft
        step, where each of _fill_many's two dozen NumPy calls costs more than the arithmetic it does."""
        ends, seqs, ids, pos, rows = [], [], [], [], []
        end = 0
        for c in chunks:
            q = len(c.token_ids)
            ids += c.token_ids
            pos += range(c.start_pos, c.start_pos + q)
            rows += range(end + q - c.num_logits, end + q)
            end += q
            ends.append(end)
            seqs.append(c.start_pos + q)
        h, n_real = self._np, len(chunks)
        qsl = h["query_start_loc"]
        qsl[0] = 0
        qsl[1:n_real + 1] = ends
        qsl[n_real + 1:r + 1] = t_real
        seq = h["seq_lens"]
        seq[:n_real] = seqs
        seq[n_real:r] = 0
        h["input_ids"][:t_real] = ids
        h["input_ids"][t_real:t] = 0
        h["positions"][:t_real] = pos
        h["positions"][t_real:t] = 0
        for g in self.groups:
            gid, bs = g.group_id, g.spec.block_size
            self._stage_block_tables(chunks, r, gid)
            slots = []
            for c in chunks:
                table = c.block_tables[gid]
                for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
                    i = p // bs
                    blk = table[i] if i < len(table) else NULL_BLOCK  # tables past max_blocks were refused above
                    if blk == NULL_BLOCK:
                        raise RuntimeError(f"a new token maps to a released or unallocated block in group {gid}")
                    slots.append(blk * bs + p % bs)
            h["slot_mappings"][gid, :t_real] = slots
            h["slot_mappings"][gid, t_real:t] = -1
        li = h["logits_indices"]
        li[:num_logits] = rows
        li[num_logits:padded] = 0
        return max(len(c.token_ids) for c in chunks), max(seqs)

    def _stage_block_tables(self, chunks: list[Chunk], r: int, gid: int) -> np.ndarray:
        """Group gid's staging rows [r, max_blocks] holding the chunks' block tables, then null rows for padding."""
        bt = self._np["block_tables"][gid, :r]
        kept = self._rows[gid]
        for i, c in enumerate(chunks):
            update_block_table_row(bt[i], kept[i], c.block_tables[gid], self.max_blocks)
        for i in range(len(chunks), r):  # padding requests read the null block
            if kept[i]:
                update_block_table_row(bt[i], kept[i], [], self.max_blocks)
        return bt

    def load_dummy(self, num_reqs: int, query_len: int) -> StepInput:
        """A padding-only step of num_reqs requests with query_len tokens each, reading the null block and
        writing nothing: what graphs are captured with."""
        chunks = [Chunk([0] * query_len, 0, query_len, [[] for _ in self.groups])] * num_reqs
        self._wait_for_upload()
        h = self._host
        r, t = num_reqs, num_reqs * query_len
        h["query_start_loc"][:r + 1] = torch.arange(0, t + 1, query_len, dtype=torch.int32)
        h["seq_lens"][:r] = query_len
        h["input_ids"][:t] = 0
        h["positions"][:t] = torch.arange(query_len).repeat(r)
        self._null_rows(r)
        h["slot_mappings"][:, :t] = -1
        h["logits_indices"][:t] = torch.arange(t)
        self._upload(r, t, t)
        step = self.view(r, t, query_len, query_len, t)
        step.num_logits_per_req = [c.num_logits for c in chunks]
        return step

    def load_padding(self, num_reqs: int, num_tokens: int, max_query_len: int, num_logits: int) -> StepInput:
        """A padding-only step of this launch shape: num_reqs requests that all hold no token (every attention
        program exits at once, no block table entry is read), num_tokens padding tokens (slot -1: no KV written),
        num_logits logits rows on token 0. The kernels size their grids from these host ints alone, so a step
        built like this compiles the same kernel variants, and captures the same graph, as any real batch of the
        shape; with real lengths it could read past a block table row (max_query_len may exceed max_model_len)."""
        self._wait_for_upload()
        h = self._host
        r, t = num_reqs, num_tokens
        h["query_start_loc"][:r + 1] = 0
        h["seq_lens"][:r] = 0
        h["input_ids"][:t] = 0
        h["positions"][:t] = 0
        self._null_rows(r)
        h["slot_mappings"][:, :t] = -1
        h["logits_indices"][:num_logits] = 0
        self._upload(r, t, num_logits)
        step = self.view(r, t, max_query_len, 1, num_logits)
        step.num_logits_per_req = [num_logits] + [0] * (r - 1)
        return step

    def _null_rows(self, r: int) -> None:
        """Every group's first r block-table rows read the null block (a padding-only step)."""
        self._host["block_tables"][:, :r] = NULL_BLOCK
        for kept in self._rows:
            for i in range(r):
                kept[i] = []

    def _wait_for_upload(self) -> None:
        # SYNC: only until the previous step's copies have run. A step that samples nothing (mid-prefill) does
        # not wait for its GPU work, so without this the next step could rewrite the pinned staging memory
        # before the DMA of the last one read it. Normally those copies finished long ago.
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def _upload(self, r: int, t: int, num_logits: int) -> None:
        key = (r, t, num_logits)
        pairs = self._copies.get(key)
        if pairs is None:  # (device view, staging view) per buffer, for this shape
            h = self._host
            pairs = self._copies[key] = [
                (self.query_start_loc[:r + 1], h["query_start_loc"][:r + 1]), (self.seq_lens[:r], h["seq_lens"][:r]),
                (self.input_ids[:t], h["input_ids"][:t]), (self.positions[:t], h["positions"][:t]),
                (self.block_tables[:, :r], h["block_tables"][:, :r]),
                (self.slot_mappings[:, :t], h["slot_mappings"][:, :t]),
                (self.logits_indices[:num_logits], h["logits_indices"][:num_logits])]
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


def update_block_table_row(staged: np.ndarray, kept: list[int], row: list[int], max_blocks: int) -> None:
    """Make a staging row (`staged`, [max_blocks] int32, holding `kept` then NULL_BLOCK) hold `row` instead, writing
    only what differs in the usual cases: the same request with blocks appended (a decode step: nothing or one new
    block), or nothing changed. Any other change (a different request in the slot, a sliding-window group's released
    blocks, a table that shrank) rewrites the row and nulls what the old one held past the new one's end."""
    n, m = len(kept), len(row)
    if m > max_blocks:
        raise ValueError(f"block table of {m} blocks exceeds max_model_len")
    if m == n and row == kept:
        return
    if m > n and row[:n] == kept:
        new = row[n:]
        staged[n:m] = new
        kept.extend(new)
        return
    staged[:m] = row
    if n > m:
        staged[m:n] = NULL_BLOCK
    kept[:] = row
