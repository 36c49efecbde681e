"""The MoE kernels (few rows: engine/kernels/moe/small_m.py; rows grouped by expert: engine/kernels/moe/grouped.py;
the router: engine/kernels/moe/router.py) against the layer's torch reference under Triton's interpreter: both
families' activations and routings, with and without biases, weights in float and MXFP4-packed; and the reference
itself against a per-token loop over each token's experts (HF's reading of the layer)."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by

from engine.kernels.moe import grouped as moe_grouped
from engine.kernels.moe import router as moe_router
from engine.kernels.moe import small_m as moe_small_m
from engine.kernels.moe.router import route_softmax_then_topk, route_topk_then_softmax
from engine.kernels.triton_compat import HAS_TRITON, interpreting
from engine.models.moe import (
    FusedExperts,
    experts_grouped,
    moe_experts_ref,
    sort_by_expert,
)
from engine.quantization import mxfp4

INTERPRETED = interpreting()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process started "
                                                         "by test_moe_kernels_under_interpreter")


def _experts(activation: str, packed: bool, bias: bool, seed: int, e: int = 4, h: int = 64, i: int = 64
             ) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(e, h, i, bias=bias, activation=activation, packed=packed)
    with torch.no_grad():
        gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.5, torch.randn(e, h, i, generator=g) * 0.5
        if packed:
            ex.gate_up_proj_blocks.copy_(mxfp4.quantize(gate_up)[0])
            ex.gate_up_proj_scales.copy_(mxfp4.quantize(gate_up)[1])
            ex.down_proj_blocks.copy_(mxfp4.quantize(down)[0])
            ex.down_proj_scales.copy_(mxfp4.quantize(down)[1])
        else:
            ex.gate_up_proj.copy_(gate_up)
            ex.down_proj.copy_(down)
        if bias:
            ex.gate_up_proj_bias.normal_(0, 1, generator=g)
            ex.down_proj_bias.normal_(0, 1, generator=g)
    return ex


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    weights, ids = route_topk_then_softmax(torch.randn(tokens, experts, generator=g), top_k)
    return x, weights, ids


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="starts the interpreted child")
def test_moe_kernels_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: the packed gpt-oss form (the
    # slowest case) alone, and the other three forms with the rest.
    assert_pytest_children_pass(__file__, split_by("swiglu_oai-True-True"))


@interpreted
@pytest.mark.parametrize("activation,packed,bias", [("swiglu_oai", False, True), ("swiglu_oai", True, True),
                                                     ("silu", False, False), ("silu", True, False)])
def test_moe_kernel_matches_reference(activation, packed, bias):
    ex = _experts(activation, packed, bias, seed=1)
    # A decode, a verify of 5, a batch of draft steps, and one expert a token (the sum over a single pair).
    for tokens, top_k in ((1, 2), (5, 2), (16, 4), (2, 1)):
        x, weights, ids = _routing(tokens, 4, top_k, seed=tokens)
        out = moe_small_m.moe_experts(x, weights, ids, ex)
        ref = moe_experts_ref(x, weights, ids, ex)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # K in slices (the split a decode on a large GPU takes): two and three slices of H = I = 128, one short.
    wide = _experts(activation, packed, bias, seed=1, h=128, i=128)
    g = torch.Generator().manual_seed(7)
    x2 = torch.randn(3, 128, generator=g)
    w2, ids2 = route_topk_then_softmax(torch.randn(3, 4, generator=g), 2)
    for splits in ((2, 3), (3, 2)):
        torch.testing.assert_close(moe_small_m.moe_experts(x2, w2, ids2, wide, num_splits=splits),
                                   moe_experts_ref(x2, w2, ids2, wide), atol=1e-4, rtol=1e-4)
    # Other tilings (benchmarks/gpu_moe.py sweeps them): a K step wider than a slice of the narrow layer, and
    # narrow tiles with several steps a slice.
    for tiles in ({"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2}, {"BLOCK_N": 64, "BLOCK_K": 32, "programs": 8}):
        torch.testing.assert_close(moe_small_m.moe_experts(x2, w2, ids2, wide, tiles=tiles),
                                   moe_experts_ref(x2, w2, ids2, wide), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="BLOCK_K a power of two"):
        moe_small_m.moe_experts(x2, w2, ids2, wide, tiles={"BLOCK_K": 48})
    assert moe_small_m.k_splits(rows=4, n_tiles=90, k=2880) > 1  # a gpt-oss-20b decode is split
    if activation == "swiglu_oai":  # the clamp is active on these rows: a kernel without it would be caught
        ex.limit = 1e9
        assert (moe_experts_ref(x, weights, ids, ex) - ref).abs().max() > 1e-2


@interpreted
@pytest.mark.parametrize("activation,packed,bias", [("swiglu_oai", False, True), ("swiglu_oai", True, True),
                                                     ("silu", False, False), ("silu", True, False)])
def test_grouped_kernel_matches_reference(activation, packed, bias):
    """Rows grouped by expert: one row, an expert's rows past one group of 16, an expert no row picked, and the
    layer's choice of this kernel past moe_small_m's rows."""
    ex = _experts(activation, packed, bias, seed=2, e=6)
    for tokens, top_k in ((1, 2), (9, 2), (40, 4)):
        x, weights, ids = _routing(tokens, 6, top_k, seed=10 + tokens)
        ids = torch.where(ids == 5, torch.full_like(ids, 2), ids)  # expert 5 idle, expert 2 over 16 rows at 40
        out = moe_grouped.moe_experts_grouped(x, weights, ids, ex)
        torch.testing.assert_close(out, moe_experts_ref(x, weights, ids, ex), atol=1e-4, rtol=1e-4)
    assert ids.numel() > moe_small_m.MAX_ROUTED_ROWS
    assert torch.equal(ex(x, weights, ids), out)  # the layer takes the grouped kernel at 160 routed rows
    tiles = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2}  # several K steps and output tiles a call
    torch.testing.assert_close(moe_grouped.moe_experts_grouped(x, weights, ids, ex, tiles=tiles), out, atol=1e-4,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="BLOCK_N a power of two >= 16"):
        moe_grouped.moe_experts_grouped(x, weights, ids, ex, tiles={"BLOCK_N": 8})


@interpreted
@pytest.mark.parametrize("softmax_first,normalize,bias", [(False, False, True), (True, True, False),
                                                          (True, False, True)])
def test_router_kernel_matches_reference(softmax_first, normalize, bias):
    """GPT-OSS's routing (top-k logits, then their softmax) and Qwen3-MoE's (softmax, top-k, renormalised or not):
    the experts in the reference's order and their weights, at the default tiles (a program a block of experts, the
    whole hidden size in one load) and at 8 experts a program walking the hidden size in steps of 64: one program a
    token (8 experts) and several, the last one short (60), a hidden size a step does not divide (200); 24 tokens
    take the tiles of many; and its refusals."""
    g = torch.Generator().manual_seed(3)
    for experts, top_k, hidden, tokens in ((8, 2, 64, 1), (60, 4, 200, 5), (32, 8, 96, 3), (16, 2, 64, 24)):
        x = torch.randn(tokens, hidden, generator=g)
        w = torch.randn(experts, hidden, generator=g)
        b = torch.randn(experts, generator=g) if bias else None
        ref_weights, ref_ids = moe_router.route_ref(x, w, b, top_k, softmax_first, normalize)
        for tiles in (None, {"BLOCK_E": 8, "BLOCK_H": 64}):
            weights, ids = moe_router.route(x, w, b, top_k, softmax_first, normalize, tiles=tiles)
            assert torch.equal(ids, ref_ids), (tiles, ids, ref_ids)
            torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)
    weights, ids = moe_router.route(x, w, b, top_k, softmax_first, normalize)  # the checks below: default tiles
    # A padding row of a captured step holds whatever its buffer held: NaN logits still route to experts that exist.
    x_nan = x.clone()
    x_nan[1] = float("nan")
    _, nan_ids = moe_router.route(x_nan, w, b, top_k, softmax_first, normalize)
    assert bool(((nan_ids >= 0) & (nan_ids < experts)).all()) and torch.equal(nan_ids[0], ids[0]), nan_ids
    # Twice in a row: the token's arrival counter was set back to 0 (else the second call's last program never
    # finishes a token and its outputs are left unwritten).
    again, again_ids = moe_router.route(x, w, b, top_k, softmax_first, normalize)
    assert torch.equal(again_ids, ids) and torch.equal(again, weights)
    with pytest.raises(ValueError, match="do not fit"):
        moe_router.route(x, w[:, :-1], b, top_k, softmax_first, normalize)
    with pytest.raises(ValueError, match=f"top_k {experts + 1} of {experts} experts"):
        moe_router.route(x, w, b, experts + 1, softmax_first, normalize)


def test_rows_aligned_by_expert_in_groups():
    """Every routed row in exactly one slot, in a block of its own expert, in row order within the expert; each
    expert's run padded to whole groups; blocks past the last run unused. A bound from the row count alone."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 7, (23, 3), generator=g)
    ids[ids == 4] = 1  # expert 4 idle
    slot_rows, block_expert = moe_grouped.align_rows(ids, 7, group=4)
    flat = ids.reshape(-1)
    assert block_expert.shape == (18 + 7,) and slot_rows.shape == (4 * 25,)  # cdiv(69, 4) + min(69, 7)
    blocks = slot_rows.view(-1, 4)
    assert sorted(slot_rows[slot_rows >= 0].tolist()) == list(range(69))
    for b, e in enumerate(block_expert.tolist()):
        rows = [r for r in blocks[b].tolist() if r >= 0]
        if e < 0:
            assert not rows
            continue
        assert rows and all(flat[r] == e for r in rows)
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and 4 not in used
    for e in set(used):
        assert [r for b, x in enumerate(block_expert.tolist()) if x == e for r in blocks[b].tolist() if r >= 0] == \
            [r for r in range(69) if flat[r] == e]
        assert used.count(e) == -(-int((flat == e).sum()) // 4)


def test_reference_equals_a_loop_over_each_tokens_experts():
    ex = _experts("silu", packed=True, bias=False, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=g)
    weights, ids = route_softmax_then_topk(torch.randn(9, 4, generator=g), 2, normalize=True)
    ref = moe_experts_ref(x, weights, ids, ex)
    w13 = mxfp4.dequantize(ex.gate_up_proj_blocks, ex.gate_up_proj_scales)  # [E, 2I, H]
    w2 = mxfp4.dequantize(ex.down_proj_blocks, ex.down_proj_scales)  # [E, H, I]
    for t in range(9):
        want = torch.zeros(64)
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(ref[t], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation,packed,bias", [("swiglu_oai", True, True), ("silu", False, False)])
def test_grouped_path_equals_reference(activation, packed, bias):
    """The prefill-sized path (each touched expert once, its rows as one product) against the per-row reference,
    with an expert no token picked (its empty run skipped)."""
    ex = _experts(activation, packed, bias, seed=3, e=6)
    x, weights, ids = _routing(40, 6, 2, seed=4)
    ids = torch.where(ids == 5, torch.full_like(ids, 4), ids)  # expert 5 idle
    rows = sort_by_expert(weights, ids, 6)
    torch.testing.assert_close(experts_grouped(ex, x, rows), moe_experts_ref(x, weights, ids, ex), atol=1e-4, rtol=1e-4)
    # The layer takes it at 80 routed rows where the kernels do not run (under the interpreter they do)
    layer = moe_grouped.moe_experts_grouped if INTERPRETED else experts_grouped
    assert torch.equal(ex(x, weights, ids), layer(x, weights, ids, ex) if INTERPRETED else layer(ex, x, rows))
