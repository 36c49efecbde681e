"""The MoE experts of a few-row step (decode, a verify of k + 1 tokens a request, a draft's steps) in four Triton
kernels: gate_up, then its bias + activation, then down + bias + routing weight, one program per (routed row, output
tile, slice of K), then the sum over a token's experts; the weights in the model's dtype or MXFP4 (dequantized in the
kernel from the packed bytes: never a bf16 copy).

A routed row is one (token, expert) pair of the router's top-k, in the router's order: at a few rows the pairs rarely
share an expert, so grouping them buys nothing, and the grid is a host-side function of the token count (CUDA graphs
replay it with any routing). At one to a few rows a grid of (row, output tile) leaves most SMs idle, each program
walking all of K with a load in flight at a time, so K is split in slices (k_splits) whose partial sums a small
kernel adds (gate_up, then the bias and activation) or the final sum does (down).

The kernels write each pair's weighted output apart and the last kernel sums a token's slices and k pairs in a fixed
order and writes the token's output in the activations' dtype: deterministic, unlike atomics, and one launch where
torch's sum and cast were two. Summing at the last program to arrive at a counter instead (as the router and the
split-K products do), with the activation folded into gate_up the same way, measured slower on an H100: 68 against
66 us a layer at one token, 417 against 374 at eight, thousands of programs each paying a fence and an atomic.
Prefill-sized steps take another path (engine/models/moe.py), and the plain-torch reference of these kernels is
moe_experts_ref there.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_compat import (
    HAS_TRITON,
    interpreting,
    launch,
    require_triton,
    tl,
    triton,
    wait_for_previous_kernel,
)

__all__ = ["HAS_TRITON", "MAX_ROUTED_ROWS", "check_routed", "expert_operands", "moe_experts"]

MAX_ROUTED_ROWS = 64  # routed rows (tokens x top_k) up to which the model takes these kernels
# The launch's tiles: output features a program (BLOCK_N), inputs a step of its K walk (BLOCK_K, a multiple of
# MXFP4's 32-value block), warps, and the programs a launch aims for (about four per SM of an H100's 132, so the
# loads of many programs overlap), and whether MXFP4 is decoded by the PTX of _e2m1_ptx (where the kernels compile
# for a GPU; Triton's interpreter runs _e2m1), and the K walk's pipeline stages (above 1, the next steps' weight bytes
# are copied to shared memory asynchronously while a step computes). `moe_experts(tiles=...)` overrides them
# (benchmarks/gpu_moe.py sweeps them).
TILES = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "programs": 2112, "ptx": True, "stages": 1}


@triton.jit
def _load_weight(w_ptr, expert, rows, cols, mask, stride_we, stride_wr):
    """[R, C] float32 tile of expert `expert`'s [out, in] weight (in the model's dtype) at (rows, cols)."""
    return tl.load(w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wr + cols[None, :], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _e2m1(nib):
    """e2m1 codes (uint32, 0..15: sign bit 3, exponent bits 1-2, mantissa bit 0) -> float32 values / 2 ** 14, by
    bit pattern in three integer operations: placed at float16's sign and low exponent / top mantissa bits, a code
    is the float16 of its value times 2 ** -14 (exponent 0 lands on float16's subnormals, which are exact there);
    the caller folds the 2 ** 14 into the block's scale."""
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_ptx(byte):
    """(low, high) nibbles of uint8 `byte` -> float32 values / 2 ** 14, as _e2m1 gives them one code at a time.
    Four packed bytes (eight codes) a register ($8); $0-$3 the low nibbles of bytes 0-3, $4-$7 the high ones. Two
    codes at once: the same nibble of bytes 0 and 2 (or 1 and 3) moved to float16's sign and low exponent / top
    mantissa bits of the two halves of one register (shifts, masks and an or, which the compiler folds into LOP3s),
    each half then widened to float32: about 2.5 instructions a code against _e2m1's 8. The decode, not the
    memory, held the kernels at about 700 GB/s on an H100."""
    return tl.inline_asm_elementwise("""
{
.reg .b32 a, b, c, d, t;
.reg .b16 h<8>;
shl.b32 a, $8, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 t, $8, 12;
and.b32 t, t, 0x80008000;
or.b32 a, a, t;
shl.b32 b, $8, 5;
and.b32 b, b, 0x0E000E00;
shl.b32 t, $8, 8;
and.b32 t, t, 0x80008000;
or.b32 b, b, t;
shl.b32 c, $8, 1;
and.b32 c, c, 0x0E000E00;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80008000;
or.b32 c, c, t;
shr.b32 d, $8, 3;
and.b32 d, d, 0x0E000E00;
and.b32 t, $8, 0x80008000;
or.b32 d, d, t;
mov.b32 {h0, h1}, a;
mov.b32 {h2, h3}, b;
mov.b32 {h4, h5}, c;
mov.b32 {h6, h7}, d;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h4;
cvt.f32.f16 $2, h1;
cvt.f32.f16 $3, h5;
cvt.f32.f16 $4, h2;
cvt.f32.f16 $5, h6;
cvt.f32.f16 $6, h3;
cvt.f32.f16 $7, h7;
}
""", "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _packed_dot(blocks_ptr, scales_ptr, expert, rows, rows_ok, blocks_e, blocks_r, scales_e, scales_r, x_lo, x_hi,
                g, g_ok, PTX: tl.constexpr):
    """[BLOCK_N] sum over the 32-value blocks g of W[rows, 32 g:32 g + 32] . x, W decoded from MXFP4 in the kernel;
    x_lo / x_hi [G, 16]: x[32 g + 2 j] / x[32 g + 2 j + 1], against the low / high nibbles. Each block's sum is
    scaled once."""
    lo, hi = _packed_codes(blocks_ptr, expert, rows, rows_ok, blocks_e, blocks_r, g, g_ok, PTX)
    per_block = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)  # [N, G]
    # _e2m1's 2 ** 14 back on the block sums (not in the exponent: a scale of 241 or more would overflow there).
    return tl.sum(per_block * 16384.0 * _block_powers(scales_ptr, expert, rows, rows_ok, scales_e, scales_r, g, g_ok),
                  axis=1)


@triton.jit
def _blocks(k0, k_end, BLOCK_K: tl.constexpr):
    """The 32-value blocks g of a K step from k0 ([BLOCK_K / 32]) and which lie before k_end (K and its slices are
    whole MXFP4 blocks, so a block is in or out whole)."""
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    return g, g * 32 < k_end


@triton.jit
def _block_pairs(v_ptr, g, g_ok):
    """([G, 16], [G, 16]) float32 v[32 g + 2 j] and v[32 g + 2 j + 1]: a vector's values against the low and high
    nibbles of blocks g."""
    j = tl.arange(0, 16)
    p = v_ptr + g[:, None] * 32 + 2 * j[None, :]
    return (tl.load(p, mask=g_ok[:, None], other=0.0).to(tl.float32),
            tl.load(p + 1, mask=g_ok[:, None], other=0.0).to(tl.float32))


@triton.jit
def _packed_codes(blocks_ptr, expert, rows, rows_ok, blocks_e, blocks_r, g, g_ok, PTX: tl.constexpr):
    """Expert `expert`'s MXFP4 codes of W[rows, 32 g:32 g + 32] as (even k, odd k) float32 tiles [rows, G, 16] of
    their values / 2 ** 14 (_e2m1), low nibble first.

    The bytes are loaded as an [N, G, 16] tile, a block's 16 bytes a (row, g), and masked by block: each thread
    loads a block with one 16-byte load and (in _packed_dot) sums it in its registers. Loaded as [N, 16 G] and
    masked by code, the same tile went out as one-byte loads and was moved between threads for the blocks' sums:
    about 9 instructions a weight in the compiled loop for an H100, against 5.5 in this form."""
    offs = rows[:, None, None] * blocks_r + g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    byte = tl.load(blocks_ptr + expert.to(tl.int64) * blocks_e + offs,
                   mask=rows_ok[:, None, None] & g_ok[None, :, None], other=0)  # [N, G, 16] uint8
    if PTX:
        lo, hi = _e2m1_ptx(byte)
    else:
        lo, hi = _e2m1(byte.to(tl.uint32) & 15), _e2m1(byte.to(tl.uint32) >> 4)
    return lo, hi


@triton.jit
def _block_powers(scales_ptr, expert, rows, rows_ok, scales_e, scales_r, g, g_ok):
    """[rows, G] float32 2 ** (scale - 127) of each 32-value block g of W[rows] (e8m0)."""
    scale = tl.load(scales_ptr + expert.to(tl.int64) * scales_e + rows[:, None] * scales_r + g[None, :],
                    mask=rows_ok[:, None] & g_ok[None, :], other=127).to(tl.float32)
    return tl.exp2(scale - 127.0)


@triton.jit
def _gate_up_rows(n, inter, OAI: tl.constexpr):
    """The gate_up weight rows of intermediate features n: GPT-OSS interleaves them (gate 2n, up 2n + 1); otherwise
    gate is row n and up row I + n."""
    if OAI:
        g_rows = 2 * n
        u_rows = 2 * n + 1
    else:
        g_rows = n
        u_rows = inter + n
    return g_rows, u_rows


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, blocks_ptr, scales_ptr, part_ptr, top_k, hidden, inter, rows, k_slice,
                    stride_xt, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r,
                    PACKED: tl.constexpr, OAI: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PTX: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """Gate and up partial sums of one routed row over one slice of K: part[s, 0 | 1, row, n]."""
    wait_for_previous_kernel(USE_PDL)  # first: x and the expert ids are the kernels' before (the router's)
    row = tl.program_id(0).to(tl.int64)  # routed row: token * top_k + j
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate features
    s = tl.program_id(2).to(tl.int64)  # the K slice
    n_ok = n < inter
    expert = tl.load(ids_ptr + row)
    token = row // top_k
    g_rows, u_rows = _gate_up_rows(n, inter, OAI)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(s * k_slice + k_slice, hidden)
    x_row = x_ptr + token * stride_xt
    for k0 in tl.range(s * k_slice, k_end, BLOCK_K, num_stages=STAGES):
        if PACKED:
            g, g_ok = _blocks(k0, k_end, BLOCK_K)
            x_lo, x_hi = _block_pairs(x_row, g, g_ok)
            acc_g += _packed_dot(blocks_ptr, scales_ptr, expert, g_rows, n_ok, blocks_e, blocks_r, scales_e,
                                 scales_r, x_lo, x_hi, g, g_ok, PTX)
            acc_u += _packed_dot(blocks_ptr, scales_ptr, expert, u_rows, n_ok, blocks_e, blocks_r, scales_e,
                                 scales_r, x_lo, x_hi, g, g_ok, PTX)
        else:
            k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = k < k_end
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            mask = n_ok[:, None] & k_ok[None, :]
            acc_g += tl.sum(_load_weight(w_ptr, expert, g_rows, k, mask, stride_we, stride_wr) * x[None, :], 1)
            acc_u += tl.sum(_load_weight(w_ptr, expert, u_rows, k, mask, stride_we, stride_wr) * x[None, :], 1)
    out = part_ptr + (s * 2 * rows + row) * inter + n
    tl.store(out, acc_g, mask=n_ok)
    tl.store(out + rows * inter, acc_u, mask=n_ok)


@triton.jit
def _act_kernel(part_ptr, ids_ptr, bias_ptr, act_ptr, inter, rows, splits, alpha, limit, stride_be,
                HAS_BIAS: tl.constexpr, OAI: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """act[row, n] from the K slices' gate and up partial sums (added in slice order), the bias and the activation."""
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(0, splits):
        p = part_ptr + (s * 2 * rows + row) * inter + n
        acc_g += tl.load(p, mask=n_ok, other=0.0)
        acc_u += tl.load(p + rows * inter, mask=n_ok, other=0.0)
    g_rows, u_rows = _gate_up_rows(n, inter, OAI)
    if HAS_BIAS:
        b = bias_ptr + tl.load(ids_ptr + row).to(tl.int64) * stride_be
        acc_g += tl.load(b + g_rows, mask=n_ok, other=0.0).to(tl.float32)
        acc_u += tl.load(b + u_rows, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(act_ptr + row * inter + n, _activation(acc_g, acc_u, alpha, limit, OAI), mask=n_ok)


@triton.jit
def _activation(gate, up, alpha, limit, OAI: tl.constexpr):
    """The experts' activation of float32 gate and up sums: GPT-OSS's (gate clamped from above, up both sides,
    (up + 1) * gate * sigmoid(alpha * gate)), else silu(gate) * up."""
    if OAI:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    else:
        out = gate * tl.sigmoid(gate) * up
    return out


@triton.jit
def _down_kernel(act_ptr, ids_ptr, route_w_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, y_ptr, hidden, inter,
                 rows, k_slice, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, stride_be,
                 PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PTX: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """One K slice's weighted partial sum of one routed row's down projection: y[s, row, n] (the bias in slice 0)."""
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden features
    s = tl.program_id(2).to(tl.int64)
    n_ok = n < hidden
    expert = tl.load(ids_ptr + row)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(s * k_slice + k_slice, inter)
    a_row = act_ptr + row * inter
    for k0 in tl.range(s * k_slice, k_end, BLOCK_K, num_stages=STAGES):
        if PACKED:
            g, g_ok = _blocks(k0, k_end, BLOCK_K)
            a_lo, a_hi = _block_pairs(a_row, g, g_ok)
            acc += _packed_dot(blocks_ptr, scales_ptr, expert, n, n_ok, blocks_e, blocks_r, scales_e, scales_r, a_lo,
                               a_hi, g, g_ok, PTX)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            a = tl.load(a_row + k, mask=k_ok, other=0.0)  # [BLOCK_K] float32
            acc += tl.sum(_load_weight(w_ptr, expert, n, k, n_ok[:, None] & k_ok[None, :], stride_we, stride_wr)
                          * a[None, :], 1)
    if HAS_BIAS:
        first = (s == 0).to(tl.float32)
        acc += first * tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
    acc = acc * tl.load(route_w_ptr + row).to(tl.float32)
    tl.store(y_ptr + (s * rows + row) * hidden + n, acc, mask=n_ok)


SUM_BLOCK = 1024  # hidden features a program of _sum_pairs_kernel sums


@triton.jit
def _sum_pairs_kernel(y_ptr, out_ptr, rows, top_k, splits, hidden, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[token, n] = sum over the token's top_k pairs (in the router's order), each over its K slices (in order),
    of y[s, row, n], in out's dtype."""
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, top_k):
        for i in range(0, splits):
            acc += tl.load(y_ptr + (i * rows + token * top_k + j) * hidden + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + token * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def check_routed(name: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: torch.nn.Module
                 ) -> None:
    """Raise ValueError unless x is [T, H] and weights and ids [T, top_k] for `experts`; Triton must be there."""
    require_triton(name, x, weights, ids)
    t, h = x.shape
    if weights.shape != ids.shape or ids.shape[0] != t or h != experts.hidden_size:
        raise ValueError(f"{name}: x [T, {experts.hidden_size}], weights and ids [T, top_k], got "
                         f"{tuple(x.shape)}, {tuple(weights.shape)} and {tuple(ids.shape)}")


def expert_operands(experts: torch.nn.Module, name: str) -> tuple:
    """(weight, blocks, scales, their strides) of projection `name` of FusedExperts `experts`, for the kernels'
    arguments: the unused pointers alias a used tensor."""
    if experts.packed:
        blocks, scales = getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales")
        return blocks, blocks, scales, 0, 0, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1)
    w = getattr(experts, name)
    return w, w, w, w.stride(0), w.stride(1), 0, 0, 0, 0


def packed_on_gpu(x: torch.Tensor) -> bool:
    """Whether the kernels compile for a GPU here (PTX runs), not under Triton's interpreter."""
    return x.device.type == "cuda" and not interpreting()


def k_splits(rows: int, n_tiles: int, k: int, block_k: int = TILES["BLOCK_K"],
             target: int = TILES["programs"]) -> int:
    """Slices of K for a grid of rows x n_tiles programs: enough for about `target` programs (a few rows' grid alone
    leaves most SMs idle and each program a long serial walk over K), at most one BLOCK_K step a slice."""
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(target, rows * n_tiles)))


def moe_experts(x: torch.Tensor,  # [T, H]
                weights: torch.Tensor,  # [T, top_k] routing weights
                ids: torch.Tensor,  # [T, top_k] expert ids
                experts: torch.nn.Module,  # engine.models.moe.FusedExperts
                num_splits: tuple[int, int] | None = None, tiles: dict | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] in x's dtype (float32 inside). num_splits: the
    slices of K of (gate_up, down); None: k_splits's. The slices' partial sums are added in a fixed order.
    tiles: TILES's keys to override."""
    check_routed("moe_experts", x, weights, ids, experts)
    t, h = x.shape
    top_k = ids.shape[1]
    rows, inter = t * top_k, experts.intermediate_size
    x = x.contiguous()
    ids_flat, w_flat = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    if rows == 0:
        return torch.zeros_like(x)
    cfg = {**TILES, **(tiles or {})}
    block_n, block_k, warps, stages = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["stages"]
    if block_k % 32 or block_k & (block_k - 1) or block_n & (block_n - 1):
        raise ValueError(f"moe_experts: BLOCK_K a power of two and a multiple of 32, BLOCK_N a power of two; got "
                         f"{block_k} and {block_n}")
    ptx = bool(cfg["ptx"]) and packed_on_gpu(x)
    gu_tiles, down_tiles = triton.cdiv(inter, block_n), triton.cdiv(h, block_n)
    s_gu, s_down = num_splits or (k_splits(rows, gu_tiles, h, block_k, cfg["programs"]),
                                  k_splits(rows, down_tiles, inter, block_k, cfg["programs"]))
    # Each slice a whole number of BLOCK_K steps, so no step straddles two slices.
    slice_gu = triton.cdiv(triton.cdiv(h, s_gu), block_k) * block_k
    slice_down = triton.cdiv(triton.cdiv(inter, s_down), block_k) * block_k
    part = torch.empty(s_gu, 2, rows, inter, dtype=torch.float32, device=x.device)
    act = torch.empty(rows, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(s_down, rows, h, dtype=torch.float32, device=x.device)
    packed, has_bias, oai = experts.packed, experts.gate_up_proj_bias is not None, experts.activation == "swiglu_oai"

    gu, down = expert_operands(experts, "gate_up_proj"), expert_operands(experts, "down_proj")
    gu_bias = experts.gate_up_proj_bias if has_bias else act
    down_bias = experts.down_proj_bias if has_bias else act
    launch(_gate_up_kernel, (rows, gu_tiles, s_gu), x.device,
           x, ids_flat, gu[0], gu[1], gu[2], part, top_k, h, inter, rows, slice_gu, x.stride(0), *gu[3:],
           PACKED=packed, OAI=oai, BLOCK_N=block_n, BLOCK_K=block_k, PTX=ptx, STAGES=stages, num_warps=warps)
    launch(_act_kernel, (rows, gu_tiles), x.device,
           part, ids_flat, gu_bias, act, inter, rows, s_gu, float(experts.alpha), float(experts.limit),
           gu_bias.stride(0), HAS_BIAS=has_bias, OAI=oai, BLOCK_N=block_n, num_warps=warps)
    launch(_down_kernel, (rows, down_tiles, s_down), x.device,
           act, ids_flat, w_flat, down[0], down[1], down[2], down_bias, y, h, inter, rows, slice_down, *down[3:],
           down_bias.stride(0), PACKED=packed, HAS_BIAS=has_bias, BLOCK_N=block_n, BLOCK_K=block_k, PTX=ptx,
           STAGES=stages, num_warps=warps)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    launch(_sum_pairs_kernel, (t, triton.cdiv(h, SUM_BLOCK)), x.device, y, out, t * top_k, top_k, s_down, h,
           BLOCK=SUM_BLOCK, num_warps=4)
    return out
