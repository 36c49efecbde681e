"""The kernel path's input buffers against the torch path's metadata builder (build_step_input), the oracle for what a
step's flat inputs must hold: token ids, positions, query layout, KV lengths, slots of every KV-cache group and logits
rows, with graph padding after the real requests and tokens. The buffers reuse one view object per step shape, so a
second step of the same shape must show its own contents, never the first's."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.block_pool import NULL_BLOCK
from engine.kv_cache.spec import AttentionSpec, group_layers
from engine.runner.input_buffers import InputBuffers
from engine.runner.step_input import Chunk, build_step_input

BLOCK = 4
# A full-attention group and a sliding-window group (two layers each), as in Gemma 3.
GROUPS = group_layers([AttentionSpec(2, 8, torch.float32, BLOCK, w) for w in (None, 6, None, 6)])


def chunk(tokens: list[int], start: int, num_logits: int, first_block: int) -> Chunk:
    blocks = -(-(start + len(tokens)) // BLOCK)
    # Group 1 released the blocks that left its window: they are null, as the KV manager leaves them.
    released = max(0, (start - 6) // BLOCK)
    return Chunk(tokens, start, num_logits, [list(range(first_block, first_block + blocks)),
                                             [NULL_BLOCK] * released + list(range(50 + first_block + released,
                                                                                 50 + first_block + blocks))])


STEPS = [
    # a prefill chunk mid-sequence (no logits), a plain decode, a verify of 3 drafts crossing a block boundary
    [chunk(list(range(10, 17)), 5, 0, 1), chunk([3], 9, 1, 10), chunk([4, 5, 6, 7], 6, 4, 20)],
    [chunk([8], 12, 1, 30)],
    [chunk([9, 1], 0, 2, 2), chunk([2], 3, 1, 12)],
]


def check(buffers: InputBuffers, chunks: list[Chunk], r: int, t: int) -> None:
    step = buffers.load(chunks, num_reqs=r, num_tokens=t, num_logits_padded=t)
    ref = build_step_input(chunks, GROUPS, torch.device("cpu"))
    n, tr = len(chunks), ref.num_tokens
    assert step.input_ids[:tr].tolist() == ref.input_ids.tolist() and not step.input_ids[tr:].any()
    assert step.positions[:tr].tolist() == ref.positions.tolist()
    common = step.attn.common
    assert common.query_start_loc[:n + 1].tolist() == ref.attn.common.query_start_loc.tolist()
    assert common.query_start_loc[n + 1:].eq(tr).all()  # padding requests have no query tokens
    assert common.seq_lens[:n].tolist() == ref.attn.common.seq_lens.tolist() and not common.seq_lens[n:].any()
    assert common.max_seq_len == ref.attn.common.max_seq_len
    for got, want in zip(step.attn.groups, ref.attn.groups, strict=True):
        assert got.slot_mapping[:tr].tolist() == want.slot_mapping.tolist()
        assert got.slot_mapping[tr:].eq(-1).all()  # padding tokens write nowhere
        for i, c in enumerate(chunks):
            row = c.block_tables[got.group_id]
            assert got.block_table[i, :len(row)].tolist() == row and got.block_table[i, len(row):].eq(NULL_BLOCK).all()
    nl = len(ref.logits_indices)
    assert step.logits_indices[:nl].tolist() == ref.logits_indices.tolist()
    assert step.num_logits_per_req == ref.num_logits_per_req


@pytest.mark.parametrize("pad", [0, 2])
def test_buffers_hold_what_the_torch_path_builds(pad):
    buffers = InputBuffers(GROUPS, max_num_reqs=8, max_num_tokens=32, max_model_len=64, device=torch.device("cpu"))
    for chunks in STEPS:
        check(buffers, chunks, len(chunks) + pad, sum(len(c.token_ids) for c in chunks) + 3 * pad)


def test_a_reused_step_view_shows_the_latest_step():
    buffers = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=16, max_model_len=64, device=torch.device("cpu"))
    first = buffers.load([chunk([5], 3, 1, 1)], num_reqs=2, num_tokens=2, max_query_len=1, num_logits_padded=2)
    ids, max_seq = first.input_ids.tolist(), first.attn.common.max_seq_len
    second = buffers.load([chunk([6], 20, 1, 7)], num_reqs=2, num_tokens=2, max_query_len=1, num_logits_padded=2)
    assert second is first  # same shape: the same views of the same buffers
    assert (ids, max_seq) == ([5, 0], 4) and second.input_ids.tolist() == [6, 0]
    assert second.attn.common.max_seq_len == 21 and second.positions[0] == 20
    other = buffers.load([chunk([6], 20, 1, 7)], num_reqs=1, num_tokens=1, max_query_len=1, num_logits_padded=1)
    assert other is not first and other.input_ids.shape == (1,)


def test_a_token_in_a_released_block_is_refused():
    buffers = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=16, max_model_len=64, device=torch.device("cpu"))
    bad = Chunk([1], 9, 1, [[1, 2, 3], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]])
    with pytest.raises(RuntimeError, match="released or unallocated block in group 1"):
        buffers.load([bad])
