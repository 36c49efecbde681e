"""The MoE experts of a step with many routed rows (a verify of several requests, a batch of decodes of a top-8
model, a prefill chunk inside a CUDA graph) in two Triton kernels over the rows grouped by expert: gate_up with its
bias and activation, then down with its bias and routing weight. A program takes GROUP rows of one expert and one
output tile, and loads (and, for MXFP4, decodes) each weight tile once for all of them, on the tensor cores.

engine/kernels/moe/small_m.py walks one routed row a program: at a few rows that spreads a step over every SM, but
each row re-reads its expert, so its time grows with the rows (on an H100 at gpt-oss-20b's shape: 63 us at 4 rows,
740 us at 64, 2.8 ms at 256). Here the time grows with the experts the rows touch.

The grouping runs on the device with shapes fixed by the row count (`align_rows`): no host sync, so a CUDA graph
replays it with any routing. Each expert's rows are padded to whole groups; a program of a padding slot or of an
unused block does nothing. Each routed row's output is written apart and a token's top_k rows are summed in a fixed
order afterwards (deterministic, unlike atomics). The plain-torch reference is engine/models/moe.py's
moe_experts_ref, as for the few-row kernels.
"""

from __future__ import annotations

import torch

from engine.kernels.moe.small_m import (
    _activation,
    _block_powers,
    _blocks,
    _gate_up_rows,
    _packed_codes,
    check_routed,
    expert_operands,
    packed_on_gpu,
)
from engine.kernels.triton_compat import launch, tl, triton, wait_for_previous_kernel

__all__ = ["GROUP", "TILES", "align_rows", "moe_experts_grouped"]

GROUP = 16  # routed rows a program: the least M of a tensor-core product
# Output features a program (BLOCK_N), inputs a step of its K walk (BLOCK_K: a multiple of MXFP4's 32-value block),
# warps: the tiling the GPU tests ran. On an H100, 64 x 128 measured 3-25% faster at 64-1280 routed rows (Qwen3-30B-A3B
# in bf16, gpt-oss-20b in MXFP4) and 128 x 128 fastest at 256-1280, but 128 x 128 in bf16 overflowed shared memory at
# gpt-oss's shape; neither has run the GPU tests yet. `moe_experts_grouped(tiles=...)` overrides them
# (benchmarks/gpu_moe.py sweeps them).
TILES = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
# Shared memory a launch's pipelined tiles may take (an H100 has 227 KB a block; Triton adds layout buffers).
_STAGE_BYTES = 120_000


def align_rows(ids: torch.Tensor,  # [R] int expert of each routed row
               num_experts: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed rows grouped by expert in blocks of `group` slots, each expert's rows padded to whole blocks:
    (slot_rows [num_blocks * group] int32, the routed row in each slot or -1; block_expert [num_blocks] int32, the
    expert of each block or -1 past the last). num_blocks = cdiv(R, group) + min(R, num_experts), a bound from R
    alone (each touched expert pads less than one block). Rows keep their order within an expert. No host sync, no
    sort: a row's place in its expert's run is a running count."""
    r = ids.numel()
    dev = ids.device
    num_blocks = triton.cdiv(r, group) + min(r, num_experts)
    flat = ids.reshape(-1).long()
    onehot = torch.zeros(r, num_experts, dtype=torch.int32, device=dev).scatter_(1, flat[:, None], 1)
    running = onehot.cumsum(0, dtype=torch.int32)  # [R, E]: rows of each expert up to and with this one
    counts = running[-1]  # [E]
    padded = (counts + group - 1) // group * group
    ends = padded.cumsum(0, dtype=torch.int32)  # [E] end slot of each expert's run
    starts = ends - padded
    place = running.gather(1, flat[:, None])[:, 0] - 1  # [R] the row's index among its expert's rows
    slot_rows = torch.full((num_blocks * group,), -1, dtype=torch.int32, device=dev)
    slot_rows[starts[flat] + place] = torch.arange(r, dtype=torch.int32, device=dev)
    first_slot = torch.arange(num_blocks, dtype=torch.int32, device=dev) * group
    block_expert = torch.searchsorted(ends, first_slot, right=True).to(torch.int32)  # the run that holds the slot
    block_expert = torch.where(first_slot < ends[-1], block_expert, -1)
    return slot_rows, block_expert


@triton.jit
def _packed_tile(blocks_ptr, scales_ptr, expert, rows, rows_ok, blocks_e, blocks_r, scales_e, scales_r, k0, k_end,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, DTYPE: tl.constexpr):
    """Expert `expert`'s weights W[rows, k0:k0 + BLOCK_K] decoded from MXFP4 and scaled, as (even k, odd k) tiles
    [BLOCK_N, BLOCK_K / 2] in DTYPE: e2m1 times a power of two is exact in bfloat16 and float32."""
    g, g_ok = _blocks(k0, k_end, BLOCK_K)
    lo, hi = _packed_codes(blocks_ptr, expert, rows, rows_ok, blocks_e, blocks_r, g, g_ok, PTX)
    # _e2m1's 2 ** 14 back on the codes first: folded into the power, a scale of 241 or more would overflow it.
    f = _block_powers(scales_ptr, expert, rows, rows_ok, scales_e, scales_r, g, g_ok)[:, :, None]
    lo = tl.reshape(lo * 16384.0 * f, (BLOCK_N, BLOCK_K // 2))
    hi = tl.reshape(hi * 16384.0 * f, (BLOCK_N, BLOCK_K // 2))
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _rows_times(a_ptr, a_rows, a_ok, stride_a, w_ptr, blocks_ptr, scales_ptr, expert, rows, rows_ok, k0, k_end,
                stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, PACKED: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, DTYPE: tl.constexpr,
                PRECISION: tl.constexpr):
    """[GROUP, BLOCK_N] sum over k in [k0, k0 + BLOCK_K) of A[a_rows, k] * W[rows, k], W expert `expert`'s."""
    if PACKED:
        even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        base = a_ptr + a_rows[:, None].to(tl.int64) * stride_a
        a_lo = tl.load(base + even[None, :], mask=a_ok[:, None] & (even < k_end)[None, :], other=0.0).to(DTYPE)
        a_hi = tl.load(base + even[None, :] + 1, mask=a_ok[:, None] & (even + 1 < k_end)[None, :],
                       other=0.0).to(DTYPE)
        w_lo, w_hi = _packed_tile(blocks_ptr, scales_ptr, expert, rows, rows_ok, blocks_e, blocks_r, scales_e,
                                  scales_r, k0, k_end, BLOCK_N, BLOCK_K, PTX, DTYPE)
        return (tl.dot(a_lo, tl.trans(w_lo), input_precision=PRECISION)
                + tl.dot(a_hi, tl.trans(w_hi), input_precision=PRECISION))
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < k_end
    a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_a + k[None, :], mask=a_ok[:, None] & k_ok[None, :],
                other=0.0).to(DTYPE)
    w = tl.load(w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wr + k[None, :],
                mask=rows_ok[:, None] & k_ok[None, :], other=0.0).to(DTYPE)
    return tl.dot(a, tl.trans(w), input_precision=PRECISION)


@triton.jit
def _block(slot_rows_ptr, block_expert_ptr, GROUP_M: tl.constexpr):
    """This program's block (program_id 0): its expert (-1: unused), its slots, the routed row in each (-1:
    padding) and which hold one."""
    b = tl.program_id(0)
    slots = b * GROUP_M + tl.arange(0, GROUP_M)
    row = tl.load(slot_rows_ptr + slots)
    return tl.load(block_expert_ptr + b), slots, row, row >= 0


@triton.jit
def _gate_up_act_kernel(x_ptr, slot_rows_ptr, block_expert_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr, act_ptr,
                        top_k, hidden, inter, alpha, limit, stride_xt, stride_we, stride_wr, blocks_e, blocks_r,
                        scales_e, scales_r, stride_be, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        OAI: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PTX: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """act[slot, n] of one block of GROUP_M slots (one expert's rows) and one tile of intermediate features."""
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    expert, slots, row, row_ok = _block(slot_rows_ptr, block_expert_ptr, GROUP_M)
    if expert >= 0:
        token = tl.where(row_ok, row // top_k, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        g_rows, u_rows = _gate_up_rows(n, inter, OAI)
        acc_g = tl.zeros([GROUP_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([GROUP_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            acc_g += _rows_times(x_ptr, token, row_ok, stride_xt, w_ptr, blocks_ptr, scales_ptr, expert, g_rows, n_ok,
                                 k0, hidden, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, PACKED,
                                 BLOCK_N, BLOCK_K, PTX, DTYPE, PRECISION)
            acc_u += _rows_times(x_ptr, token, row_ok, stride_xt, w_ptr, blocks_ptr, scales_ptr, expert, u_rows, n_ok,
                                 k0, hidden, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, PACKED,
                                 BLOCK_N, BLOCK_K, PTX, DTYPE, PRECISION)
        if HAS_BIAS:
            bias = bias_ptr + expert.to(tl.int64) * stride_be
            acc_g += tl.load(bias + g_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias + u_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = _activation(acc_g, acc_u, alpha, limit, OAI)
        tl.store(act_ptr + slots[:, None].to(tl.int64) * inter + n[None, :], out.to(DTYPE),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, slot_rows_ptr, block_expert_ptr, route_w_ptr, w_ptr, blocks_ptr, scales_ptr, bias_ptr,
                 y_ptr, hidden, inter, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, stride_be,
                 PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PTX: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """y[row, n] = routing weight * (down(act[slot]) + bias) of one block's rows and one tile of hidden features."""
    wait_for_previous_kernel(USE_PDL)  # first: see triton_compat (programmatic dependent launch)
    expert, slots, row, row_ok = _block(slot_rows_ptr, block_expert_ptr, GROUP_M)
    if expert >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        acc = tl.zeros([GROUP_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            acc += _rows_times(act_ptr, slots, row_ok, inter, w_ptr, blocks_ptr, scales_ptr, expert, n, n_ok, k0,
                               inter, stride_we, stride_wr, blocks_e, blocks_r, scales_e, scales_r, PACKED, BLOCK_N,
                               BLOCK_K, PTX, DTYPE, PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        safe = tl.where(row_ok, row, 0).to(tl.int64)
        acc = acc * tl.load(route_w_ptr + safe, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + safe[:, None] * hidden + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _stages(block_n: int, block_k: int, packed: bool, itemsize: int) -> int:
    """Software-pipeline stages (Triton's default 3 at most) whose tiles fit _STAGE_BYTES: a stage holds the gate
    and up weight tiles (bytes where packed) and the rows' inputs. bf16 tiles of 128 x 128 asked for 272 KB at
    Triton's default on an H100, and failed to launch."""
    weights = 2 * block_n * (block_k // 2 if packed else block_k * itemsize)
    return max(1, min(3, _STAGE_BYTES // (weights + GROUP * block_k * itemsize)))


def moe_experts_grouped(x: torch.Tensor,  # [T, H]
                        weights: torch.Tensor,  # [T, top_k] routing weights
                        ids: torch.Tensor,  # [T, top_k] expert ids
                        experts: torch.nn.Module,  # engine.models.moe.FusedExperts
                        tiles: dict | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] in x's dtype: the products in x's dtype on the tensor
    cores (float32 ones exact: input_precision "ieee"), accumulated in float32; the activation rounded to x's dtype
    between the two. tiles: TILES's keys to override."""
    check_routed("moe_experts_grouped", x, weights, ids, experts)
    t, h = x.shape
    top_k = ids.shape[1]
    if x.dtype not in _DTYPES:
        raise ValueError(f"moe_experts_grouped: x in {sorted(str(d) for d in _DTYPES)}, got {x.dtype}")
    rows, inter = t * top_k, experts.intermediate_size
    if rows == 0:
        return torch.zeros_like(x)
    cfg = {**TILES, **(tiles or {})}
    block_n, block_k, warps = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    if block_k % 32 or block_k & (block_k - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"moe_experts_grouped: BLOCK_K a power of two and a multiple of 32, BLOCK_N a power of two "
                         f">= 16; got {block_k} and {block_n}")
    x = x.contiguous()
    slot_rows, block_expert = align_rows(ids, experts.num_experts)
    num_blocks = block_expert.shape[0]
    act = torch.empty(num_blocks * GROUP, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, h, dtype=torch.float32, device=x.device)
    packed, has_bias, oai = experts.packed, experts.gate_up_proj_bias is not None, experts.activation == "swiglu_oai"
    ptx = packed_on_gpu(x)
    dtype = _DTYPES[x.dtype]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # "tf32" only names the default for 16-bit inputs

    gu, down = expert_operands(experts, "gate_up_proj"), expert_operands(experts, "down_proj")
    gu_bias = experts.gate_up_proj_bias if has_bias else y
    down_bias = experts.down_proj_bias if has_bias else y
    common = dict(PACKED=packed, HAS_BIAS=has_bias, GROUP_M=GROUP, BLOCK_N=block_n, BLOCK_K=block_k, PTX=ptx,
                  DTYPE=dtype, PRECISION=precision, num_warps=warps,
                  num_stages=_stages(block_n, block_k, packed, x.element_size()))
    launch(_gate_up_act_kernel, (num_blocks, triton.cdiv(inter, block_n)), x.device,
           x, slot_rows, block_expert, gu[0], gu[1], gu[2], gu_bias, act, top_k, h, inter, float(experts.alpha),
           float(experts.limit), x.stride(0), *gu[3:], gu_bias.stride(0), OAI=oai, **common)
    launch(_down_kernel, (num_blocks, triton.cdiv(h, block_n)), x.device,
           act, slot_rows, block_expert, weights.reshape(-1).contiguous(), down[0], down[1], down[2], down_bias, y,
           h, inter, *down[3:], down_bias.stride(0), **common)
    return y.view(t, top_k, h).sum(dim=1).to(x.dtype)  # each token's rows in a fixed order
