"""The few-row products with folded norms, activation and residual adds (engine/kernels/small_m/linear.py) on FP8
weights: each form against the references on the dequantized weight, and greedy decoding of an FP8 checkpoint
through them against HF on its dequantized weights, on CPU under Triton's interpreter (in child processes,
tests/interpreter_children.py). tests/gpu/test_small_m_fp8_cuda.py runs the kernel checks on CUDA."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, in_parent, interpreted, skip_without_triton, split_by

from engine.kernels.small_m import linear as sml
from engine.kernels.small_m import tiles as small_m_tiles
from engine.quantization.fp8 import dequantize_rows, quantize_fp8

skip_without_triton()


@in_parent
def test_small_m_fp8_under_interpreter():
    # Two children side by side: the kernel checks, and greedy decoding through them.
    assert_pytest_children_pass(__file__, split_by("greedy"))


def fp8_weight(w: torch.Tensor, block: tuple[int, int] | None, device: str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(FP8 weight, its scales held a row [N, G], group_k) on `device`, as engine/quantization/fp8.py holds them."""
    q, s = quantize_fp8(w, block)
    if block is None:
        return q.to(device), s.contiguous().to(device), w.shape[1]
    return q.to(device), s.repeat_interleave(block[0], 0)[:w.shape[0]].contiguous().to(device), block[1]


def check_small_m_fp8(device: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 2, 3, 5, 17),
                      shapes: tuple[tuple[int, int], ...] = ((96, 40),), config: dict | None = None,
                      blocks: tuple[tuple[int, int] | None, ...] = (None, (16, 32))) -> None:
    """Each wrapper on an FP8 weight (a scale a row, and 16 x 32 blocks whose groups the K tiles must not straddle)
    against its reference on the weight dequantized to the activations' dtype: at fp8_tiles' tl.dot form (each K
    tile's product times its group's scales, K split where the column tiles are few) or at `config`, at 1-3 rows and
    at 5 and 17 (the wide path's forms, and the gated epilogue); K 96 spans three groups, N 40 leaves a partial
    column tile. Tolerance: one rounding of the output in `dtype` (the kernel scales the exact FP8 values' products,
    the reference rounds the dequantized weight to `dtype` first)."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    for k, n in shapes:
        for block in blocks:
            q, s, gk = fp8_weight(torch.randn(n, k, generator=g) * k ** -0.5, block, device)
            w = dequantize_rows(q, s, gk, dtype)
            gu_q, gu_s, _ = fp8_weight(torch.randn(2 * n, k, generator=g) * k ** -0.5, block, device)
            gu_w = dequantize_rows(gu_q, gu_s, gk, dtype)
            fp8 = dict(scale=s, group_k=gk, config=config)
            bias, nw = rand(n), rand(k, scale=0.1) + 1.0
            for m in rows:
                x, res, add = rand(m, k, scale=2.0), rand(m, k), rand(m, n)
                out, r = sml.norm_linear(x, res, nw, 1e-6, 0.0, q, bias, **fp8)
                ref, ref_r = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w, bias)
                torch.testing.assert_close(out, ref, **tol)
                assert torch.equal(r, ref_r)
                gate_up = rand(m, 2 * k, scale=2.0)
                torch.testing.assert_close(sml.act_linear(gate_up, "silu", q, **fp8),
                                           sml.act_linear_ref(gate_up, "silu", w), **tol)
                torch.testing.assert_close(sml.linear_add(x, q, bias, add, **fp8),
                                           sml.linear_add_ref(x, w, bias, add), **tol)
                if m > small_m_tiles.FMA_MAX_ROWS and config is None:  # the wide path's forms
                    y, ss = sml.linear_add_ss(x, q, bias, add, scale=s, group_k=gk)
                    torch.testing.assert_close(y, sml.linear_add_ss_ref(x, w, bias, add)[0], **tol)
                    torch.testing.assert_close(ss.sum(0), y.float().square().sum(-1), atol=1e-2, rtol=1e-4)
                    gated, _ = sml.norm_linear(x, None, nw, 1e-6, 1.0, gu_q, scale=gu_s, group_k=gk, glu="silu")
                    torch.testing.assert_close(gated, sml.norm_linear_ref(x, None, nw, 1e-6, 1.0, gu_w, glu="silu")[0],
                                               **tol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_m_fp8_matches_references(dtype):
    check_small_m_fp8("cpu", dtype)


@interpreted
def test_small_m_fp8_tiles_and_refusals(monkeypatch):
    """The FMA form with K split and the row loop (reachable through an explicit config) against the reference;
    the tiles fp8_tiles picks keep K tiles within a scale group and split K only into several ranges; and what the
    products refuse, named: scales of the wrong shape or dtype, groups the kernel cannot step through, a K tile
    straddling groups."""
    check_small_m_fp8("cpu", torch.float32, rows=(1, 3), config=dict(USE_DOT=False, BLOCK_M=4, BLOCK_N=8,
                                                                       BLOCK_K=32, SPLIT_K=3, num_warps=4))
    check_small_m_fp8("cpu", torch.float32, rows=(2,), config=dict(USE_DOT=False, ROW_LOOP=True, BLOCK_M=2,
                                                                     BLOCK_N=8, BLOCK_K=32, num_warps=4))
    for m in (1, 2, 4, 5, 64):
        for n, k in ((6144, 4096), (4096, 12288), (1024, 1024)):
            cfg = small_m_tiles.fp8_tiles(m, n, k, 128, torch.device("cpu"))
            assert 128 % cfg["BLOCK_K"] == 0 and not cfg.get("CUBLAS"), (m, n, k, cfg)
            assert cfg["SPLIT_K"] == 1 or small_m_tiles.split_k_range(k, cfg["BLOCK_K"], cfg["SPLIT_K"])[0] > 1
    q, s, gk = fp8_weight(torch.randn(40, 96), (16, 32))
    x = torch.randn(1, 96)
    with pytest.raises(ValueError, match="FP8 scales must be"):
        sml.linear_add(x, q, None, torch.zeros(1, 40), scale=s[:, :2].contiguous(), group_k=32)
    with pytest.raises(ValueError, match="float8_e4m3fn weight and float32 scales"):
        sml.linear_add(x, q, None, torch.zeros(1, 40), scale=s.double(), group_k=32)
    with pytest.raises(ValueError, match="multiple of 16"):
        sml.linear_add(x, q, None, torch.zeros(1, 40), scale=torch.ones(40, 12), group_k=8)
    with pytest.raises(ValueError, match="must divide its scale groups"):
        sml.linear_add(x, q, None, torch.zeros(1, 40), scale=s, group_k=32, config=dict(BLOCK_K=64))


@interpreted
def test_greedy_through_small_m_fp8_equals_hf(tmp_path):
    """A 2-layer Qwen3 (q/k norms) in block FP8 with a draft of its own shape in per-channel FP8: the draft's steps
    (two requests) and verifies of k + 1 = 4 rows a request through the folded FP8 products (the wide path's tl.dot
    forms), float32: token for token HF's greedy output on the target's dequantized weights."""
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
    from fp8_checkpoints import write_fp8_checkpoint
    from transformers import Qwen3Config

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    cfg = Qwen3Config(**{**TINY_CONFIGS["qwen3"].to_dict(), "num_hidden_layers": 2, "layer_types": None})
    target = make_tiny_model(tmp_path, "qwen3", cfg)
    draft = make_tiny_model(tmp_path, "qwen3-draft", cfg, scale=5.9)
    oracle = write_fp8_checkpoint(target.hf, cfg, tmp_path / "fp8", "fp8-block", (16, 32))
    calls: list[tuple[int, bool]] = []
    real = sml._launch

    def counted(x, weight, *a, **kw):  # noqa: ANN001, ANN202
        calls.append((x.shape[0], kw.get("scale") is not None))
        return real(x, weight, *a, **kw)

    sml._launch = counted
    try:
        llm = LLM(str(tmp_path / "fp8"), draft_model=draft.path, draft_quantization="fp8", num_speculative_tokens=3,
                  attention_backend="triton", device="cpu", block_size=4, num_kv_blocks=100, max_num_seqs=2,
                  small_m_rows=16, adaptive_draft_length=False)
        layer = llm.executor.target.model.model.layers[0]
        # FP8 products are tl.dot forms at every row count: the layers take the wide path from one row, to 64 rows
        assert layer.small_m_rows == 16 and layer.dot_products and layer.wide_rows == sml.MAX_ROWS
        prompts = random_prompts([5, 9], seed=4)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        sml._launch = real
    assert [o.token_ids for o in outs] == [hf_greedy(oracle, p, 6) for p in prompts]
    assert calls and all(scaled for _, scaled in calls)  # every folded product read FP8 weights
    assert {m for m, _ in calls} >= {2, 8}  # decode and draft steps of two rows, and a verify of 4 rows a request
