"""A draft loop's first step built on the device from one small upload (Triton kernel + typed wrapper + torch
reference).

Why: the first step of a draft loop catches each request up by one or two tokens (the target's correction after a
rejection; the last draft and the bonus token after a fully accepted window). Built on the host
(`InputBuffers.load`) it takes NumPy passes and seven host-to-device copies, and the loop's per-row settings (draft
counts, guess modes, the step index) a few small torch operations more: 0.4-0.6 ms of host time a loop on an H200's
host, measured, all of it before the GPU has anything to run, against a draft step of 0.75 ms. Here the host writes
one row of six int64 a request into pinned memory and copies it once, and this kernel writes what `load` would have.
The block tables are not in the upload: `InputBuffers` keeps them on the device and copies them only when a row
changed (`InputBuffers.stage_block_tables`).

Per request row i < num_rows, from rows[i] = (qlen, start, tok0, tok1, num_draft, guess), qlen 1 or 2 for a request
and 0 for a padding row:
  query_start_loc[i + 1] = qlen[0] + ... + qlen[i]; seq_lens[i] = start + qlen (0 for padding);
  token j < qlen at query_start_loc[i] + j: input id tok_j, position start + j and, in every KV-cache group, the slot
  of that position in the row's block table; logits_indices[i] = the row's last token (0 for padding);
  num_draft[i], guess[i] = the row's.
Tokens past the real ones, up to num_tokens: id 0, position 0, slot -1. The step index is reset to 0.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import require_triton, tl, triton

__all__ = ["ROW_FIELDS", "build_catch_up_inputs", "build_catch_up_inputs_ref"]

ROW_FIELDS = 6  # qlen, start, tok0, tok1, num_draft, guess
MAX_CATCH_UP = 2  # tokens a request catches up at most


@triton.jit
def _catch_up_kernel(rows_ptr, input_ids_ptr, positions_ptr, seq_lens_ptr, qsl_ptr, logits_idx_ptr,
                     block_tables_ptr, slots_ptr, num_draft_ptr, guess_ptr, step_ptr, num_rows, num_tokens,
                     max_blocks, stride_bt_group, stride_bt_row, stride_slot_group,
                     NUM_GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS_P: tl.constexpr,
                     TOKENS_P: tl.constexpr):
    r = tl.arange(0, ROWS_P)
    live = r < num_rows
    base = rows_ptr + r * 6
    qlen = tl.load(base, mask=live, other=0)
    start = tl.load(base + 1, mask=live, other=0)
    tok0 = tl.load(base + 2, mask=live, other=0)
    tok1 = tl.load(base + 3, mask=live, other=0)
    tl.store(num_draft_ptr + r, tl.load(base + 4, mask=live, other=0), mask=live)
    tl.store(guess_ptr + r, tl.load(base + 5, mask=live, other=0), mask=live)
    ends = tl.cumsum(qlen, axis=0)  # [ROWS_P]: each row's end in the token layout
    first = ends - qlen
    t_real = tl.sum(qlen, axis=0)
    tl.store(qsl_ptr, 0)
    tl.store(qsl_ptr + 1 + r, ends.to(tl.int32), mask=live)
    tl.store(seq_lens_ptr + r, tl.where(qlen > 0, start + qlen, 0).to(tl.int32), mask=live)
    tl.store(logits_idx_ptr + r, tl.where(qlen > 0, ends - 1, 0), mask=live)
    # Padding tokens, disjoint from the real ones below (no ordering needed between the two).
    j = tl.arange(0, TOKENS_P)
    pad = (j >= t_real) & (j < num_tokens)
    zero = tl.zeros([TOKENS_P], dtype=tl.int64)
    tl.store(input_ids_ptr + j, zero, mask=pad)
    tl.store(positions_ptr + j, zero, mask=pad)
    for g in tl.static_range(NUM_GROUPS):
        tl.store(slots_ptr + g * stride_slot_group + j, zero - 1, mask=pad)
    for s in tl.static_range(2):
        has = live & (qlen > s)
        pos = start + s
        dst = first + s
        tl.store(input_ids_ptr + dst, tl.where(s == 0, tok0, tok1), mask=has)
        tl.store(positions_ptr + dst, pos, mask=has)
        idx = tl.minimum(pos // BLOCK_SIZE, max_blocks - 1)
        for g in tl.static_range(NUM_GROUPS):
            blk = tl.load(block_tables_ptr + g * stride_bt_group + r * stride_bt_row + idx, mask=has,
                          other=0).to(tl.int64)
            tl.store(slots_ptr + g * stride_slot_group + dst, blk * BLOCK_SIZE + pos % BLOCK_SIZE, mask=has)
    tl.store(step_ptr, 0)


def build_catch_up_inputs(rows: torch.Tensor,  # [b, 6] int64; (qlen, start, tok0, tok1, num_draft, guess) a row
                          num_tokens: int,  # tokens of the step, padding included (>= the rows' qlen sum)
                          input_ids: torch.Tensor,  # [>= num_tokens] int64
                          positions: torch.Tensor,  # [>= num_tokens] int64
                          seq_lens: torch.Tensor,  # [>= b] int32
                          query_start_loc: torch.Tensor,  # [>= b + 1] int32
                          logits_indices: torch.Tensor,  # [>= b] int64
                          block_tables: torch.Tensor,  # [num_groups, >= b, max_blocks] int32; read
                          slot_mappings: torch.Tensor,  # [num_groups, >= num_tokens] int64
                          num_draft: torch.Tensor,  # [>= b] int64
                          guess: torch.Tensor,  # [>= b] int64
                          step_idx: torch.Tensor,  # [1] int64; set to 0
                          block_size: int) -> None:
    """Write the inputs of a step of one or two tokens a request (each with one logits row) in place."""
    args = (rows, input_ids, positions, seq_lens, query_start_loc, logits_indices, block_tables, slot_mappings,
            num_draft, guess, step_idx)
    require_triton("build_catch_up_inputs", *args)
    b = _check_args(rows, num_tokens, input_ids, block_tables, slot_mappings)
    _catch_up_kernel[(1,)](*args, b, num_tokens, block_tables.shape[2], block_tables.stride(0),
                           block_tables.stride(1), slot_mappings.stride(0), NUM_GROUPS=block_tables.shape[0],
                           BLOCK_SIZE=block_size, ROWS_P=max(16, triton.next_power_of_2(b)),
                           TOKENS_P=max(16, triton.next_power_of_2(num_tokens)), num_warps=1 if b <= 64 else 4)


def build_catch_up_inputs_ref(rows: torch.Tensor, num_tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, logits_indices: torch.Tensor,
                              block_tables: torch.Tensor, slot_mappings: torch.Tensor, num_draft: torch.Tensor,
                              guess: torch.Tensor, step_idx: torch.Tensor, block_size: int) -> None:
    """Plain-torch reference of `build_catch_up_inputs` (same arguments)."""
    b = _check_args(rows, num_tokens, input_ids, block_tables, slot_mappings)
    qlen, start, tok0, tok1, nd, gs = rows.unbind(1)  # each [b] int64
    ends = qlen.cumsum(0)
    num_draft[:b] = nd
    guess[:b] = gs
    query_start_loc[0] = 0
    query_start_loc[1:b + 1] = ends.to(torch.int32)
    real = qlen > 0
    seq_lens[:b] = torch.where(real, start + qlen, 0).to(torch.int32)
    logits_indices[:b] = torch.where(real, ends - 1, 0)
    input_ids[:num_tokens] = 0
    positions[:num_tokens] = 0
    slot_mappings[:, :num_tokens] = -1
    for s, tok in enumerate((tok0, tok1)):
        has = qlen > s  # [b] bool
        dst, pos = (ends - qlen + s)[has], (start + s)[has]
        input_ids[dst] = tok[has]
        positions[dst] = pos
        idx = (pos // block_size).clamp(max=block_tables.shape[2] - 1)
        for g in range(block_tables.shape[0]):
            blk = block_tables[g, :b][has].gather(1, idx[:, None]).squeeze(1).to(torch.int64)
            slot_mappings[g, dst] = blk * block_size + pos % block_size
    step_idx.zero_()


def _check_args(rows: torch.Tensor, num_tokens: int, input_ids: torch.Tensor, block_tables: torch.Tensor,
                slot_mappings: torch.Tensor) -> int:
    if rows.dim() != 2 or rows.shape[1] != ROW_FIELDS or not rows.is_contiguous() or rows.dtype != torch.int64:
        raise ValueError(f"rows must be a contiguous [b, {ROW_FIELDS}] int64 tensor, got {tuple(rows.shape)} "
                         f"{rows.dtype}")
    b = int(rows.shape[0])
    if not 0 < num_tokens <= min(input_ids.shape[0], slot_mappings.shape[1]) or num_tokens > MAX_CATCH_UP * b:
        raise ValueError(f"num_tokens {num_tokens} does not fit {b} rows of at most {MAX_CATCH_UP} tokens or the "
                         f"buffers ({input_ids.shape[0]} tokens)")
    if (block_tables.dim() != 3 or slot_mappings.dim() != 2 or block_tables.shape[0] != slot_mappings.shape[0]
            or block_tables.shape[1] < b or block_tables.stride(2) != 1 or slot_mappings.stride(1) != 1):
        raise ValueError("block_tables must be [num_groups, >= b rows, blocks] and slot_mappings [num_groups, "
                         "tokens], contiguous in the last dimension, "
                         f"got {tuple(block_tables.shape)} and {tuple(slot_mappings.shape)}")
    return b
