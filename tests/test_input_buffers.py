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


@pytest.fixture(params=["python", "numpy"])
def fill(request, monkeypatch):
    """Every step through one staging form: plain Python (`_fill_few`) or NumPy passes (`_fill_many`)."""
    monkeypatch.setattr(InputBuffers, "few_tokens", 10 ** 9 if request.param == "python" else -1)
    return request.param


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
def test_buffers_hold_what_the_torch_path_builds(pad, fill):
    buffers = InputBuffers(GROUPS, max_num_reqs=8, max_num_tokens=32, max_model_len=64, device=torch.device("cpu"))
    for chunks in STEPS:
        check(buffers, chunks, len(chunks) + pad, sum(len(c.token_ids) for c in chunks) + 3 * pad)


def test_a_reused_step_view_shows_the_latest_step(fill):
    buffers = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=16, max_model_len=64, device=torch.device("cpu"))
    first = buffers.load([chunk([5], 3, 1, 1)], num_reqs=2, num_tokens=2, max_query_len=1, num_logits_padded=2)
    ids, max_seq = first.input_ids.tolist(), first.attn.common.max_seq_len
    second = buffers.load([chunk([6], 20, 1, 7)], num_reqs=2, num_tokens=2, max_query_len=1, num_logits_padded=2)
    assert second is first  # same shape: the same views of the same buffers
    assert (ids, max_seq) == ([5, 0], 4) and second.input_ids.tolist() == [6, 0]
    assert second.attn.common.max_seq_len == 21 and second.positions[0] == 20
    other = buffers.load([chunk([6], 20, 1, 7)], num_reqs=1, num_tokens=1, max_query_len=1, num_logits_padded=1)
    assert other is not first and other.input_ids.shape == (1,)


def test_a_token_in_a_released_block_is_refused(fill):
    buffers = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=16, max_model_len=64, device=torch.device("cpu"))
    bad = Chunk([1], 9, 1, [[1, 2, 3], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]])
    with pytest.raises(RuntimeError, match="released or unallocated block in group 1"):
        buffers.load([bad])
    past_table = Chunk([1, 2], 11, 1, [[1, 2, 3], [4, 5, 6]])  # position 12 needs a fourth block
    with pytest.raises(RuntimeError, match="released or unallocated block in group 0"):
        buffers.load([past_table])
    with pytest.raises(ValueError, match="num_logits"):
        buffers.load([Chunk([1], 3, 2, [[1], [2]])])
    good = buffers.load([chunk([5], 3, 1, 1)])  # a refused step leaves nothing behind that the next one reads
    assert good.input_ids.tolist() == [5] and good.attn.groups[0].slot_mapping.tolist() == [1 * BLOCK + 3]


def test_both_staging_forms_write_the_same_bytes():
    """Random steps (1-6 requests of 1-9 tokens, 0 to all logits rows, padding rows and tokens) loaded through the
    Python and the NumPy form into two buffers: every staged tensor equal after every step."""
    import random

    rng = random.Random(1)
    pair = [InputBuffers(GROUPS, max_num_reqs=8, max_num_tokens=64, max_model_len=64, device=torch.device("cpu"))
            for _ in range(2)]
    for _ in range(60):
        chunks = []
        for _ in range(rng.randint(1, 6)):
            q = rng.randint(1, 9)
            chunks.append(chunk(list(rng.sample(range(1000), q)), rng.randint(0, 40), rng.randint(0, q),
                                rng.randint(1, 30)))
        r, t = len(chunks) + rng.randint(0, 2), sum(len(c.token_ids) for c in chunks) + rng.randint(0, 3)
        steps = []
        for buffers, few in zip(pair, (10 ** 9, -1)):
            buffers.few_tokens = few
            steps.append(buffers.load(chunks, num_reqs=r, num_tokens=t, num_logits_padded=t))
        for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mappings",
                     "logits_indices"):
            assert torch.equal(getattr(pair[0], name), getattr(pair[1], name)), name
        a, b = steps
        assert (a.attn.common.max_query_len, a.attn.common.max_seq_len, a.num_logits_per_req) == (
            b.attn.common.max_query_len, b.attn.common.max_seq_len, b.num_logits_per_req)


def test_padding_step_of_a_mixed_graph_reads_nothing_and_writes_nothing(fill):
    """What mixed-batch graphs are captured with (and the kernel warm-up runs): requests holding no token, so no
    block table entry is read even where the longest query exceeds max_model_len, no slot written, every logits row
    on token 0; a real step loaded after it shows its own contents."""
    buffers = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=128, max_model_len=16, device=torch.device("cpu"))
    step = buffers.load_padding(4, 100, 100, 8)
    common = step.attn.common
    assert common.query_start_loc.tolist() == [0, 0, 0, 0, 0]
    assert common.seq_lens.tolist() == [0, 0, 0, 0]
    assert common.max_query_len == 100 and step.input_ids.shape == (100,)
    assert step.logits_indices.tolist() == [0] * 8
    for g in step.attn.groups:
        assert (g.slot_mapping == -1).all() and (g.block_table == NULL_BLOCK).all()
    small = InputBuffers(GROUPS, max_num_reqs=4, max_num_tokens=32, max_model_len=64, device=torch.device("cpu"))
    small.load_padding(4, 16, 16, 8)
    check(small, STEPS[0], 4, 16)


def test_mixed_graph_bucket_choice():
    """Uniform graphs first; a step with a prefill chunk takes the smallest mixed token bucket that holds it, and
    runs eagerly past the largest, past the batch bucket, or with more logits rows per request than captured."""
    from engine.runner.cuda_graphs import ForwardGraphs

    buffers = InputBuffers(GROUPS, max_num_reqs=8, max_num_tokens=256, max_model_len=64, device=torch.device("cpu"))
    graphs = ForwardGraphs(buffers, lambda s: s.input_ids, [1, 4, 8], [1, 4], pool=None,  # type: ignore[arg-type]
                           gathered=lambda s: s.input_ids, mixed_token_sizes=[32, 128, 512])
    assert graphs.mixed_token_sizes == [32, 128]  # 512 does not fit the buffers
    graphs.graphs = {"captured": None}  # bucket() only asks whether any graph was captured
    decode = [chunk([1], 5, 1, 1)] * 3
    prefill = chunk(list(range(40)), 0, 1, 1)
    assert graphs.bucket(decode) == (4, 1)
    assert graphs.bucket([prefill] + decode) == (8, 128, 128)
    assert graphs.bucket([chunk(list(range(20)), 0, 0, 1)] + decode) == (8, 32, 32)
    assert graphs.bucket([chunk(list(range(200)), 0, 1, 1)]) is None  # past the largest bucket
    assert graphs.bucket([prefill] * 9) is None  # past the batch bucket
    assert graphs.bucket([chunk(list(range(10)), 0, 5, 1)]) is None  # 5 logits rows > the 4 captured per request
    step = graphs.load([prefill] + decode, (8, 128, 128))
    assert step.input_ids.shape == (128,) and step.logits_indices.shape == (32,)
    assert step.logits_indices[:4].tolist() == [39, 40, 41, 42]


def test_block_tables_written_incrementally_match_a_fresh_build(fill):
    """The staging rows keep each slot's block table across steps and write only what changed: after every step of a
    random sequence (tables growing in place, requests changing slots, a slot taken by a request with a shorter table,
    preemption and resume with new blocks, a sliding-window group releasing blocks, padding rows, padding-only steps
    in between) the uploaded tables and slots must equal those of buffers that never saw an earlier step."""
    import random

    rng = random.Random(0)
    max_len = 64
    buffers = InputBuffers(GROUPS, max_num_reqs=6, max_num_tokens=32, max_model_len=max_len, device=torch.device("cpu"))
    next_block = iter(range(1, 10_000))
    tables: dict[int, list[list[int]]] = {}  # request -> [group][blocks], changed in place as a KV manager does

    def grow(rid: int, n: int) -> None:
        t = tables.setdefault(rid, [[], []])
        for _ in range(n):
            for g in t:
                g.append(next(next_block))
        t[1][:max(0, len(t[1]) - 2)] = [NULL_BLOCK] * max(0, len(t[1]) - 2)  # the window keeps the last 2 blocks

    active: list[int] = []
    for step in range(80):
        if step % 17 == 16:
            # A padding-only step nulls the rows; then the last step again, unchanged, must write them back.
            buffers.load_padding(4, 8, 2, 4) if step % 2 else buffers.load_dummy(3, 2)
        else:
            active = rng.sample(range(8), rng.randint(1, 4))  # a new order every step: requests change slots
        for rid in active if step % 17 != 16 else []:
            if rid not in tables or len(tables[rid][0]) >= max_len // BLOCK or rng.random() < 0.1:
                tables.pop(rid, None)  # preempted (or new): resumes with fresh, fewer blocks
                grow(rid, rng.randint(1, 3))
            else:
                grow(rid, rng.choice([0, 0, 1]))
        chunks = [Chunk([rid], len(tables[rid][0]) * BLOCK - 1, 1, tables[rid]) for rid in active]
        r = len(chunks) + rng.randint(0, 2)
        step_in = buffers.load(chunks, num_reqs=r, num_tokens=r, max_query_len=1)
        fresh = InputBuffers(GROUPS, max_num_reqs=6, max_num_tokens=32, max_model_len=max_len,
                             device=torch.device("cpu"))
        want = fresh.load(chunks, num_reqs=r, num_tokens=r, max_query_len=1)
        for got_g, want_g in zip(step_in.attn.groups, want.attn.groups, strict=True):  # padding rows included
            assert torch.equal(got_g.block_table, want_g.block_table), f"step {step}, group {got_g.group_id}"
            assert torch.equal(got_g.slot_mapping, want_g.slot_mapping), f"step {step}, group {got_g.group_id}"
