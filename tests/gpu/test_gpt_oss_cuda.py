"""GPT-OSS on the GPU: the few-row MoE kernels at gpt-oss-20b's expert shape (float and MXFP4-packed), the router
kernel at gpt-oss-20b's and Qwen3-30B-A3B's router shapes (also replayed in a CUDA graph), and the
sink-aware attention kernels at its head shape against their torch references, then a tiny GPT-OSS (packed and
not) through the engine on CUDA, graphs and eager, alone and with a draft, against HF transformers' greedy output."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyModel, hf_greedy_cuda, random_prompts
from kernel_support import attention_case, check_sink_attention
from moe_support import gpt_oss_config, make_model

from engine import LLM, SamplingParams
from engine.kernels.moe import grouped as moe_grouped
from engine.kernels.moe import router as moe_router
from engine.kernels.moe import small_m as moe_small_m
from engine.kernels.moe.router import route_topk_then_softmax
from engine.kernels.triton_compat import tl, triton
from engine.models.moe import MAX_GRAPH_ROUTED_ROWS, FusedExperts, moe_experts_ref
from engine.quantization import mxfp4

pytestmark = pytest.mark.gpu
# bf16 in and out. The kernel keeps float32 inside; against the reference run in float32 on the same inputs, it
# differs by the rounding of its output to bf16 (2^-8 relative) and summation order.
BF16 = dict(atol=3e-2, rtol=3e-2)


def _experts(packed: bool, e: int = 32, h: int = 2880, i: int = 2880) -> FusedExperts:
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        ex = FusedExperts(e, h, i, bias=True, activation="swiglu_oai", packed=packed).to(torch.bfloat16)
    with torch.no_grad():
        for x in range(e):  # one expert at a time: the whole layer in float32 is 4 GB
            gate_up = torch.randn(2 * i, h, device="cuda", generator=g) * 0.05
            down = torch.randn(h, i, device="cuda", generator=g) * 0.05
            if packed:
                ex.gate_up_proj_blocks[x], ex.gate_up_proj_scales[x] = mxfp4.quantize(gate_up)
                ex.down_proj_blocks[x], ex.down_proj_scales[x] = mxfp4.quantize(down)
            else:
                ex.gate_up_proj[x] = gate_up
                ex.down_proj[x] = down
        ex.gate_up_proj_bias.normal_(0, 0.5, generator=g)
        ex.down_proj_bias.normal_(0, 0.5, generator=g)
    return ex


@triton.jit
def _decode_every_byte(bytes_ptr, out_ptr):
    j = tl.arange(0, 256)
    b = tl.load(bytes_ptr + j)
    lo, hi = moe_small_m._e2m1_ptx(b)
    tl.store(out_ptr + j, lo)
    tl.store(out_ptr + 256 + j, hi)


def test_ptx_decode_of_every_byte():
    """The PTX decode (two codes a register) gives every byte's two e2m1 values / 2 ** 14, bit for bit."""
    every = torch.arange(256, dtype=torch.uint8, device="cuda")
    out = torch.empty(512, device="cuda")
    _decode_every_byte[(1,)](every, out)
    values = torch.tensor(mxfp4.E2M1_VALUES, device="cuda") * 2.0 ** -14
    want = torch.cat([values[every.long() & 15], values[every.long() >> 4]])
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit())


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "bf16"])
def test_moe_kernel_at_gpt_oss_20b_shape(packed):
    ex = _experts(packed)
    g = torch.Generator(device="cuda").manual_seed(1)
    for tokens in (1, 4, 8, 16):  # a decode, a verify of K + 1 = 4, a batch of eight, a verify of eight at K = 1
        x = torch.randn(tokens, 2880, device="cuda", generator=g).to(torch.bfloat16)
        weights, ids = route_topk_then_softmax(torch.randn(tokens, 32, device="cuda", generator=g), 4)
        ref = moe_experts_ref(x.float(), weights, ids, ex)  # bf16 or packed weights, exact in float32
        for ptx in (True, False) if packed else (True,):  # MXFP4 decoded by the PTX (the default) and by Triton
            out = moe_small_m.moe_experts(x, weights, ids, ex, tiles={"ptx": ptx})
            assert out.dtype == x.dtype and torch.isfinite(out).all()
            torch.testing.assert_close(out.float(), ref, **BF16)


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "bf16"])
def test_grouped_moe_kernel_at_gpt_oss_20b_shape(packed):
    """Rows grouped by expert on the tensor cores (bf16 products, float32 sums): a verify of 4 requests at K = 4,
    a batch of 64 decodes, a prefill chunk of 300 tokens (every expert several groups). The activation is rounded to
    bf16 between the products (as HF's bf16 layer does), so an output near zero may miss BF16's elementwise bound:
    the error is bounded against the output's scale, 1%."""
    ex = _experts(packed)
    g = torch.Generator(device="cuda").manual_seed(2)
    for tokens in (20, 64, 300):
        x = torch.randn(tokens, 2880, device="cuda", generator=g).to(torch.bfloat16)
        weights, ids = route_topk_then_softmax(torch.randn(tokens, 32, device="cuda", generator=g), 4)
        ref = moe_experts_ref(x.float(), weights, ids, ex)
        out = moe_grouped.moe_experts_grouped(x, weights, ids, ex)
        assert out.dtype == x.dtype and torch.isfinite(out).all()
        err = (out.float() - ref).abs().max() / ref.abs().max()
        assert err < 1e-2, (tokens, err)
        assert torch.equal(ex(x, weights, ids), out) or tokens * 4 > MAX_GRAPH_ROUTED_ROWS  # the layer's choice


@pytest.mark.parametrize("experts,hidden,top_k,softmax_first", [(32, 2880, 4, False), (128, 2048, 8, True)],
                         ids=["gpt-oss-20b", "qwen3-30b-a3b"])
def test_router_kernel_at_moe_shapes(experts, hidden, top_k, softmax_first):
    """bf16 router products rounded as F.linear's; the experts chosen are the reference's wherever the reference's
    k-th and (k+1)-th values are apart by more than a bf16 rounding (cuBLAS sums in another order), and the weights
    within bf16's rounding; rows of NaN (a captured step's padding) route to experts that exist. In a CUDA graph,
    two replays give the eager result (the arrival counters go back to 0)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(experts, hidden, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    b = None if softmax_first else torch.randn(experts, device="cuda", generator=g).to(torch.bfloat16)
    compared = total = 0
    for tokens in (1, 5, 40, moe_router.MAX_ROUTER_TOKENS):
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
        weights, ids = moe_router.route(x, w, b, top_k, softmax_first, normalize=softmax_first)
        ref_w, ref_ids = moe_router.route_ref(x, w, b, top_k, softmax_first, normalize=softmax_first)
        logits = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        top = logits.topk(top_k + 1, dim=-1).values
        # Each side's logits are within half a bf16 step (2^-8 relative) of the exact ones: the k-th and the next
        # are ordered alike where they are further apart than that twice over, with a margin.
        clear = top[:, -2] - top[:, -1] > 3 * 2.0 ** -8 * top.abs().max(dim=-1).values
        compared, total = compared + int(clear.sum()), total + tokens
        mine, order = ids.sort(dim=-1)
        theirs, ref_order = ref_ids.sort(dim=-1)
        assert torch.equal(mine[clear], theirs[clear])  # the same experts (their order may differ within a tie)
        torch.testing.assert_close(weights.gather(1, order)[clear], ref_w.gather(1, ref_order)[clear], atol=1e-2,
                                   rtol=1e-2)
    assert compared > total / 2, (compared, total)  # most tokens were compared
    nan_rows = torch.full((3, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    nan_ids = moe_router.route(nan_rows, w, b, top_k, softmax_first, normalize=softmax_first)[1]
    assert bool(((nan_ids >= 0) & (nan_ids < experts)).all())  # a padding row's ids name experts that exist
    x = torch.randn(5, hidden, device="cuda", generator=g).to(torch.bfloat16)
    eager = moe_router.route(x, w, b, top_k, softmax_first, normalize=softmax_first)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = moe_router.route(x, w, b, top_k, softmax_first, normalize=softmax_first)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[1], eager[1]) and torch.equal(captured[0], eager[0])


@pytest.mark.parametrize("window,splits", [(None, None), (128, None), (None, 8), (128, 4)])
def test_sink_attention_at_gpt_oss_head_shape(window, splits):
    # Decode, a verify of 4 and a prefill after a cached prefix, contexts past the 128-token window.
    lens = ([1, 4, 0, 37, 1], [700, 300, 0, 200, 129])
    case = attention_case(64, 8, 64, 16, *lens, window, torch.bfloat16, device="cuda", seed=3)
    sinks = torch.randn(64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4)) * 3
    check_sink_attention(case, sinks, splits, BF16["atol"], min_effect=0.1)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("gpt_oss_cuda")
    # Window 3 under a KV block of 16: windows inside one block and across blocks both occur over 40 tokens.
    return {"target": make_model(root, "target", gpt_oss_config()),
            "draft": make_model(root, "draft", gpt_oss_config(num_hidden_layers=2, layer_types=[
                "sliding_attention", "full_attention"]), seed=1)}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tiny_gpt_oss_greedy_on_cuda_equals_hf_alone_and_with_a_draft(tiny_gpt_oss, enforce_eager):
    target = tiny_gpt_oss["target"]
    prompts = random_prompts([3, 11, 29], seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=128, block_size=16, num_kv_blocks=64,
              enforce_eager=enforce_eager)
    want = [hf_greedy_cuda(target.hf, p, 24) for p in prompts]
    alone = LLM(target.path, **kw).generate(prompts, params)
    assert [o.token_ids for o in alone] == want
    llm = LLM(target.path, draft_model=tiny_gpt_oss["draft"].path, num_speculative_tokens=3,
              adaptive_draft_length=False, **kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert llm.spec_stats(outs).num_draft_tokens > 0
