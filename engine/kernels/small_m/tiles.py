"""Form, tile sizes and K split of the few-row products (engine/kernels/small_m/linear.py) per shape. The rules
for 1-4 rows come from sweeps on an H100 (benchmarks/gpu_small_m.py --sweep, figures in benchmarks/RESULTS.md); 1-4
rows' measured exceptions per GPU model are in FEW_ROWS_MEASURED (an entry may send a product to cuBLAS); rows 5-64
(the split-K DOT form) take this GPU model's DOT_MEASURED tilings (`--sweep splitk`) or else a rule."""

from __future__ import annotations

import functools

import torch

from engine.kernels.triton_compat import shared_memory as _shared_memory
from engine.kernels.triton_compat import triton

__all__ = ["FMA_MAX_ROWS", "CUBLAS", "FEW_ROWS_MEASURED", "DOT_MEASURED", "DOT_TILES", "DOT_PROGRAMS_PER_SM",
           "WIDE_LAYERS_MEASURED", "FP8_FOLDED_MEASURED", "FP8_TILES", "num_sms", "device_name", "tiles_for",
           "fp8_tiles", "folds_fp8", "wide_layer_rows", "fit_stages", "split_k_range"]

FMA_MAX_ROWS = 4  # up to this many rows the FMA form or the row loop (or tl.dot, by shape); above it tl.dot

# A "tiling" that sends the product to cuBLAS, with the separate norm / activation / add kernel the fused form folds
# in (small_m_linear's torch path): where that measured faster on a device.
CUBLAS = {"CUBLAS": True}

# Rows 1-4, per GPU model (torch.cuda.get_device_name) and (rows padded to a power of two: 1, 2 or 4; N; K): the
# measured tiling (the FMA form unless it says ROW_LOOP or USE_DOT), or CUBLAS; measured in bf16, taken for every
# dtype (tests/gpu run them in float32 too). The rule below was swept on an H100. On an H200, one row (`python3
# benchmarks/gpu_small_m.py --shapes qwen3-8b,qwen3-0.6b --rows 1 --sweep fma --skip-count`, 2026-11-28,
# benchmarks/RESULTS.md "One row on an H200"): the rule's tiles were 1.15-1.21x the best on an 8B model's o_proj
# and down, and cuBLAS beat every tiling on its qkv and gate_up (15.1 and 49.7 us against 18.7 and 55.1; the norm
# kernel then costs about 1.5 us); the 0.6B shapes' within 4% of the best. Gemma 3 at one row (the same command
# with --shapes gemma3-1b,gemma3-270m, "Attention at head dims 64 and 256"): a hidden size of 1152 is no power of
# two, and the rule's 2048-wide K tile left the 1B model's gate_up at 30.4 us (cuBLAS 10.6, floor 7.6). Two and
# four rows (`--shapes S --rows 2,4 --sweep fma,row,dot --skip-count --compile-workers 14`, SmolLM2 and
# Qwen2.5-0.5B also at one row, 2026-11-29, "Two and four rows on an H200"): the rule's FMA form left the 1B
# model's gate_up at 32.5 and 56.4 us (cuBLAS with the norm 11.9, the DOT form 12.9) and its down at 14.8 and 17.1.
# The entries are the sweeps' `few_rows_table`, kept where a draft loop measured no slower with them than without
# (benchmarks/gpu_draft.py): Gemma 3 1B's draft token 1.6-1.85x faster at batch 2 and 4, SmolLM2's 2-5% at batch 4,
# Qwen2.5-0.5B's (a shape added for this) 3% at batch 1 and 8-10% at batch 4. Those a loop measured level or slower
# were left out: SmolLM2 at one and two rows (2-9% slower), the 270M model at two and four rows, and Qwen3-0.6B at
# four rows, though each product alone was 5-16% faster.
_ROW = {"ROW_LOOP": True}
# Gemma 3 1B at two and four rows (a verify of k = 1-3 at batch 1), swept on an H200 (figures: us, against the rule's).
# The H100 (same SMs, a slower memory) takes them too: with the rule's forms its batch-1 verify of 2-4 rows took 2.1-3.1
# ms against 1.6 at 5 rows, with these 1.5-1.6 (`benchmarks/gpu_spec.py --target gemma3-1b --draft gemma3-270m`,
# 2026-12-07, benchmarks/RESULTS.md); each product alone not swept there.
_GEMMA3_1B_QKV_FEW_ROWS = {
    (2, 1536, 1152): dict(**_ROW, BLOCK_N=4, BLOCK_K=2048, num_warps=4),  # 3.29 against 4.85
    (4, 1536, 1152): dict(**_ROW, BLOCK_N=4, BLOCK_K=2048, num_warps=4),  # 4.96 against 7.22
}
_GEMMA3_1B_MLP_FEW_ROWS = {
    (2, 13824, 1152): CUBLAS,  # gate_up: 11.9 us against 32.5
    (4, 13824, 1152): dict(USE_DOT=True, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),  # 12.9 against 56.4
    (2, 1152, 6912): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8),  # down: 9.63 against 14.8
    (4, 1152, 6912): CUBLAS,  # 10.2 against 17.1
}
FEW_ROWS_MEASURED: dict[str, dict[tuple[int, int, int], dict]] = {
    "NVIDIA H200": {
        (1, 6144, 4096): CUBLAS,  # Qwen3-8B qkv
        (1, 4096, 4096): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4),  # Qwen3-8B o_proj: 10.6 us against 12.7
        (1, 24576, 4096): CUBLAS,  # Qwen3-8B gate_up
        (1, 4096, 12288): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4),  # Qwen3-8B down: 26.3 us against 30.6
        (1, 1536, 1152): dict(BLOCK_N=4, BLOCK_K=2048, num_warps=8),  # Gemma 3 1B qkv: 3.03 us against 4.52
        **_GEMMA3_1B_QKV_FEW_ROWS,
        (1, 1152, 1024): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),  # Gemma 3 1B o_proj: 2.08 us against 2.15
        (1, 13824, 1152): CUBLAS,  # Gemma 3 1B gate_up: 10.6 us and the norm kernel, against 30.4 (best tiling 16.6)
        (1, 1152, 6912): dict(BLOCK_N=2, BLOCK_K=2048, num_warps=4),  # Gemma 3 1B down: 7.99 us against 9.49
        **_GEMMA3_1B_MLP_FEW_ROWS,
        (1, 1536, 640): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8),  # Gemma 3 270M qkv: 2.53 us against 2.68
        (1, 640, 1024): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8),  # Gemma 3 270M o_proj: 1.66 us against 1.89
        (4, 576, 576): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=8),  # SmolLM2-135M o_proj: 3.12 us against 3.41
        (4, 576, 1536): dict(**_ROW, BLOCK_N=8, BLOCK_K=2048, num_warps=8),  # SmolLM2-135M down: 3.67 against 4.10
        (1, 1152, 896): dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8),  # Qwen2.5-0.5B qkv: 2.42 us against 2.61
        (1, 9728, 896): CUBLAS,  # Qwen2.5-0.5B gate_up: 8.40 us against 9.26
        (2, 9728, 896): dict(**_ROW, BLOCK_N=8, BLOCK_K=1024, num_warps=4),  # 8.38 against 9.53
        (4, 9728, 896): CUBLAS,  # 8.45 against 14.3 (the rule's DOT form at 5 stages; 9.54 at 3)
        (1, 896, 4864): dict(BLOCK_N=4, BLOCK_K=2048, num_warps=8),  # Qwen2.5-0.5B down: 4.88 against 6.08
    },
    # One row, K of 2880 (gpt-oss): the rule's 2048-wide tiles cover K in 1.4 tiles, 1024-wide ones in 2.8.
    "NVIDIA H100 80GB HBM3": {
        (1, 5120, 2880): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),  # gpt-oss qkv: 14.1 us against 21.8
        (1, 5760, 2880): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4),  # 2880 -> 5760: 15.4 us against 24.1
        (1, 2880, 2880): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4),  # 2880 -> 2880: 7.21 us against 11.5
        **_GEMMA3_1B_QKV_FEW_ROWS,
        **_GEMMA3_1B_MLP_FEW_ROWS,
    },
}


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small blocks, so CPU tests cover several programs and the masks


@functools.cache
def _cuda_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)  # None: the current device


def device_name(device: torch.device) -> str:
    """The GPU model FEW_ROWS_MEASURED is keyed by; "" off CUDA (the interpreter keeps the rule)."""
    return _cuda_name(device.index) if device.type == "cuda" else ""


def tiles_for(m: int, n: int, k: int, device: torch.device, measured: bool = True) -> dict:
    """Tile sizes: with `measured`, this GPU model's measured tilings of 1-4 rows first (FEW_ROWS_MEASURED); without,
    the rule alone (what an explicit config overrides, and what a sweep ranks). FMA form: a weight tile of 64 fp32
    accumulators a thread per row (8192 elements at 4 warps and one row, 16 KB of bf16), as wide in K as the rule
    below allows, narrowed in N (more programs) until the grid has enough programs. At one row on an H100 a sweep
    (benchmarks/gpu_small_m.py --sweep) found, with the first tile requested before the dependent-launch wait:
    - K of 1025-4095 (a 0.6B model's o_proj and down): 2048-wide tiles at 8 warps, one program per SM enough: 2.4
      and 3.5 us against 2.9 and 5.5 with 1024-wide tiles at 4 warps;
    - K up to 1024: the whole K in one tile, unless the grid would exceed four programs per SM (a 0.6B gate_up:
      768), where half of K keeps every program resident (6.7 against 7.6 us);
    - K of 4096 and more (an 8B model's projections): 2048-wide tiles at 4 warps, two programs per SM.
    At 2-4 rows (a draft's catch-up step, speculation-ahead branches) the same sweep at 2 and 4 rows on the 0.6B
    shape found:
    - K of 1025-4095: FMA still, 2048-wide tiles at 2 rows and 1024-wide at 3-4 (the accumulator grows with the
      rows; o_proj 2.9 and 3.8 us, down 4.8 and 5.7);
    - K up to 1024 where 8-feature tiles make at most four programs per SM (a 0.6B qkv): the row loop (one row at
      a time, the weight tile as at one row) with the whole K in one tile, 4.8 and 6.9 us against 6.0 and 7.5 in
      the FMA or DOT form;
    - other K up to 1024 (a 0.6B gate_up): the row loop with 4-feature tiles at 2 rows (8.0 us against 8.3), the
      DOT form with 64 x 256 tiles and five pipeline stages at 3-4 (8.3 us against 9.9 in the row loop and 14.3
      in the FMA form).
    Rows 5-64 take the DOT form with split K (`_dot_config`). Without the split, rows 5-16 were slower than cuBLAS,
    as were wide layers (K of 4096 and more) at more than one row (benchmarks/RESULTS.md): the engine sends the
    latter elsewhere (`rows_limit`), and rows beyond 4 only where EngineConfig.small_m_rows asks or a wide layer's
    path measured faster (WIDE_LAYERS_MEASURED)."""
    if m <= FMA_MAX_ROWS and measured:
        tiles = FEW_ROWS_MEASURED.get(device_name(device), {}).get((triton.next_power_of_2(m), n, k))
        if tiles is not None:
            if tiles is CUBLAS:
                return tiles
            block_m = 16 if tiles.get("USE_DOT") else triton.next_power_of_2(m)  # the DOT form's tile is 16 rows
            return {"USE_DOT": False, "BLOCK_M": block_m, **tiles}
    sms = num_sms(device)
    narrow = triton.cdiv(n, 8) <= 4 * sms  # 8-feature tiles give at most four programs per SM
    if 2 <= m <= FMA_MAX_ROWS and k <= 1024 and (m == 2 or narrow):
        return dict(USE_DOT=False, ROW_LOOP=True, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=8 if narrow else 4,
                    BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    if m == 1 or (m <= FMA_MAX_ROWS and k > 1024):
        block_m = triton.next_power_of_2(m)
        if k >= 4096 and m == 1:
            block_k, warps, per_sm = 2048, 4, 2
        elif k > 1024:
            block_k, warps, per_sm = (2048 if m <= 2 else 1024), 8, 1
        else:
            block_k, warps, per_sm = triton.next_power_of_2(k), 4, 2
        block_n = max(1, 64 * 32 * warps // (block_k * block_m))
        while block_n > 2 and triton.cdiv(n, block_n) < per_sm * sms:
            block_n //= 2
        if k <= 1024 and block_k > 256 and triton.cdiv(n, block_n) > 4 * sms:  # (K <= 1024: one row only here)
            block_k //= 2
        return dict(USE_DOT=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if m <= FMA_MAX_ROWS:
        return dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=min(256, max(16, triton.next_power_of_2(k))),
                    num_warps=4, num_stages=5)
    return _dot_config(m, n, k, device)


# The DOT form at 5-64 rows, per GPU model and row tile (the rows padded to a power of two, at least 16): a measured
# tiling per (BLOCK_M, N, K), or else the rule's (BLOCK_N, BLOCK_K, num_warps, num_stages) and DOT_PROGRAMS_PER_SM.
# An entry is the `DOT_MEASURED = {...}` line of `benchmarks/gpu_small_m.py --shapes S --rows 16,64 --skip-count
# --sweep splitk` (per row tile and shape the tiling of least time summed over the row counts swept):
# - H100 (2026-11-28, `--shapes qwen3-0.6b,qwen3-8b --rows 5,16,64 --rows-for qwen3-8b=5`): Qwen3-0.6B's four
#   projections at 16- and 64-row tiles, Qwen3-8B's at 16; measured before the wide path, with the norm and
#   activation prologues that read every row whole (benchmarks/RESULTS.md, "Split K at 5-64 rows").
# - H200 (2026-11-29, `--shapes qwen3-0.6b --rows 16,32,64`): the wide path's forms (the norms reading their
#   statistics, gate_up with the activation as its epilogue, o_proj and down writing them; "The wide path").
# With either a draft's tree forward at 16-64 rows is no faster than through cuBLAS and the separate elementwise
# kernels, so EngineConfig.small_m_rows stays at 4. An entry may be CUBLAS (that product through cuBLAS and its
# separate kernel, the layer's others through the wide forms).
DOT_MEASURED: dict[str, dict[tuple[int, int, int], dict]] = {
    "NVIDIA H200": {
        (16, 4096, 1024): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=3),
        (16, 1024, 2048): dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=2, num_stages=3),
        (16, 6144, 1024): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3),
        (16, 1024, 3072): dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, num_warps=2, num_stages=3),
        (32, 4096, 1024): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3),
        (32, 1024, 2048): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3),
        (32, 6144, 1024): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3),
        (32, 1024, 3072): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=12, num_warps=4, num_stages=3),
        (64, 4096, 1024): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (64, 1024, 2048): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (64, 6144, 1024): dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=3),
        (64, 1024, 3072): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=6, num_warps=4, num_stages=3),
        # Qwen3-8B at 5 rows (a verify of k = 4), the wide forms against cuBLAS with the separate norm, activation or
        # add kernel, us: qkv 19.6 against 18.4 (so cuBLAS), o_proj 12.7 against 14.0, gate_up with its activation
        # 51.1 against 54.8, down 29.4 against 31.6 (`--shapes qwen3-8b --rows 5`, 2026-11-29).
        (16, 6144, 4096): CUBLAS,
        (16, 4096, 4096): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=3),
        (16, 24576, 4096): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3),
        (16, 4096, 12288): dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=2, num_stages=3),
    },
    "NVIDIA H100 80GB HBM3": {
        (16, 4096, 1024): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=3),
        (16, 1024, 2048): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, num_warps=4, num_stages=3),
        (16, 6144, 1024): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3),
        (16, 1024, 3072): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=12, num_warps=4, num_stages=3),
        (64, 4096, 1024): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (64, 1024, 2048): dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (64, 6144, 1024): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3),
        (64, 1024, 3072): dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=16, num_warps=4, num_stages=3),
        (16, 6144, 4096): dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3),
        (16, 4096, 4096): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=3),
        (16, 24576, 4096): dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3),
        (16, 4096, 12288): dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
    },
}
# (64-row tiles: BLOCK_K 64 keeps three float32 stages of both operands at 96 KB of shared memory.)
DOT_TILES = {16: (32, 128, 4, 3), 32: (32, 128, 4, 3), 64: (64, 64, 4, 3)}
DOT_PROGRAMS_PER_SM = 2


# Layers whose wide path (engine/models/llama.py `_forward_wide`: the four products in the wide forms, or cuBLAS where
# DOT_MEASURED says so) measured faster than cuBLAS and the separate elementwise kernels for the whole layer, per GPU
# model: the layer's (N, K) of qkv, o_proj, gate_up and down -> the rows up to which it takes that path past
# FMA_MAX_ROWS, whatever EngineConfig.small_m_rows (which caps wide layers at one row). A verify of k + 1 rows on
# an 8B target is such a step. Every product of an entry has its DOT_MEASURED tiling on the same GPU model.
# - H200, Qwen3-8B (2026-11-29, `python3 benchmarks/gpu_small_m.py --shapes qwen3-8b --rows 5,8,16 --skip-count`,
#   benchmarks/RESULTS.md "An 8B verify through the wide path"), us a layer against cuBLAS and the separate
#   kernels: 111.7 against 114.9 at 5 rows, 112.1 against 119.3 at 8, 115.6 against 114.0 at 16 (the tilings were
#   swept at 5 rows; at 16 gate_up and down lose), so up to 8 rows: a verify of k + 1 <= 8 tokens at batch 1.
WIDE_LAYERS_MEASURED: dict[str, dict[tuple[tuple[int, int], ...], int]] = {
    "NVIDIA H200": {((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)): 8},
}


# GPU models on which an FP8 model's layers take the folded products (engine/kernels/small_m/linear.py reading the FP8
# weights, tiles from fp8_tiles; a Llama-family layer through the wide path from one row) where they measured faster
# than the FP8 kernel (engine/quantization/fp8_linear.py) beside separate norm, activation and add kernels:
# `benchmarks/gpu_decode.py --shape qwen3-8b-fp8 --fp8-folded` against the same without. None yet. On an H100
# (2026-12-07, benchmarks/RESULTS.md "FP8 products: the K split summed in the same launch") the four products of a
# layer in the tl.dot form at fp8_tiles' tiling cost what the FP8 kernel's do (91.3 against 92.1 us at one row), but
# the Qwen3-8B block-FP8 step at batch 1 took 9.93 ms folded against 4.47 unfolded: its layers then took the few-row
# path, whose norm products walk the whole row for its statistics in every program. The wide path from one row, which
# removes that walk, has not been measured on a GPU. Under Triton's interpreter (tests/test_small_m_fp8.py) the layers
# fold.
FP8_FOLDED_MEASURED: set[str] = set()


def folds_fp8(device: torch.device) -> bool:
    """Whether an FP8 model's layers take the folded few-row products on this device (FP8_FOLDED_MEASURED)."""
    return device.type != "cuda" or device_name(device) in FP8_FOLDED_MEASURED


def wide_layer_rows(products: tuple[tuple[int, int], ...], device: torch.device) -> int:
    """Up to how many rows (past FMA_MAX_ROWS) a layer whose products have these (N, K) takes the wide path on this
    device by WIDE_LAYERS_MEASURED; 0: none (the engine's setting alone decides)."""
    return WIDE_LAYERS_MEASURED.get(device_name(device), {}).get(tuple(products), 0)


# FP8 weights at every row count (1-64): the tl.dot form on a 16-64-row tile, each weight tile converted to the
# activations' dtype and its partial product scaled (engine/kernels/small_m/parts.py). Swept on an H100 at one row
# (`python3 benchmarks/gpu_fp8.py --kernel folded --rows 1 --scales block`, Qwen3-8B's four products in 128 x 128
# blocks, benchmarks/RESULTS.md): 64 output features a program, K tiles of 128 (one scale group), 4 warps and 3
# stages were the best or within 4% of it for every product, with K split to about FP8_PROGRAMS_PER_SM programs a SM
# (qkv 4 ways, o_proj and down 8, gate_up none). The gated epilogue (glu) reads a gate and an up tile a step: 32
# features of each, the bytes of one 64-wide tile. The FMA forms' float32 multiply-adds read an FP8 byte at twice
# the instructions of a bf16 weight's two bytes ("FP8 weights in the folded few-row products"); they stay reachable
# through an explicit config.
FP8_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
FP8_PROGRAMS_PER_SM = 4


def fp8_tiles(m: int, n: int, k: int, group_k: int, device: torch.device, glu: bool = False) -> dict:
    """Tiles of an FP8 weight's product (small_m_linear with an FP8 weight's scales) at m rows: FP8_TILES on a row
    tile of m padded to a power of two (at least 16, tl.dot's least), the K tile narrowed to the scale groups'
    largest power of two (group_k; 0: a scale a row) and to K; K split, in a power of two of ranges, where the column
    tiles are fewer than FP8_PROGRAMS_PER_SM a SM (the last program to arrive sums the splits); glu: a [2 I, K]
    weight whose gate and up halves a program reads side by side (half the features of each, no split)."""
    block_k = min(FP8_TILES["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    if group_k:
        block_k = min(block_k, group_k & -group_k)
    block_n = FP8_TILES["BLOCK_N"] // (2 if glu else 1)
    tiles = triton.cdiv(n // (2 if glu else 1), block_n)
    most = min(triton.cdiv(k, block_k), FP8_PROGRAMS_PER_SM * num_sms(device) // tiles)
    split = 1 if glu or most < 2 else 1 << (most.bit_length() - 1)
    return {**FP8_TILES, "USE_DOT": True, "BLOCK_M": max(16, triton.next_power_of_2(m)), "BLOCK_N": block_n,
            "BLOCK_K": block_k, "SPLIT_K": split}


def _dot_config(m: int, n: int, k: int, device: torch.device, measured: bool = True) -> dict:
    """Rows 5-64: tl.dot on BLOCK_M-row tiles, K split so that the grid has about DOT_PROGRAMS_PER_SM programs per
    SM. Without the split a program owns BLOCK_N features and the whole K, and a 1024-wide projection (a 0.6B
    model's o_proj and down) gets 32-64 programs on 132 SMs: most of the GPU idles while they stream the weights.
    Each split streams a contiguous K range; the splits are made equal (a multiple of BLOCK_K each), none empty."""
    block_m, sms = max(16, triton.next_power_of_2(m)), num_sms(device)
    tiles = DOT_MEASURED.get(device_name(device), {}).get((block_m, n, k)) if measured else None
    if tiles is CUBLAS:
        return tiles
    if tiles is not None:
        return {"USE_DOT": True, "BLOCK_M": block_m, "SPLIT_K": 1, **tiles}
    block_n, block_k, warps, stages = DOT_TILES[block_m]
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split = min(triton.cdiv(k, block_k), max(1, triton.cdiv(DOT_PROGRAMS_PER_SM * sms, triton.cdiv(n, block_n))))
    return dict(USE_DOT=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                num_stages=stages)


def fit_stages(cfg: dict, elem_bytes: int, weight_tiles: int, device: torch.device) -> dict:
    """cfg with the DOT form's pipeline cut to stages that fit the device's shared memory at this element size. The
    tables were measured in bf16; a float32 product needs twice a stage's bytes, and gate_up with the gated epilogue
    streams two weight tiles (weight_tiles 2). The count is an upper bound (every stage's input and weight tiles),
    so a fitting tiling is never cut; one that does not fit at two stages is left to Triton's own error."""
    smem = _shared_memory(device) if device.type == "cuda" and cfg.get("USE_DOT") else 0
    if not smem:
        return cfg
    per_stage = (cfg["BLOCK_M"] + weight_tiles * cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem_bytes
    stages = cfg.get("num_stages", 3)
    while stages > 2 and stages * per_stage > smem:
        stages -= 1
    return cfg if stages == cfg.get("num_stages", 3) else {**cfg, "num_stages": stages}


def split_k_range(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, columns per split) for `split` programs over K: the K tiles shared out equally (the last split
    may be shorter), so no split is empty; (1, k) when the split is 1."""
    tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(tiles, max(1, min(split, tiles)))
    splits = triton.cdiv(tiles, per)
    return (1, k) if splits == 1 else (splits, per * block_k)
