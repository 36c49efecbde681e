"""The few-row products with folded norms, activation and residual adds (engine/kernels/small_m/linear.py) against
their torch references, and greedy decoding through them (target decode and verify, and the draft loop) against
HF for the families the other kernel-path tests leave out, on CPU under Triton's interpreter (in child processes,
tests/interpreter_children.py). CUDA runs the kernel checks in tests/gpu/test_small_m_linear_cuda.py."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, in_parent, interpreted, skip_without_triton, split_by

from engine.kernels.small_m import arrival_counters
from engine.kernels.small_m import linear as sml
from engine.kernels.small_m import tiles as small_m_tiles

skip_without_triton()


@in_parent
def test_small_m_linear_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: the Qwen3 models (the family's
    # greedy run and draft loop, and the measured wide layer) with the float32 per-form and the split-K kernel
    # checks, and the rest (the float16 per-form and the wide-path checks, Qwen2, Gemma 3).
    assert_pytest_children_pass(__file__, split_by("qwen3 or wide or split_k or references[dtype0]"))


def check_small_m_linear(device: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 2, 3, 5),
                         shapes: tuple[tuple[int, int], ...] = ((96, 200),), config: dict | None = None) -> None:
    """Every prologue and epilogue against its reference in each of the kernel's forms (on the interpreter's 4
    "SMs": 1 row FMA, 2 rows the row loop, 3 rows the five-stage tl.dot tiles, 5 rows the tl.dot tiles beyond; the
    narrow shape's 2 and 3 rows the row loop over several K tiles), with a K that
    is not a multiple of the K tile and an N that is not a multiple of the N tile; shared with the CUDA test.
    `config` overrides the kernel's tiles (a narrow BLOCK_K makes K span several tiles: the first is read before
    the dependent-launch wait, the others in the loop)."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    for k, n in shapes:
        w, bias = rand(n, k, scale=k ** -0.5), rand(n)
        for m in rows:
            x, res = rand(m, k, scale=2.0), rand(m, k)
            # (norm offset, residual, bias): Llama form alone, Llama form with everything, Gemma form
            for offset, r, b in ((0.0, None, None), (0.0, res, bias), (1.0, res, None)):
                nw = rand(k, scale=0.1) + (0.0 if offset else 1.0)
                out, s = sml.norm_linear(x, r, nw, 1e-6, offset, w, b, config=config)
                ref, ref_s = sml.norm_linear_ref(x, r, nw, 1e-6, offset, w, b)
                torch.testing.assert_close(out, ref, **tol)
                assert torch.equal(s, ref_s)  # the residual sum is rounded once, as torch rounds it
            gate_up = rand(m, 2 * k, scale=2.0)
            for act in ("silu", "gelu_pytorch_tanh"):
                torch.testing.assert_close(sml.act_linear(gate_up, act, w, config=config),
                                           sml.act_linear_ref(gate_up, act, w), **tol)
            add = rand(m, n)
            torch.testing.assert_close(sml.linear_add(x, w, bias, add, config=config),
                                       sml.linear_add_ref(x, w, bias, add), **tol)
    x = rand(2, 96)
    with pytest.raises(ValueError, match="at most"):
        sml.linear_add(rand(sml.MAX_ROWS + 1, 96), rand(8, 96), None, rand(sml.MAX_ROWS + 1, 8))
    with pytest.raises(ValueError, match="weight"):
        sml.linear_add(x, rand(8, 95), None, rand(2, 8))
    with pytest.raises(ValueError, match="act_linear supports"):
        sml.act_linear(x, "relu", rand(8, 48))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_m_linear_matches_references(dtype):
    check_small_m_linear("cpu", dtype)
    check_small_m_linear("cpu", dtype, shapes=((300, 40),), config={"BLOCK_K": 128})  # three K tiles
    # cuBLAS with the separate norm / activation / add, where FEW_ROWS_MEASURED sends a product
    check_small_m_linear("cpu", dtype, rows=(1, 3), config=small_m_tiles.CUBLAS)


@interpreted
def test_a_gpu_models_cublas_entry_and_an_explicit_config(monkeypatch):
    """Where a GPU model's table sends a shape to cuBLAS at one row and at three to four (the four-row entry), the
    wrappers run the unfused form there and the kernel at two; an explicit config still runs the kernel (sweeps and
    tests time tilings with it); all match the references."""
    k, n = 96, 40
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "a GPU model")
    monkeypatch.setitem(small_m_tiles.FEW_ROWS_MEASURED, "a GPU model",
                        {(1, n, k): small_m_tiles.CUBLAS, (4, n, k): small_m_tiles.CUBLAS})
    unfused, calls = sml.unfused_product, []
    monkeypatch.setattr(sml, "unfused_product", lambda *a: calls.append(a[0].shape[0]) or unfused(*a))
    g = torch.Generator().manual_seed(2)
    w, nw = torch.randn(n, k, generator=g) * k ** -0.5, torch.rand(k, generator=g) + 0.5
    for m, config, want in ((1, None, [1]), (2, None, []), (3, None, [3]), (4, None, [4]), (1, {"BLOCK_K": 32}, [])):
        calls.clear()
        x, res = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
        out, s = sml.norm_linear(x, res, nw, 1e-6, 0.0, w, config=config)
        ref, ref_s = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(s, ref_s) and calls == want, (m, config, calls)


@interpreted
def test_split_k_matches_references(monkeypatch):
    """5, 17 and 64 rows (row tiles of 16, 32, 64) with K split in three (the last program to arrive at a column
    tile sums the partials) and unsplit, each prologue and the epilogue once, float32 and float16 (the interpreter's
    bf16 tl.dot is wrong: bf16 runs in the CUDA test): the references' results up to the sum order, the residual
    sum exact, and every arrival counter back at zero after each launch (the next launch reuses them)."""
    g = torch.Generator().manual_seed(1)
    k, n = 96, 40  # three K tiles of 32; three column tiles of 16, the last partly masked
    used = []
    monkeypatch.setattr(sml, "arrival_counters", lambda device, t: used.append(t) or arrival_counters.arrival_counters(
        device, t))
    assert small_m_tiles.split_k_range(k, 32, 3) == (3, 32)
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.float16, dict(atol=3e-2, rtol=3e-2))):
        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        w, bias, nw = rand(n, k, scale=k ** -0.5), rand(n), rand(k, scale=0.1) + 1.0
        for m, split in ((5, 3), (17, 1), (64, 3)):
            cfg = dict(USE_DOT=True, BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
                       SPLIT_K=split)
            x, res, add, gate_up = rand(m, k, scale=2.0), rand(m, k), rand(m, n), rand(m, 2 * k, scale=2.0)
            out, s = sml.norm_linear(x, res, nw, 1e-6, 0.0, w, bias, config=cfg)
            ref, ref_s = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w, bias)
            torch.testing.assert_close(out, ref, **tol)
            assert torch.equal(s, ref_s)  # written once, by the first program
            torch.testing.assert_close(sml.act_linear(gate_up, "silu", w, config=cfg),
                                       sml.act_linear_ref(gate_up, "silu", w), **tol)
            torch.testing.assert_close(sml.linear_add(x, w, bias, add, config=cfg),
                                       sml.linear_add_ref(x, w, bias, add), **tol)
            assert all(not c.any() for c in arrival_counters._buffers.values())
    assert used == [3] * 12  # the split launches (and only those) took counters, one per column tile


@interpreted
def test_row_squares_and_gated_epilogue_match_references():
    """The wide path's forms (5-64 rows): linear_add_ss's output and its rows' sums of squares per column tile (split
    K and not), the norm reading them (row_ss) instead of x's rows, and gate_up with the activation as its epilogue
    (glu; SiLU, and GELU with Gemma's offset norm), float32 and float16, against the references; and what they
    refuse, named."""
    g = torch.Generator().manual_seed(3)
    k, n, inter = 96, 40, 24
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.float16, dict(atol=3e-2, rtol=3e-2))):
        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        w, bias, nw = rand(n, k, scale=k ** -0.5), rand(n), rand(n, scale=0.1) + 1.0
        w_q, w_gu = rand(32, n, scale=n ** -0.5), rand(2 * inter, n, scale=n ** -0.5)
        for m, split in ((5, 3), (17, 1), (64, 2)):
            cfg = dict(USE_DOT=True, BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
                       SPLIT_K=split)
            x, add = rand(m, k), rand(m, n, scale=2.0)
            y, ss = sml.linear_add_ss(x, w, bias, add, config=cfg)
            ref_y, ref_ss = sml.linear_add_ss_ref(x, w, bias, add)
            torch.testing.assert_close(y, ref_y, **tol)
            assert ss.shape == (3, m) and ss.dtype == torch.float32  # three column tiles of 16
            torch.testing.assert_close(ss.sum(0), y.float().square().sum(-1), atol=1e-3, rtol=1e-5)
            for act, offset in (("silu", 0.0), ("gelu_pytorch_tanh", 1.0)):
                plain = dict(cfg, SPLIT_K=1)
                out, s = sml.norm_linear(y, None, nw, 1e-6, offset, w_q, config=plain, row_ss=ss)
                torch.testing.assert_close(out, sml.norm_linear_ref(y, None, nw, 1e-6, offset, w_q)[0], **tol)
                assert s is y
                gated, _ = sml.norm_linear(y, None, nw, 1e-6, offset, w_gu, config=plain, row_ss=ss, glu=act)
                ref = sml.norm_linear_ref(y, None, nw, 1e-6, offset, w_gu, glu=act)[0]
                assert gated.shape == (m, inter)
                torch.testing.assert_close(gated, ref, **tol)
    x, w_gu, nw = torch.randn(5, 64), torch.randn(6, 64), torch.ones(64)
    with pytest.raises(ValueError, match="without split K"):
        sml.norm_linear(x, None, nw, 1e-6, 0.0, w_gu, glu="silu", config=dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16,
                                                                               BLOCK_K=16, SPLIT_K=2))
    with pytest.raises(ValueError, match="glu takes"):
        sml.norm_linear(x, None, nw, 1e-6, 0.0, torch.randn(5, 64), glu="silu")
    with pytest.raises(ValueError, match="row_ss"):
        sml.norm_linear(x, torch.randn(5, 64), nw, 1e-6, 0.0, w_gu, row_ss=torch.zeros(1, 5))


@interpreted
# Llama itself is left out: its layers are the Qwen ones' (engine/models/llama.py) without a bias (Qwen2 has one)
# or a q/k norm (Qwen3 has one), and each of those branches runs here with the other family (Mistral's Llama
# layers run the kernel path in tests/test_kernel_path.py). Each interpreted family costs over a minute of CI time.
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_greedy_through_small_m_kernels_equals_hf(tmp_path, family):
    """Decode (1-4 rows, FMA form) and verify of 3 drafts (up to 16 rows, tl.dot form) through the new kernels,
    float32: token for token HF's greedy output; and the draft loop alone (3 rows) from a 1-layer Qwen3 draft."""
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
    from fast_path_support import draft_runner, hf_draft_tokens, run_draft_loop

    from engine import LLM, SamplingParams
    from engine.speculation.draft_loop import DraftLoop

    torch.set_num_threads(1)
    target = make_tiny_model(tmp_path, family, TINY_CONFIGS[family])
    draft = make_tiny_model(tmp_path, family + "-draft", TINY_CONFIGS[family], scale=5.9)
    prompts = random_prompts([5, 9, 14, 3], seed=4)
    # Seven tokens: the first verify has all 16 rows (4 requests, 3 drafts each), and the shortest prompt runs past
    # Gemma 3's 6-token window (3 + 7); each further token costs seconds on the interpreter.
    n = 7
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm = LLM(target.path, draft_model=draft.path, num_speculative_tokens=3, attention_backend="triton",
              device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=4, small_m_rows=16,
              adaptive_draft_length=False)  # a fixed k: verifies of k + 1 rows every step, acceptance checked
    layer = llm.executor.target.model.model.layers[0]
    assert layer.small_m_rows == 16 and layer.mlp.small_m_rows == 16
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target.hf, p, n), f"{family}: prompt of {len(p)} tokens diverged"
    assert llm.spec_stats(outs).acceptance_rate > 0.3
    if family == "qwen3":
        runner = draft_runner(draft, "cpu", 5, 4, graphs=False, small_m_rows=4)
        assert runner.model.model.layers[0].small_m_rows == 4
        loop = DraftLoop(runner, 5, keep_probs=False)
        lp, ks = random_prompts([6, 7, 10], seed=5), [5, 3, 5]
        ids, _ = run_draft_loop(runner, loop, lp, ks)
        assert [row[:k] for row, k in zip(ids.tolist(), ks)] == hf_draft_tokens(draft, lp, ks)


@interpreted
def test_a_measured_wide_layer_takes_its_verify_rows_and_equals_hf(tmp_path, monkeypatch):
    """A layer the tables list as measured faster on its wide path (WIDE_LAYERS_MEASURED, here the tiny target's
    shapes on the interpreter's "" device, with its qkv sent to cuBLAS by a DOT_MEASURED entry as an 8B model's is
    on an H200) takes the wide path for forwards of 5-16 rows although small_m_rows caps it at one row, and greedy
    speculation through it is HF's output token for token (float32); small_m_rows=0 still turns it off."""
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts

    from engine import LLM, SamplingParams
    from engine.models.llama import LlamaDecoderLayer

    torch.set_num_threads(1)
    cfg = TINY_CONFIGS["qwen3"]
    target = make_tiny_model(tmp_path, "qwen3", cfg)
    draft = make_tiny_model(tmp_path, "qwen3-draft", cfg, scale=5.9)
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    products = ((q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter))
    monkeypatch.setitem(small_m_tiles.WIDE_LAYERS_MEASURED, "", {products: 16})
    monkeypatch.setitem(small_m_tiles.DOT_MEASURED, "", {(16, *products[0]): small_m_tiles.CUBLAS})
    calls = []
    wide = LlamaDecoderLayer._forward_wide

    def counted(self, positions, x, residual, md):  # noqa: ANN001, ANN202
        calls.append(x.shape[0])
        return wide(self, positions, x, residual, md)

    monkeypatch.setattr(LlamaDecoderLayer, "_forward_wide", counted)
    llm = LLM(target.path, draft_model=draft.path, num_speculative_tokens=4, attention_backend="triton",
              device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=2, small_m_rows=1,
              adaptive_draft_length=False)  # a fixed k: verifies of k + 1 = 5 rows a request
    runner = llm.executor.target
    first = runner.model.model.layers[0]
    assert first.product_shapes() == products
    assert first.small_m_rows == 1 and first.wide_rows == 16
    assert llm.executor.draft.model.model.layers[0].wide_rows == 16  # the draft: the same tiny shapes
    prompts = random_prompts([6, 11], seed=7)
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target.hf, p, 9), f"prompt of {len(p)} tokens diverged"
    assert any(m % 5 == 0 for m in calls) and all(4 < m <= 16 for m in calls)  # verifies of 5 rows a request
    runner._set_small_m_rows(0)
    assert first.wide_rows == 0 and first.small_m_rows == 0
