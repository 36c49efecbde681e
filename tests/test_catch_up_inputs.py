"""A draft loop's first step built on the device (engine/kernels/catch_up_inputs.py) against the host's
`InputBuffers.load`, the oracle for what a step's inputs must hold: steps of one and two tokens a request, padded
rows and tokens, a full-attention and a sliding-window KV-cache group, block boundaries, and block tables that
change, stay or are overwritten between steps (the device copy of a row is skipped only when it is unchanged). The
torch reference runs here; the Triton kernel under the interpreter (tests/test_fused_kernels.py's child) and on CUDA
(tests/gpu/test_fused_kernels_cuda.py). The draft loop's own use of it is checked end to end against HF by the draft
loop tests (tests/test_kernel_path.py, tests/gpu/test_fast_path_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from test_input_buffers import GROUPS, chunk

from engine.kernels.catch_up_inputs import ROW_FIELDS, build_catch_up_inputs, build_catch_up_inputs_ref
from engine.runner.input_buffers import InputBuffers
from engine.runner.step_input import Chunk

BLOCK = GROUPS[0].spec.block_size

# (chunks, padded rows, padded tokens or None for the real count): after a rejection (one token each), after a fully
# accepted window (two, one crossing a block boundary), mixed, the same tables again, and a slot reused by another
# request with a grown table.
STEPS = [
    ([chunk([5], 9, 1, 10)], 1, None),
    ([chunk([5], 9, 1, 10), chunk([6, 7], 3, 1, 20)], 4, 8),
    ([chunk([8, 9], 10, 1, 10), chunk([1], 7, 1, 20), chunk([2], 0, 1, 30)], 4, 4),
    ([chunk([8, 9], 10, 1, 10), chunk([1], 7, 1, 20), chunk([2], 0, 1, 30)], 4, 8),
    ([chunk([3, 4], 15, 1, 40), chunk([7], 12, 1, 10)], 2, None),
]


def _buffers(device: str) -> InputBuffers:
    bufs = InputBuffers(GROUPS, max_num_reqs=8, max_num_tokens=16, max_model_len=64, device=torch.device(device))
    # Earlier steps' leftovers everywhere, the same in both: what a step does not write must match too.
    g = torch.Generator().manual_seed(3)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mappings", "logits_indices"):
        t = getattr(bufs, name)
        t.copy_(torch.randint(0, 50, t.shape, generator=g).to(t.dtype))
    return bufs


def _rows(chunks: list[Chunk], ks: list[int], guesses: list[int], b: int, device: str) -> torch.Tensor:
    rows = torch.zeros(b, ROW_FIELDS, dtype=torch.int64)
    for i, (c, k, gs) in enumerate(zip(chunks, ks, guesses)):
        rows[i] = torch.tensor([len(c.token_ids), c.start_pos, c.token_ids[0], c.token_ids[-1], k, gs])
    return rows.to(device)


def check_catch_up_inputs(device: str, kernel: bool) -> None:
    """Each step of STEPS into two sets of buffers, by `load` and by the device build; every buffer equal after it,
    and the draft counts, guess modes and step index written."""
    build = build_catch_up_inputs if kernel else build_catch_up_inputs_ref
    oracle, built = _buffers(device), _buffers(device)
    num_draft = torch.full((8,), 9, dtype=torch.int64, device=device)
    guess, step_idx = num_draft.clone(), torch.tensor([3], device=device)
    for s, (chunks, b, t) in enumerate(STEPS):
        t = t or sum(len(c.token_ids) for c in chunks)
        oracle.load(chunks, num_reqs=b, num_tokens=t, max_query_len=max(len(c.token_ids) for c in chunks),
                    num_logits_padded=b)
        built.load_block_tables(chunks, b)
        ks, guesses = [1 + (i + s) % 4 for i in range(len(chunks))], [i % 3 for i in range(len(chunks))]
        before = num_draft.clone(), guess.clone()
        build(_rows(chunks, ks, guesses, b, device), t, built.input_ids, built.positions, built.seq_lens,
              built.query_start_loc, built.logits_indices, built.block_tables, built.slot_mappings, num_draft, guess,
              step_idx, BLOCK)
        for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mappings", "logits_indices",
                     "block_tables"):
            assert torch.equal(getattr(built, name), getattr(oracle, name)), (s, name)
        n = len(chunks)
        assert num_draft[:n].tolist() == ks and not num_draft[n:b].any() and torch.equal(num_draft[b:], before[0][b:])
        assert guess[:n].tolist() == guesses and not guess[n:b].any() and torch.equal(guess[b:], before[1][b:])
        assert int(step_idx) == 0
        step_idx.fill_(3)
        if s == 2:
            # Another step (a prefill chunk in slot 0) rewrites the rows; the next catch-up must copy them again.
            for bufs in (oracle, built):
                bufs.load([chunk(list(range(6)), 0, 1, 50)], num_reqs=1)


def test_device_built_first_step_equals_load():
    check_catch_up_inputs("cpu", kernel=False)


def test_unchanged_block_tables_are_not_copied_again():
    bufs = _buffers("cpu")
    chunks = [chunk([5], 9, 1, 10)]
    bufs.load_block_tables(chunks, 2)
    bufs.block_tables[0, 0, 0] = 77  # a row the device holds already is not rewritten by the same tables ...
    bufs.load_block_tables(chunks, 2)
    assert int(bufs.block_tables[0, 0, 0]) == 77
    bufs.load_block_tables([chunk([5, 6], 12, 1, 10)], 2)  # ... but is as soon as a row changes (a new block)
    assert int(bufs.block_tables[0, 0, 0]) == 10


def test_catch_up_rejects_bad_input():
    bufs = _buffers("cpu")
    with pytest.raises(RuntimeError, match="released or unallocated"):
        bufs.load_block_tables([Chunk([5], 9, 1, [[1, 2], [3, 4]])], 1)  # position 9 is past the table's 2 blocks
    with pytest.raises(ValueError, match="do not fit the input buffers"):
        bufs.load_block_tables([chunk([5], 9, 1, 10)] * 9, 9)
    args = (bufs.input_ids, bufs.positions, bufs.seq_lens, bufs.query_start_loc, bufs.logits_indices,
            bufs.block_tables, bufs.slot_mappings, torch.zeros(8, dtype=torch.int64),
            torch.zeros(8, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), BLOCK)
    with pytest.raises(ValueError, match="num_tokens 3 does not fit 1 rows"):
        build_catch_up_inputs_ref(torch.zeros(1, ROW_FIELDS, dtype=torch.int64), 3, *args)
    with pytest.raises(ValueError, match="rows must be"):
        build_catch_up_inputs_ref(torch.zeros(1, 5, dtype=torch.int64), 1, *args)
