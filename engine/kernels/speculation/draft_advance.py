"""The draft loop's rebuild of its next step's inputs in one kernel (Triton kernel + typed wrapper + torch reference).

After a draft step samples token t for every row, the next step feeds t at the following position: the row's
input id, position, KV length, query layout, logits row and, for EVERY KV-cache group, the slot of the new token,
looked up in that group's block table (the position may open a new block). The step index (the column of the
output buffer this step writes) lives on the device, so k graph replays need no host work between them.

Rows whose drafts are done (step_idx + 1 >= num_draft) and padding rows feed token 0 at position 0 with slot -1:
they still run, read only position 0, and write nowhere. In torch this is about 16 + 8 per group small kernels
per draft step; here one.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import require_triton, tl, triton

__all__ = ["advance_draft_inputs", "advance_draft_inputs_ref"]


@triton.jit
def _advance_kernel(tok_ptr, ids_ptr, step_ptr, num_draft_ptr, input_ids_ptr, positions_ptr, seq_lens_ptr,
                    qsl_ptr, logits_idx_ptr, block_tables_ptr, slots_ptr, num_rows, stride_ids,
                    stride_bt_group, stride_bt_row, stride_slot_group,
                    NUM_GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS_P: tl.constexpr):
    rows = tl.arange(0, ROWS_P)
    live = rows < num_rows
    j = tl.load(step_ptr)
    tok = tl.load(tok_ptr + rows, mask=live, other=0)
    tl.store(ids_ptr + rows * stride_ids + j, tok, mask=live)
    valid = (j + 1 < tl.load(num_draft_ptr + rows, mask=live, other=0)) & live
    pos = tl.where(valid, tl.load(seq_lens_ptr + rows, mask=live, other=0).to(tl.int64), 0)
    tl.store(input_ids_ptr + rows, tl.where(valid, tok, 0), mask=live)
    tl.store(positions_ptr + rows, pos, mask=live)
    tl.store(seq_lens_ptr + rows, (pos + 1).to(tl.int32), mask=live)
    tl.store(qsl_ptr + rows + 1, (rows + 1).to(tl.int32), mask=live)
    tl.store(qsl_ptr, 0)
    tl.store(logits_idx_ptr + rows, rows.to(tl.int64), mask=live)
    for g in tl.static_range(NUM_GROUPS):
        blk = tl.load(block_tables_ptr + g * stride_bt_group + rows * stride_bt_row + pos // BLOCK_SIZE,
                      mask=live, other=0).to(tl.int64)
        tl.store(slots_ptr + g * stride_slot_group + rows, tl.where(valid, blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1),
                 mask=live)
    # Every lane has read the step index above before it moves on.
    tl.debug_barrier()
    tl.store(step_ptr, j + 1)


def advance_draft_inputs(tok: torch.Tensor,  # [b] int64; this step's sampled tokens
                         ids: torch.Tensor,  # [>= b, max_k] int64; column step_idx receives tok
                         step_idx: torch.Tensor,  # [1] int64; incremented
                         num_draft: torch.Tensor,  # [>= b] int64; drafts per row
                         input_ids: torch.Tensor,  # [>= b] int64
                         positions: torch.Tensor,  # [>= b] int64
                         seq_lens: torch.Tensor,  # [>= b] int32; read as the new token's position, then + 1
                         query_start_loc: torch.Tensor,  # [>= b + 1] int32
                         logits_indices: torch.Tensor,  # [>= b] int64
                         block_tables: torch.Tensor,  # [num_groups, >= b, max_blocks] int32
                         slot_mappings: torch.Tensor,  # [num_groups, >= tokens] int64
                         block_size: int) -> None:
    """Write tok at column step_idx of ids and the next draft step's inputs for rows 0..b-1, in place."""
    require_triton("advance_draft_inputs", tok, ids, step_idx, num_draft, input_ids, positions, seq_lens,
                   query_start_loc, logits_indices, block_tables, slot_mappings)
    b = _check_args(tok, ids, block_tables, slot_mappings)
    _advance_kernel[(1,)](tok, ids, step_idx, num_draft, input_ids, positions, seq_lens, query_start_loc,
                          logits_indices, block_tables, slot_mappings, b, ids.stride(0), block_tables.stride(0),
                          block_tables.stride(1), slot_mappings.stride(0), NUM_GROUPS=block_tables.shape[0],
                          BLOCK_SIZE=block_size, ROWS_P=max(16, triton.next_power_of_2(b)),
                          num_warps=1 if b <= 64 else 4)


def advance_draft_inputs_ref(tok: torch.Tensor, ids: torch.Tensor, step_idx: torch.Tensor, num_draft: torch.Tensor,
                             input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, logits_indices: torch.Tensor,
                             block_tables: torch.Tensor, slot_mappings: torch.Tensor, block_size: int) -> None:
    """Plain-torch reference of `advance_draft_inputs` (same arguments)."""
    b = _check_args(tok, ids, block_tables, slot_mappings)
    j = step_idx
    ids[:b].index_copy_(1, j, tok.unsqueeze(1))
    valid = j + 1 < num_draft[:b]  # [b] bool: this row feeds its token to a next step
    pos = torch.where(valid, seq_lens[:b].to(torch.int64), 0)  # the new token's position
    input_ids[:b] = torch.where(valid, tok, 0)
    positions[:b] = pos
    seq_lens[:b] = (pos + 1).to(torch.int32)
    arange = torch.arange(b + 1, device=tok.device)
    query_start_loc[:b + 1] = arange.to(torch.int32)
    logits_indices[:b] = arange[:b]
    for g in range(block_tables.shape[0]):
        blk = block_tables[g, :b].gather(1, (pos // block_size)[:, None]).squeeze(1).to(torch.int64)
        slot_mappings[g, :b] = torch.where(valid, blk * block_size + pos % block_size, -1)
    step_idx.add_(1)


def _check_args(tok: torch.Tensor, ids: torch.Tensor, block_tables: torch.Tensor, slot_mappings: torch.Tensor) -> int:
    if tok.dim() != 1 or ids.dim() != 2 or ids.shape[0] < tok.shape[0] or ids.stride(1) != 1:
        raise ValueError(f"tok must be [b] and ids [>= b, max_k] (contiguous rows), got {tuple(tok.shape)} and "
                         f"{tuple(ids.shape)}")
    if (block_tables.dim() != 3 or slot_mappings.dim() != 2 or block_tables.shape[0] != slot_mappings.shape[0]
            or block_tables.stride(2) != 1 or slot_mappings.stride(1) != 1):
        raise ValueError("block_tables must be [num_groups, rows, blocks] and slot_mappings [num_groups, tokens], "
                         "contiguous in the last dimension, "
                         f"got {tuple(block_tables.shape)} and {tuple(slot_mappings.shape)}")
    return int(tok.shape[0])
