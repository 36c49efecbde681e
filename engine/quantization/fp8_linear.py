"""y = x (W * s)^T + b for an FP8 weight W [N, K] with float32 scales s [N, G] over groups of `group_k` columns
(engine/quantization/fp8.py holds every FP8 scheme that way).

Decode, verify and draft steps run a Triton kernel that reads W as FP8, one byte a weight, and applies each group's
scales to its partial products in the kernel: a step of a few rows is bound by the weight bytes it reads, and one of
more reads W once per 64 rows (kernel_rows: up to 64 rows with a scale a row, 256 with block scales). More rows on a
GPU: with a scale a row, the FP8 tensor cores through torch._scaled_mm, the activations quantized to FP8 per token
at run time (what a compressed-tensors FP8-dynamic checkpoint asks for); with block scales, W dequantized to the
activations' dtype and one matmul. Off the GPU (and for the reference) the weight is dequantized in plain torch, the
activations kept as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kernels.e4m3 import e4m3_to_bf16
from engine.kernels.small_m.arrival_counters import arrival_counters, sum_splits
from engine.kernels.small_m.tiles import split_k_range
from engine.kernels.triton_compat import HAS_TRITON, interpreting

# Rows up to which a GPU forward runs the kernel for block scales; beyond, dequantize and matmul (a prefill's cost is
# the matmul). The kernel reads W once per MAX_BLOCK_M rows: at 256 rows four times, still less than a dequantized
# copy's bytes (written, then read: 4 bytes a weight). A scale a row takes the kernel up to MAX_BLOCK_M rows only
# (kernel_rows): past them torch._scaled_mm reads W once. Capped at 16 rows before, a verify of 8 requests at k = 4
# (40 rows) of a Qwen3-8B shape in block FP8 ran 87 ms on an H100, dequantizing every weight each step.
FEW_ROWS = 256
MAX_BLOCK_M = 64

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, G, group_k, k_slice,
                           num_splits, stride_xm, stride_wn, stride_sn, stride_om, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, SPLIT: tl.constexpr, W_PTX: tl.constexpr):
        """One program a BLOCK_N slice of the outputs for BLOCK_M rows over one slice of K; each BLOCK_K step lies in
        one scale group (BLOCK_K divides group_k, or G is 1), so the group's scales multiply the step's partial
        products. SPLIT: the slice's float32 partial sums go to part[slice], and the program that arrives last at
        its output tile's counter (engine/kernels/small_m/arrival_counters.py) adds the slices in order (the result
        does not depend on which arrived last) and sets the counter back to 0. The output, with the bias, in out's
        dtype. W_PTX: bfloat16 activations, the weight converted by e4m3_to_bf16."""
        pid = tl.program_id(0)
        sl = tl.program_id(1)
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum(sl * k_slice + k_slice, K)
        for k0 in range(sl * k_slice, k_end, BLOCK_K):
            k = k0 + rk
            k_ok = k < k_end
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # The weight as bytes, read as float8_e4m3fn: every FP8 value is exact in the activations' dtype.
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            if W_PTX:
                w = e4m3_to_bf16(w)
            else:
                w = w.to(tl.float8e4nv, bitcast=True).to(x.dtype)
            g = tl.minimum(k0 // group_k, G - 1)
            s = tl.load(s_ptr + rn * stride_sn + g, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION) * s[None, :]
        out_mask = m_ok[:, None] & n_ok[None, :]
        last = True
        if SPLIT:
            last, acc = sum_splits(acc, part_ptr, count_ptr, tl.program_id(2) * tl.num_programs(0) + pid, sl,
                                   num_splits, rm[:, None] * N + rn[None, :], out_mask, M * N)
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _block_k(group_k: int, groups: int, most: int = 128) -> int:
    """The K step: `most` at most, and within one scale group (it divides group_k) unless one group spans K."""
    if groups == 1:
        return most
    for b in (512, 256, 128, 64, 32, 16):
        if b <= most and group_k % b == 0:
            return b
    raise ValueError(f"FP8 scale groups of {group_k} columns: the kernel needs a multiple of 16")


# The launch's tiles: output features a program (BLOCK_N), the largest K step (BLOCK_K; within a scale group),
# warps, pipeline stages, and the programs a launch aims for (about four per SM of an H100; fewer output tiles than
# that split K in slices). `fp8_linear_kernel(tiles=...)` overrides them (benchmarks/gpu_fp8.py sweeps them).
TILES = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "programs": 528, "ptx": True}


def fp8_linear_kernel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
                      bias: torch.Tensor | None = None, num_splits: int | None = None, tiles: dict | None = None
                      ) -> torch.Tensor:
    """x [M, K] (M <= FEW_ROWS; bf16, fp16 or float32), weight [N, K] float8_e4m3fn, scale [N, G] float32 ->
    [M, N] in x's dtype, through the Triton kernel. num_splits: slices of K (None: enough for about TILES's
    programs), their partial sums added in order by the program that finishes last, in the same launch. tiles:
    TILES's keys to override."""
    m, k = x.shape
    n = weight.shape[0]
    if m > FEW_ROWS:
        raise ValueError(f"the FP8 few-row kernel takes at most {FEW_ROWS} rows, got {m}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    groups = scale.shape[1]
    cfg = {**TILES, **(tiles or {})}
    block_n = cfg["BLOCK_N"]
    block_k = _block_k(group_k, groups, cfg["BLOCK_K"])
    n_tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    # One block of rows where they fit (W read once), else blocks of MAX_BLOCK_M (tl.dot's least M is 16).
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    splits = num_splits or max(1, min(steps, cfg["programs"] // (n_tiles * m_blocks)))
    splits, k_slice = split_k_range(k, block_k, splits)  # whole steps a slice (none straddles two), none empty
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    counts = arrival_counters(x.device, n_tiles * m_blocks) if splits > 1 else out
    # Launched the ordinary way, not as a programmatic dependent: with dependent launch a Qwen3-8B FP8 step measured
    # 1.6% faster at batch 1 and 5% slower at batch 8 on an H100 (benchmarks/RESULTS.md).
    _fp8_linear_kernel[(n_tiles, splits, m_blocks)](
        x, weight.view(torch.uint8), scale, bias if bias is not None else scale, out, part, counts, m, n, k, groups,
        group_k, k_slice, splits, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits > 1,
        W_PTX=bool(cfg["ptx"]) and x.dtype == torch.bfloat16 and x.is_cuda and not interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        # float32 activations: products in IEEE float32, as the reference's matmul (tl.dot would round them to TF32);
        # the 16-bit types are exact in either.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch reference: dequantize to x's dtype (scales applied in float32), then one matmul."""
    s = scale.repeat_interleave(group_k, dim=1)[:, :weight.shape[1]]
    w = (weight.float() * s).to(x.dtype)
    return F.linear(x, w, bias)


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) with a weight of one scale a row (scale [N, 1]) -> [M, N] in x's dtype: x quantized
    to FP8 per token (a scale a row, its largest magnitude at the FP8 maximum), then one FP8 matmul that applies
    both scales (torch._scaled_mm, row-wise scaling). K and N must be multiples of 16."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    xs = (x.abs().amax(dim=1, keepdim=True).float() / fp8_max).clamp(min=1e-12)  # [M, 1] float32
    xq = (x.float() / xs).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    # weight.t(): the [K, N] operand column-major, as _scaled_mm wants its second one.
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.reshape(1, -1), bias=bias,
                            out_dtype=x.dtype)


@functools.cache
def _has_fp8(device: torch.device) -> bool:
    """Whether the GPU converts and multiplies FP8 (compute capability 8.9 and up: Ada, Hopper, ...)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (x.is_cuda and _has_fp8(x.device) and scale.shape[1] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def steps_within_groups(scale: torch.Tensor, group_k: int) -> bool:
    """Whether a few-row kernel's K steps can each lie within one scale group of these scales [N, G]: a scale a row,
    or groups of a multiple of 16 columns (the least K step)."""
    return scale.shape[1] == 1 or group_k % 16 == 0


def kernel_rows(scale: torch.Tensor) -> int:
    """Rows up to which fp8_linear takes the kernel for a weight of these scales [N, G]: MAX_BLOCK_M (one read of W)
    for a scale a row, whose more rows go to torch._scaled_mm's FP8 tensor cores (one read of W too); FEW_ROWS for
    block scales, whose more rows are dequantized whole."""
    return MAX_BLOCK_M if scale.shape[1] == 1 else FEW_ROWS


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the kernel up to kernel_rows rows on a GPU (or under Triton's interpreter); more on a GPU
    through the FP8 tensor cores where the scales are a row's (else dequantized); off the GPU the dequantizing
    reference."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    kernel_groups = steps_within_groups(scale, group_k)
    on_kernels = interpreting() or (x.is_cuda and _has_fp8(x.device))
    rows = x2.shape[0]
    if HAS_TRITON and on_kernels and 0 < rows <= kernel_rows(scale) and kernel_groups:
        out = fp8_linear_kernel(x2, weight, scale, group_k, bias)
    elif rows > MAX_BLOCK_M and _scaled_mm_fits(x2, weight, scale):
        out = fp8_linear_scaled_mm(x2.contiguous(), weight, scale, bias)
    else:
        out = fp8_linear_ref(x2, weight, scale, group_k, bias)
    return out.reshape(*lead, weight.shape[0])
