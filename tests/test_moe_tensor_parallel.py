"""MoE experts split across tensor-parallel ranks (engine/models/moe.py): each rank holds every expert's slice of the
intermediate features, loaded from the whole checkpoint tensors in each layout the loader hands over (GPT-OSS's
fused [E, in, out] and its MXFP4 blocks, split at whole blocks, unevenly where the blocks do not divide; Qwen3-MoE's
per-expert Linear weights and a fused [E, 2I, H]); the ranks' outputs summed equal the unsplit layer's. In one
process, each rank's layer built under its own group (the sum is what the layer's all-reduce computes); the whole
model over two real ranks is in tests/test_ray_executor.py."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.moe.router import route_topk_then_softmax
from engine.models.moe import FusedExperts, experts_ref, sort_by_expert
from engine.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from engine.quantization import mxfp4

E, H = 4, 64


def _full(activation: str, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole weights in this module's layout (out x in), GPT-OSS's gate and up interleaved."""
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": torch.randn(E, 2 * i, H, generator=g), "down_proj": torch.randn(E, H, i, generator=g),
            "gate_up_proj_bias": torch.randn(E, 2 * i, generator=g), "down_proj_bias": torch.randn(E, H, generator=g)}


def _build(rank: int, size: int, activation: str, i: int, layout: str, full: dict[str, torch.Tensor]
           ) -> FusedExperts:
    """Rank `rank` of `size`'s layer, loaded the way the loader would hand `layout`'s tensors over."""
    old = get_tp_group()
    set_tp_group(TensorParallelGroup(rank=rank, size=size))
    try:
        oai = activation == "swiglu_oai"
        ex = FusedExperts(E, H, i, bias=oai, activation=activation, packed=layout == "packed",
                          in_by_out=layout == "in_by_out")
    finally:
        set_tp_group(old)
    params = dict(ex.named_parameters())
    if layout == "packed":
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = mxfp4.quantize(full[name])
            ex.weight_loader(params[f"{name}_blocks"], blocks)
            ex.weight_loader(params[f"{name}_scales"], scales)
    elif layout == "in_by_out":
        for name in ("gate_up_proj", "down_proj"):
            ex.weight_loader(params[name], full[name].transpose(1, 2).contiguous())
    elif layout == "per_expert":  # Qwen3-MoE's checkpoint: (expert, 0 gate | 1 up | 2 down)
        for x in range(E):
            gate, up = full["gate_up_proj"][x].chunk(2)
            for part, w in ((0, gate), (1, up), (2, full["down_proj"][x])):
                ex.weight_loader(params["gate_up_proj" if part < 2 else "down_proj"], w.clone(), (x, part))
    else:  # "fused": whole [E, 2I, H] and [E, H, I]
        for name in ("gate_up_proj", "down_proj"):
            ex.weight_loader(params[name], full[name])
    if oai:
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            ex.weight_loader(params[name], full[name])
    return ex


@pytest.mark.parametrize("activation,layout,i,size,held", [
    ("swiglu_oai", "packed", 96, 2, [32, 64]),  # three MXFP4 blocks over two ranks
    ("swiglu_oai", "packed", 160, 4, [32, 32, 32, 64]),  # gpt-oss's 2880 = 90 blocks over 4 splits this way too
    ("swiglu_oai", "in_by_out", 96, 2, [48, 48]),
    ("silu", "per_expert", 48, 2, [24, 24]),
    ("silu", "fused", 48, 3, [16, 16, 16]),
])
def test_ranks_slices_sum_to_the_whole_layer(activation, layout, i, size, held):
    full = _full(activation, i)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, H, generator=g)
    weights, ids = route_topk_then_softmax(torch.randn(9, E, generator=g), 2)
    rows = sort_by_expert(weights, ids, E)
    whole = experts_ref(_build(0, 1, activation, i, layout, full), x, rows)
    ranks = [_build(r, size, activation, i, layout, full) for r in range(size)]
    assert [ex.intermediate_size for ex in ranks] == held
    parts = [experts_ref(ex, x, rows) for ex in ranks]
    torch.testing.assert_close(sum(parts), whole, atol=1e-4, rtol=1e-4)
    # Each rank's part is its own (no rank computes the whole layer), and the down bias is added once.
    assert all((p - whole).abs().max() > 1e-2 for p in parts)


def test_a_split_finer_than_the_blocks_is_refused():
    old = get_tp_group()
    set_tp_group(TensorParallelGroup(rank=0, size=2))
    try:
        with pytest.raises(ValueError, match="cannot be split over 2 tensor-parallel ranks in blocks of 32"):
            FusedExperts(E, H, 32, bias=True, activation="swiglu_oai", packed=True)
    finally:
        set_tp_group(old)
