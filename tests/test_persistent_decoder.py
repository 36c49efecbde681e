"""The persistent decoder (every decoder layer of a few-row decode step in one launch, engine/kernels/
persistent/decoder.py) against its torch reference (the unfused layers' own references), on CPU under Triton's
interpreter (in a child process: tests/interpreter_children.py), one (layer, stage) a launch as the interpreter
runs it; its refusals; and the engine's greedy output with it equal to the torch path (tests/kernel_path_run.py,
Mistral). tests/gpu/test_persistent_decoder_cuda.py runs the one-launch form with its grid barriers."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by

from engine.config import EngineConfig
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

from engine.kernels.persistent.plan import (  # noqa: E402
    DecoderShape,
    LayerWeights,
    PersistentDecoder,
    persistent_decode_ref,
)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")

# name: (qk norm (Qwen3), qkv bias (Qwen2), window (Mistral; smaller than a block here), activation)
VARIANTS = {"qwen3": (True, False, None, "silu"), "qwen2": (False, True, None, "silu"),
            "mistral-window": (False, False, 3, "silu"), "gelu": (True, True, 6, "gelu_pytorch_tanh")}


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_persistent_decoder_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: the two variants with the
    # context split over 37 programs (the interpreter's costly part) go one to a child.
    assert_pytest_children_pass(__file__, split_by("qwen3"))


def make_case(device: str, dtype: torch.dtype, variant: str, layers: int = 2, seed: int = 0) -> dict:
    """A random two-layer model of 4 q heads over 2 KV heads (head_dim 16), its KV cache of 4-token blocks holding
    each request's context, and a decode step of three rows: contexts of 9 and 14 tokens (blocks out of order)
    and a padding request."""
    qk_norm, bias, window, act = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(device)

    hidden, nq, nkv, hd, inter, bs, nb = 64, 4, 2, 16, 96, 4, 16
    shape = DecoderShape(hidden, nq, nkv, hd, inter, 1e-6, 1e-5, hd ** -0.5, window, act)
    caches = rand(layers, 2, nb, bs, nkv, hd, scale=1.0)
    nqkv = (nq + 2 * nkv) * hd
    weights = [LayerWeights(rand(nqkv, hidden), rand(nqkv) if bias else None, rand(hidden, nq * hd),
                            rand(2 * inter, hidden), rand(hidden, inter), rand(hidden, shift=1.0),
                            rand(hidden, shift=1.0), rand(hd, shift=1.0) if qk_norm else None,
                            rand(hd, shift=1.0) if qk_norm else None, caches[i, 0], caches[i, 1])
               for i in range(layers)]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(64).float(), inv)
    seq_lens = torch.tensor([9, 14, 0], dtype=torch.int32)
    block_table = torch.tensor([[5, 2, 9, 0], [1, 7, 3, 11], [0, 0, 0, 0]], dtype=torch.int32)
    positions = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.tensor([int(block_table[0, 2]) * bs + 0, int(block_table[1, 3]) * bs + 1, -1])
    return dict(shape=shape, weights=weights, caches=caches, h=rand(3, hidden, scale=1.0),
                positions=positions.to(device), slots=slots.to(device), seq_lens=seq_lens.to(device),
                block_table=block_table.to(device), cos=freqs.cos().to(device), sin=freqs.sin().to(device))


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output and KV cache, on a copy of the case's cache."""
    caches = case["caches"].clone()
    ws = [LayerWeights(**{**w.__dict__, "key_cache": caches[i, 0], "value_cache": caches[i, 1]})
          for i, w in enumerate(case["weights"])]
    out = persistent_decode_ref(case["shape"], ws, case["h"], case["positions"], case["slots"], case["seq_lens"],
                                case["block_table"], case["cos"], case["sin"])
    return out, caches


def run(case: dict, programs: int, max_rows: int = 4, staged: bool = False) -> tuple[torch.Tensor, PersistentDecoder]:
    pd = PersistentDecoder(case["shape"], case["weights"], case["cos"], case["sin"], max_rows=max_rows,
                           programs=programs)
    args = (case["h"].clone(), case["positions"], case["slots"], case["seq_lens"], case["block_table"])
    return (pd.run_staged(*args) if staged else pd(*args)), pd


@interpreted
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_reference(variant):
    """Output and stored keys/values equal the reference's (float32), with one split (3 programs) and, for the
    variants whose attention differs (q/k norm, a window), with the context split over several programs (37: 4
    splits a KV head, ragged tiles and more programs than tiles). Bias and GELU live in the products, whose tiles
    spread over the programs the same way in every variant; 37 interpreted programs cost about 9 s a variant."""
    for programs in (3, 37) if variant in ("qwen3", "mistral-window") else (3,):
        case = make_case("cpu", torch.float32, variant, seed=programs)
        want, want_cache = reference(case)
        got, pd = run(case, programs)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(case["caches"], want_cache, atol=2e-5, rtol=2e-5)
        assert pd.calls == 1 and int(pd.error) == 0
        # the padding request stored nothing, and its rows came through as finite numbers
        assert torch.isfinite(got).all()


@interpreted
def test_a_broken_stage_is_caught():
    """Negative control: the same case with one layer's o_proj weight changed must not match the reference."""
    case = make_case("cpu", torch.float32, "qwen3")
    want, _ = reference(case)
    case["weights"][1].o.mul_(1.01)
    got, _ = run(case, 3)
    assert (got - want).abs().max() > 1e-3


def test_refusals():
    """What it cannot run is refused with a ValueError that names the reason, before any launch."""
    case = make_case("cpu", torch.float32, "qwen3")
    with pytest.raises(ValueError, match="max_rows"):
        PersistentDecoder(case["shape"], case["weights"], case["cos"], case["sin"], max_rows=9, programs=4)
    odd = DecoderShape(**{**case["shape"].__dict__, "head_dim": 12})
    with pytest.raises(ValueError, match="head_dim"):
        PersistentDecoder(odd, case["weights"], case["cos"], case["sin"], max_rows=4, programs=4)
    with pytest.raises(ValueError, match="rotary tables"):
        PersistentDecoder(case["shape"], case["weights"], case["cos"][:, :4], case["sin"][:, :4], max_rows=4,
                          programs=4)
    bad = [case["weights"][0], LayerWeights(**{**case["weights"][1].__dict__, "qkv_bias": torch.zeros(128)})]
    with pytest.raises(ValueError, match="biases"):
        PersistentDecoder(case["shape"], bad, case["cos"], case["sin"], max_rows=4, programs=4)
    for rows in (9, -1, True):
        with pytest.raises(ValueError, match="persistent_decode_rows"):
            EngineConfig(torch.device("cpu"), torch.float32, 64, persistent_decode_rows=rows).validate()
