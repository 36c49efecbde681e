"""The few-row products with folded norms, activation and residual adds on CUDA against their torch references
(see tests/test_small_m_linear.py), the split-K form at 5-64 rows on a Qwen3-0.6B layer's shapes, eagerly and
replayed from a CUDA graph, and graph replays through them equal to eager steps without them."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_small_m_linear import check_small_m_linear
from test_small_m_tiles import QWEN3_PROJECTIONS

from engine import LLM, SamplingParams
from engine.kernels.small_m import arrival_counters
from engine.kernels.small_m import linear as sml
from engine.kernels.small_m import tiles as small_m_tiles
from engine.kernels.small_m.tiles import split_k_range, tiles_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_matches_references_on_cuda(dtype):
    check_small_m_linear("cuda", dtype, rows=(1, 5, 17, 64), shapes=((64, 40), (3072, 1024)))


def _layer_inputs(m: int, dtype: torch.dtype, seed: int = 0, shape: str = "qwen3-0.6b") -> dict[str, torch.Tensor]:
    """Inputs and weights of a Qwen3 layer's four products at m rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = QWEN3_PROJECTIONS[shape]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    t = {name: rand(n, k, scale=k ** -0.5) for name, (k, n) in p.items()}
    h, inter = p["qkv"][0], p["down"][0]
    t.update(x=rand(m, h, scale=2.0), res=rand(m, h), nw=rand(h, scale=0.1) + 1.0, a=rand(m, p["o"][0]),
             gu=rand(m, 2 * inter, scale=2.0), bias=rand(p["qkv"][1]))
    return t


def _products(t: dict[str, torch.Tensor], ref: bool = False, config: dict | None = None) -> list[torch.Tensor]:
    """norm+qkv (residual and bias), o_proj+residual, Gemma-form norm+gate_up, act+down: kernels or references."""
    if ref:
        qkv, s = sml.norm_linear_ref(t["x"], t["res"], t["nw"], 1e-6, 0.0, t["qkv"], t["bias"])
        return [qkv, s, sml.linear_add_ref(t["a"], t["o"], None, s),
                sml.norm_linear_ref(t["x"], None, t["nw"], 1e-6, 1.0, t["gate_up"])[0],
                sml.act_linear_ref(t["gu"], "silu", t["down"])]
    qkv, s = sml.norm_linear(t["x"], t["res"], t["nw"], 1e-6, 0.0, t["qkv"], t["bias"], config=config)
    return [qkv, s, sml.linear_add(t["a"], t["o"], None, s, config=config),
            sml.norm_linear(t["x"], None, t["nw"], 1e-6, 1.0, t["gate_up"], config=config)[0],
            sml.act_linear(t["gu"], "silu", t["down"], config=config)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert torch.equal(got[1], want[1])  # the residual sum, written once
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_on_a_draft_layer_matches_references(dtype):
    """5-64 rows on a Qwen3-0.6B layer: the rule's tiles (split K for the 1024-wide o_proj and down), a forced
    split of every product and the unsplit DOT form, against the references; a split result is the same bits
    launch after launch (the partials are summed in split order whoever arrives last), and every arrival counter
    is back at zero."""
    for m in (5, 8, 16, 32, 64):
        t = _layer_inputs(m, dtype, seed=m)
        want = _products(t, ref=True)
        bm = max(16, 1 << (m - 1).bit_length())
        cfgs = [None, dict(USE_DOT=True, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=3),
                dict(USE_DOT=True, BLOCK_M=bm, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)]
        for cfg in cfgs:
            got = _products(t, config=cfg)
            _assert_close(got, want, dtype)
            again = _products(t, config=cfg)
            assert all(torch.equal(a, b) for a, b in zip(got, again)), (m, cfg)
        torch.cuda.synchronize()
        assert all(not c.any() for c in arrival_counters._buffers.values())
    k, n = QWEN3_PROJECTIONS["qwen3-0.6b"]["down"]
    rule = tiles_for(16, n, k, torch.device("cuda"))
    assert split_k_range(k, rule["BLOCK_K"], rule["SPLIT_K"])[0] > 1  # the rule splits the 1024-wide products


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rows", [("qwen3-0.6b", (5, 16, 32, 64)), ("qwen3-8b", (5, 8, 16))])
def test_wide_path_chain_matches_references(dtype, shape, rows):
    """The wide path's chain on a Qwen3-0.6B layer at 5-64 rows, and on a Qwen3-8B layer at 5-16 rows (an H200 runs a
    verify of 5-8 through it, its qkv through cuBLAS), as engine/models/llama.py runs it (this GPU's tilings or
    the rule's): o_proj+residual writing its sums of squares, the norm+gate_up reading them with the activation as
    its epilogue, down+residual writing the next ones, the next qkv reading those; against the references, the same
    bits on a second run, every arrival counter back at zero."""
    for m in rows:
        t = _layer_inputs(m, dtype, seed=m, shape=shape)

        def chain(t: dict[str, torch.Tensor] = t) -> list[torch.Tensor]:
            s, ss = sml.linear_add_ss(t["a"], t["o"], None, t["res"])
            act, _ = sml.norm_linear(s, None, t["nw"], 1e-6, 0.0, t["gate_up"], row_ss=ss, glu="silu")
            out, ss2 = sml.linear_add_ss(act, t["down"], None, s)
            qkv, _ = sml.norm_linear(out, None, t["nw"], 1e-6, 0.0, t["qkv"], t["bias"], row_ss=ss2)
            return [s, act, out, qkv]

        got = chain()
        s = sml.linear_add_ref(t["a"], t["o"], None, t["res"])
        act = sml.norm_linear_ref(s, None, t["nw"], 1e-6, 0.0, t["gate_up"], glu="silu")[0]
        out = sml.linear_add_ref(got[1], t["down"], None, got[0])  # from the kernels' own inputs: no drift compounds
        want = [s, act, out, sml.norm_linear_ref(got[2], None, t["nw"], 1e-6, 0.0, t["qkv"], t["bias"])[0]]
        tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol)
        assert all(torch.equal(a, b) for a, b in zip(got, chain())), m
        torch.cuda.synchronize()
        assert all(not c.any() for c in arrival_counters._buffers.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_this_gpus_measured_tilings_match_references(dtype):
    """Every tiling this GPU model's FEW_ROWS_MEASURED entry holds (measured in bf16; the engine takes them for every
    dtype), at its rows and at three rows for a four-row entry, through the norm and the activation prologues
    and the residual epilogue, against the references."""
    entry = small_m_tiles.FEW_ROWS_MEASURED.get(small_m_tiles.device_name(torch.device("cuda")))
    if not entry:
        pytest.skip("no measured tilings for this GPU model")
    g = torch.Generator(device="cuda").manual_seed(5)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for (rows, n, k), tiles in entry.items():
        w, nw = rand(n, k, scale=k ** -0.5), rand(k, scale=0.1) + 1.0
        for m in {rows, 3} if rows == 4 else {rows}:
            cfg = tiles_for(m, n, k, torch.device("cuda"))  # the entry is what the wrappers run
            assert cfg is tiles if tiles is small_m_tiles.CUBLAS else {x: cfg[x] for x in tiles} == tiles
            x, res, add, gu = rand(m, k, scale=2.0), rand(m, k), rand(m, n), rand(m, 2 * k)
            got, s = sml.norm_linear(x, res, nw, 1e-6, 0.0, w)
            want, want_s = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w)
            torch.testing.assert_close(got, want, **tol)
            assert torch.equal(s, want_s), (rows, n, k)
            torch.testing.assert_close(sml.act_linear(gu, "gelu_pytorch_tanh", w),
                                       sml.act_linear_ref(gu, "gelu_pytorch_tanh", w), **tol)
            torch.testing.assert_close(sml.linear_add(x, w, None, add), sml.linear_add_ref(x, w, None, add), **tol)


def test_split_k_replays_from_a_cuda_graph():
    """A layer's products at 64 and 16 rows with K split, captured in one CUDA graph (after an eager call, as the
    engine's warm-up makes) and replayed twice on new inputs: each replay equals the references, so the arrival
    counters were back at zero for the next launch and the graph's workspace served every replay."""
    dtype = torch.bfloat16
    cfg = dict(USE_DOT=True, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)
    ins = {m: _layer_inputs(m, dtype, seed=m) for m in (64, 16)}

    def step() -> list[torch.Tensor]:
        return [o for m, t in ins.items() for o in _products(t, config={**cfg, "BLOCK_M": m})]

    step()  # compiles; allocates the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (100, 200):
        for m, t in ins.items():
            for name, v in _layer_inputs(m, dtype, seed=seed + m).items():
                t[name].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = [o for t in ins.values() for o in _products(t, ref=True)]
        _assert_close(outs[:5], want[:5], dtype)
        _assert_close(outs[5:], want[5:], dtype)
        assert all(not c.any() for c in arrival_counters._buffers.values())


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_small_m_graphs_equal_eager_without_them(tiny_models, tiny_drafts, family, monkeypatch):
    """float32, with a draft: graph replays through the few-row kernels (the default, single rows; decode, verify
    and draft steps up to 16 rows; and up to 64 rows, prefill chunks included, with 16-column K tiles so that the
    tiny layers' K splits too and the captured graphs run the split-K form) give the tokens of eager steps on
    cuBLAS and the separate kernels. "mixed": single rows with qkv and gate_up sent to cuBLAS (as an H200's
    FEW_ROWS_MEASURED sends an 8B model's) and o_proj and down fused."""
    target = tiny_models[family]
    draft = tiny_drafts["gemma3-2l" if family == "gemma3" else "qwen3-1l"]
    prompts = random_prompts([5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {}
    rule, sent = sml.tiles_for, []

    def mixed(m: int, n: int, k: int, device: torch.device, measured: bool = True) -> dict:
        if m == 1 and n > k and measured:  # qkv and gate_up: wider out than in
            sent.append((n, k))
            return small_m_tiles.CUBLAS
        return rule(m, n, k, device, measured)

    for rows, eager in ((0, True), (1, False), ("mixed", False), (16, False), (64, False)):
        if rows == "mixed":
            monkeypatch.setattr(sml, "tiles_for", mixed)
        if rows == 16:
            monkeypatch.setattr(sml, "tiles_for", rule)
        if rows == 64:
            monkeypatch.setattr(small_m_tiles, "DOT_TILES", {m: (32, 16, 4, 3) for m in (16, 32, 64)})
        llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=3, device="cuda",
                  dtype="float32", enforce_eager=eager, max_model_len=256, block_size=16, num_kv_blocks=256,
                  max_num_seqs=4, cuda_graph_batch_sizes=(1, 2, 4), small_m_rows=1 if rows == "mixed" else rows,
                  adaptive_draft_length=False)  # the draft's single rows run every step
        runs[rows] = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(set(sent)) >= 2  # both products of both models took cuBLAS at least once
    assert runs[1] == runs[0] and runs["mixed"] == runs[0] and runs[16] == runs[0] and runs[64] == runs[0]
    assert split_k_range(64, 16, small_m_tiles.tiles_for(16, 64, 64, torch.device("cuda"))["SPLIT_K"])[0] > 1
