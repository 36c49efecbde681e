"""Matrix products of a few rows (1-64: a batch-1 decode, a draft step, a verify, tree drafting's forwards) with
the layer's elementwise work folded in: an RMSNorm (and the residual add before it) as the prologue, act(gate) * up
as the prologue, or a residual add as the epilogue (Triton kernel + typed wrappers + torch references).

At batch 1 a decoder layer of a 0.6B model reads about 15 MB of weights, 5 us at the copy bandwidth, yet an unfused
layer is about ten launches: norm, qkv, attention's prologue, attention, o_proj, add+norm, gate_up, act*mul, down.
Each launch and its tail cost a few microseconds of their own, so the draft step is launch-bound (3.4x its floor).
Here a norm needs no kernel of its own: each program of the following product recomputes the row statistics of
its (tiny) input, which it reads from L2 anyway, and the activation is applied to the gate/up row as the down
projection reads it. A layer becomes norm+qkv, attention's prologue, attention, o_proj+residual, norm+gate_up and
act+down.

Layout: a program owns BLOCK_N output features of every row and walks K in BLOCK_K steps. With few rows (FMA
form) the products are plain fp32 multiply-adds into a [rows, BLOCK_N, BLOCK_K] accumulator summed once at the
end, so BLOCK_N can be as small as 2 and even a 1024-wide projection spreads over enough programs to fill the
GPU without split-K; that accumulator grows with the rows, so at 2-4 rows the row loop (ROW_LOOP) takes one row at
a time into a [rows, BLOCK_N] accumulator, the weight tile as large as at one row; with more rows (DOT form)
tl.dot on 16-64-row tiles keeps the arithmetic off the CUDA cores. `small_m_tiles.tiles_for` picks the form per shape.

Split K (DOT form at 5-64 rows): a tl.dot tile of 16+ rows wants 32-64 output features, so a 1024-wide projection
would get 16-32 programs owning the whole K each, on a GPU of 132 SMs. The grid is (column tiles, SPLIT_K) instead:
each program takes a contiguous K range, writes its float32 partials to a workspace and increments its column
tile's arrival counter (engine/kernels/small_m/arrival_counters.py: zero between launches, so no memset per call and the
launch replays in a CUDA graph); the program that arrives last sums the SPLIT_K partials in split order, adds the
bias, rounds, applies the epilogue and sets the counter back to 0. The norm's row statistics still span the whole
K in every program (unless given, below), and one program writes the residual sum. SPLIT_K=1 is the plain path,
without partials or atomics.

The wide path (5-64 rows, engine/models/llama.py `_forward_wide`): a norm's full-K statistics cost every program a
pass over its rows, so the product before the norm writes them instead. linear_add_ss (o_proj, down: the residual
add as the epilogue) also stores each column tile's float32 sum of squares of the rounded rows it wrote ([tiles,
rows], SS_OUT), and the next norm_linear sums those in one load (row_ss, SS_IN). gate_up may take the activation
as its epilogue (glu, GLU): a program owns BLOCK_N features of the gate and the same of the up half, two
accumulators over one input tile, and stores act(gate) * up, so down needs no prologue.

Rounding is that of the unfused layers: the residual sum is rounded to the activation dtype; the norm's
statistics are float32 and its output is rounded to the dtype (Llama form: the normalised row is rounded before
the weight multiplies it; Gemma's offset form multiplies by (offset + w) in float32); act(gate) is rounded before
it multiplies up, the product rounded again; the product accumulates in float32 (fp32 operands: IEEE, never
TF32), the bias is added in float32, the result is rounded, and the epilogue's residual add rounds once more.
Only the order of the float32 sums differs from a BLAS library's (split K changes that order only: each split sums
its K range, then the splits are added in order; the result does not depend on which program arrived last).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.activation import ACTIVATIONS
from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.small_m.arrival_counters import arrival_counters, sum_splits
from engine.kernels.small_m.parts import accumulate_pair, group_scale, store_output, weight_tile
from engine.kernels.small_m.reference import (
    PROLOGUE_ACT,
    PROLOGUE_NONE,
    PROLOGUE_NORM,
    act_linear_ref,
    linear_add_ref,
    linear_add_ss_ref,
    norm_linear_ref,
    unfused_product,
)
from engine.kernels.small_m.tiles import FMA_MAX_ROWS, fit_stages, fp8_tiles, split_k_range, tiles_for
from engine.kernels.triton_compat import interpreting, launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["FMA_MAX_ROWS", "MAX_ROWS", "takes_rows", "rows_limit", "norm_linear", "norm_linear_ref", "act_linear",
           "act_linear_ref", "linear_add", "linear_add_ref", "linear_add_ss", "linear_add_ss_ref", "RowSquares"]

MAX_ROWS = 64  # rows the kernel takes (split-K DOT form beyond 4); larger batches are matrix-bound enough for cuBLAS


@triton.jit
def _small_m_linear_kernel(
        x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, add_ptr, out_ptr, part_ptr, count_ptr, ss_in_ptr,
        ss_out_ptr, M, N, K, K_SPLIT, NUM_SPLITS, SS_TILES, stride_x, stride_r, stride_ro, stride_w, stride_s,
        stride_a, stride_o, eps, offset,
        W_SCALE: tl.constexpr, GROUP_K: tl.constexpr, W_PTX: tl.constexpr, PROLOGUE: tl.constexpr,
        HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr,
        GELU_TANH: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr,
        ROW_LOOP: tl.constexpr, USE_PDL: tl.constexpr, SPLIT: tl.constexpr, GLU: tl.constexpr, SS_IN: tl.constexpr,
        SS_OUT: tl.constexpr, SS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, STATS_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    if not SPLIT:
        k_lo = 0
        k_hi = K
        first = pid == 0
    else:  # this program's K range: K_SPLIT columns (a multiple of BLOCK_K) from k_lo, one of NUM_SPLITS
        k_lo = tl.program_id(1) * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
        first = (pid == 0) & (tl.program_id(1) == 0)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    w_up_rows = w_rows + N * stride_w  # GLU: the up half's rows, N below the gate's
    # FP8 weights (W_SCALE 1: a scale a row, 2: a scale a row and group of GROUP_K columns): the scales' rows
    s_rows = s_ptr + cols * stride_s
    s_up_rows = s_rows + N * stride_s
    kk = k_lo + offs_k
    k_mask = kk < k_hi
    # The first weight tile is requested before the wait: no kernel writes the weights (or their scales), so that is
    # safe, and under dependent launch its HBM round trip then overlaps the previous kernel's tail instead of
    # following it (at one row most programs own one or two tiles). Everything else this kernel reads or writes (the
    # split-K partials and counters included) comes after the wait.
    w_mask = n_mask[:, None] & k_mask[None, :]
    w = weight_tile(w_rows, s_rows, kk, k_lo, GROUP_K, w_mask, n_mask, x_ptr.dtype.element_ty, W_SCALE, USE_DOT,
                    W_PTX)
    ws = group_scale(s_rows, k_lo, GROUP_K, n_mask, W_SCALE, USE_DOT)
    w_up, ws_up = w, ws
    if GLU:
        w_up = weight_tile(w_up_rows, s_up_rows, kk, k_lo, GROUP_K, w_mask, n_mask, x_ptr.dtype.element_ty, W_SCALE,
                           USE_DOT, W_PTX)
        ws_up = group_scale(s_up_rows, k_lo, GROUP_K, n_mask, W_SCALE, USE_DOT)
    wait_for_previous_kernel(USE_PDL)  # see triton_compat (programmatic dependent launch)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 and SS_IN:
        # The row statistics from the kernel that wrote x: its column tiles' sums of squares [SS_TILES, M], a few KB,
        # summed here in one load instead of reading every row's whole K.
        t = tl.arange(0, SS_BLOCK)
        ss_mask = (t < SS_TILES)[:, None] & m_mask[None, :]
        ss = tl.sum(tl.load(ss_in_ptr + t[:, None] * M + rows[None, :], mask=ss_mask, other=0.0), axis=0)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    elif PROLOGUE == 1:
        # Row statistics of the norm's input, over the whole K whatever the split: every program computes them (the
        # rows are a few KB, in L2); the first also writes the residual sum out, so each element is written once.
        # STATS_K columns a trip (the DOT form's K tile is narrow: 32 trips of an L2 round trip each over a K of 4096
        # at 128 columns, before the first product).
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        k_written = tl.where(first, K, 0)  # columns the residual sum is stored for: all in the first program only
        for k0 in range(0, K, STATS_K):
            ks = k0 + tl.arange(0, STATS_K)
            ks_mask = ks < K
            mask = m_mask[:, None] & ks_mask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
            if HAS_RES:
                x = (x + tl.load(res_ptr + rows[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)).to(x.dtype)
                out_mask = mask & (ks < k_written)[None, :]
                tl.store(res_out_ptr + rows[:, None] * stride_ro + ks[None, :], x, mask=out_mask)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    if USE_DOT or ROW_LOOP:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = acc
    scaled = USE_DOT and W_SCALE == 2
    acc, acc_up = accumulate_pair(acc, acc_up, w, w_up, ws, ws_up, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask,
                                   stride_x, stride_r, K, rstd, offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH,
                                   USE_DOT, DOT_IEEE, ROW_LOOP, BLOCK_M, GLU, scaled)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = weight_tile(w_rows, s_rows, kk, k0, GROUP_K, w_mask, n_mask, x_ptr.dtype.element_ty, W_SCALE, USE_DOT,
                        W_PTX)
        ws = group_scale(s_rows, k0, GROUP_K, n_mask, W_SCALE, USE_DOT)
        if GLU:
            w_up = weight_tile(w_up_rows, s_up_rows, kk, k0, GROUP_K, w_mask, n_mask, x_ptr.dtype.element_ty, W_SCALE,
                               USE_DOT, W_PTX)
            ws_up = group_scale(s_up_rows, k0, GROUP_K, n_mask, W_SCALE, USE_DOT)
        acc, acc_up = accumulate_pair(acc, acc_up, w, w_up, ws, ws_up, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask,
                                       k_mask, stride_x, stride_r, K, rstd, offset, PROLOGUE, HAS_RES, HAS_OFFSET,
                                       GELU_TANH, USE_DOT, DOT_IEEE, ROW_LOOP, BLOCK_M, GLU, scaled)
    if not USE_DOT and not ROW_LOOP:
        acc = tl.sum(acc, axis=2)
    if not SPLIT:
        if W_SCALE == 1:  # a scale a row applies to the row's whole sum
            acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[None, :]
            if GLU:
                acc_up = acc_up * tl.load(s_up_rows, mask=n_mask, other=0.0)[None, :]
        store_output(acc, acc_up, b_ptr, add_ptr, out_ptr, ss_out_ptr, rows, cols, m_mask, n_mask, M, stride_a,
                      stride_o, HAS_BIAS, HAS_ADD, GLU, GELU_TANH, SS_OUT)
    else:
        # Split K: the partial sums go to the workspace [NUM_SPLITS, M, N]; the program that arrives last at this
        # column tile's counter sums them in split order and finishes the output.
        last, acc = sum_splits(acc, part_ptr, count_ptr, pid, tl.program_id(1), NUM_SPLITS,
                               rows[:, None] * N + cols[None, :], m_mask[:, None] & n_mask[None, :], M * N)
        if last:
            if W_SCALE == 1:
                acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[None, :]
            store_output(acc, acc, b_ptr, add_ptr, out_ptr, ss_out_ptr, rows, cols, m_mask, n_mask, M, stride_a,
                          stride_o, HAS_BIAS, HAS_ADD, False, GELU_TANH, SS_OUT)


@dataclass
class RowSquares:
    """In a layer's residual slot: the layer's input x is already the residual stream (the kernel that wrote it did
    the add), and these are its rows' sums of squares, so the next norm reads them instead of x's rows."""
    ss: torch.Tensor  # [column tiles, rows] float32, from linear_add_ss


def takes_rows(x: torch.Tensor, limit: int) -> bool:
    """Whether a layer should run x ([rows, ...]) through these kernels: at most `limit` rows (the engine's
    setting, capped at MAX_ROWS) on a device the kernels run on."""
    return 0 < x.shape[0] <= min(limit, MAX_ROWS) and use_fused_kernels(x)


def rows_limit(setting: int, hidden_size: int) -> int:
    """Up to how many rows a layer of this width runs its products here, under the engine's setting
    (EngineConfig.small_m_rows): wide layers (hidden size 4096 and more, an 8B model) only single rows, where at two
    rows the kernels were slower than cuBLAS on an H100 (benchmarks/RESULTS.md); narrower ones (a draft) up to the
    setting."""
    return min(setting, 1) if hidden_size >= 4096 else setting


def fp8_scaling(weight: torch.Tensor, scale: torch.Tensor, group_k: int, k: int) -> int:
    """The kernel's W_SCALE for an FP8 weight [N, K] and its scales [N, G] over group_k columns: 1 for a scale a
    row (G = 1), 2 for a scale a group (K tiles within a group: group_k a multiple of 16)."""
    n = weight.shape[0]
    groups = -(-k // max(group_k, 1))
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(f"an FP8 product takes a float8_e4m3fn weight and float32 scales, got {weight.dtype} and "
                         f"{scale.dtype}")
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] not in (1, groups):
        raise ValueError(f"FP8 scales must be [{n}, 1] or [{n}, {groups}] (groups of {group_k} columns), got "
                         f"{tuple(scale.shape)}")
    if scale.shape[1] == 1:
        return 1
    if group_k % 16:
        raise ValueError(f"FP8 scale groups of {group_k} columns: the kernel's K tiles need a multiple of 16")
    return 2


def _stats_k(cfg: dict, k: int) -> int:
    """Columns a trip of the norm's row statistics over K: the K tile, widened in the DOT form to about 8192
    elements a trip (its 16-64-row tile and 64-256-column K tile would take dozens of trips over a wide row)."""
    if not cfg["USE_DOT"]:
        return cfg["BLOCK_K"]
    return max(cfg["BLOCK_K"], min(triton.next_power_of_2(k), 8192 // cfg["BLOCK_M"]))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int, k: int,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            offset: float = 0.0, act: str = "silu", add: torch.Tensor | None = None, config: dict | None = None,
            glu: bool = False, ss_in: torch.Tensor | None = None, ss_out: bool = False,
            scale: torch.Tensor | None = None, group_k: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, residual sum or None, the output rows' sums of squares per column tile or None). scale: an FP8
    weight's float32 scales [N, G], each over group_k columns (engine/quantization/fp8.py)."""
    tensors = [t for t in (x, weight, bias, residual, norm_weight, add, ss_in, scale) if t is not None]
    require_triton("small_m_linear", *tensors)
    m, n = x.shape[0], weight.shape[0] // (2 if glu else 1)
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError(f"x [rows, {k}] and weight [out, {k}] must be contiguous in their last dimension, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if m > MAX_ROWS:
        raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {m}")
    w_scale = fp8_scaling(weight, scale, group_k, k) if scale is not None else 0
    if x.dtype != weight.dtype and not w_scale:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} and {weight.dtype}")
    for t, shape in ((residual, (m, k)), (add, (m, n)), (bias, (weight.shape[0],)), (norm_weight, (k,))):
        if t is not None and (tuple(t.shape) != shape or t.stride(-1) != 1):
            raise ValueError(f"expected a tensor of shape {shape}, contiguous in its last dimension, got "
                             f"{tuple(t.shape)}")
    if ss_in is not None and (ss_in.dim() != 2 or ss_in.shape[1] != m or ss_in.dtype != torch.float32
                              or not ss_in.is_contiguous() or residual is not None):
        raise ValueError(f"row_ss must be float32 [column tiles, {m}], contiguous, with no residual to add; got "
                         f"{tuple(ss_in.shape)} {ss_in.dtype}")
    cfg = {}
    if m:
        # FP8: tiles of their own (the tables were measured in 16-bit weights and may say CUBLAS). Otherwise an
        # explicit config (tests, sweeps) overrides the rule's tiles, not this GPU model's exceptions: it asks for
        # the kernel, unless it is CUBLAS itself. The gated epilogue takes no split.
        tiles = (fp8_tiles(m, weight.shape[0], k, group_k if w_scale == 2 else 0, x.device, glu) if w_scale
                 else {"SPLIT_K": 1, **tiles_for(m, weight.shape[0], k, x.device, measured=config is None)})
        cfg = {"ROW_LOOP": False, **tiles, **({"SPLIT_K": 1} if glu else {}), **(config or {})}
    if m and config is None:
        cfg = fit_stages(cfg, x.element_size(), 2 if glu else 1, x.device)
    if w_scale == 2 and m and group_k % cfg["BLOCK_K"]:
        raise ValueError(f"an FP8 weight's K tile must divide its scale groups of {group_k} columns, got {cfg}")
    if cfg.get("CUBLAS") and w_scale:
        raise ValueError("an FP8 weight has no cuBLAS form here (fp8_linear is its unfused product)")
    if cfg.get("CUBLAS"):
        return unfused_product(x, weight, bias, prologue, residual, norm_weight, eps, offset, act, add, glu, ss_out)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else None
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) if m else 0
    ss = torch.empty(tiles, m, dtype=torch.float32, device=x.device) if ss_out else None
    if m:
        # The split count is a run-time argument (one compiled kernel whatever the split), SPLIT whether there is one.
        splits, k_split = split_k_range(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
        if glu and (splits > 1 or not cfg["USE_DOT"]):
            raise ValueError(f"the gated epilogue (glu) takes the DOT form without split K, got {cfg}")
        if splits > 1:  # fp32 partials [splits, rows, N] (from the graph pool under capture)
            parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
            counts = arrival_counters(x.device, tiles)
        else:
            parts, counts = out, out  # not read: the plain path
        ss_tiles = ss_in.shape[0] if ss_in is not None else 1
        launch(_small_m_linear_kernel, (tiles, splits), x.device,
               x, residual if residual is not None else x, res_out if res_out is not None else out,
               norm_weight if norm_weight is not None else x, weight.view(torch.uint8) if w_scale else weight,
               scale if scale is not None else out, bias if bias is not None else out,
               add if add is not None else out, out, parts, counts, ss_in if ss_in is not None else out,
               ss if ss is not None else out,
               m, n, k, k_split, splits, ss_tiles, x.stride(0), residual.stride(0) if residual is not None else 0,
               res_out.stride(0) if res_out is not None else 0, weight.stride(0),
               scale.stride(0) if scale is not None else 0, add.stride(0) if add is not None else 0,
               out.stride(0), eps, offset, W_SCALE=w_scale, GROUP_K=group_k if w_scale == 2 else 1,
               W_PTX=bool(w_scale) and x.dtype == torch.bfloat16 and x.is_cuda and not interpreting(),
               PROLOGUE=prologue, HAS_RES=residual is not None,
               HAS_OFFSET=bool(offset),
               GELU_TANH=act == "gelu_pytorch_tanh", HAS_BIAS=bias is not None, HAS_ADD=add is not None,
               DOT_IEEE=x.dtype == torch.float32, SPLIT=splits > 1, GLU=glu, SS_IN=ss_in is not None,
               SS_OUT=ss_out, SS_BLOCK=triton.next_power_of_2(ss_tiles), STATS_K=_stats_k(cfg, k), **cfg)
    return out, res_out, ss


def norm_linear(x: torch.Tensor,  # [rows, K], rows <= MAX_ROWS
                residual: torch.Tensor | None,  # [rows, K] or None
                norm_weight: torch.Tensor,  # [K]
                eps: float, offset: float,
                weight: torch.Tensor,  # [N, K]; with glu [2 * I, K]: gate then up
                bias: torch.Tensor | None = None,  # [N]
                config: dict | None = None,
                row_ss: torch.Tensor | None = None,  # [column tiles, rows] float32, from linear_add_ss; residual None
                glu: str | None = None,
                scale: torch.Tensor | None = None,  # [N, G] float32: an FP8 weight's scales (quantization/fp8.py)
                group_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T + bias, x + residual), x itself as the second when residual is None.
    row_ss: x's rows' sums of squares as linear_add_ss wrote x, so the norm reads them instead of x's whole rows.
    glu: an activation of ACTIVATIONS; the output is act_and_mul of the product, [rows, I] (a gated MLP's gate_up
    with the activation in its epilogue; the DOT form at 5-64 rows)."""
    if glu is not None and (glu not in ACTIVATIONS or weight.shape[0] % 2):
        raise ValueError(f"glu takes an activation of {ACTIVATIONS} and a [2 * I, K] weight, got {glu!r} and "
                         f"{tuple(weight.shape)}")
    out, res, _ = _launch(x, weight, bias, PROLOGUE_NORM, x.shape[-1], residual, norm_weight, eps, offset,
                          act=glu or "silu", config=config, glu=glu is not None, ss_in=row_ss, scale=scale,
                          group_k=group_k)
    return out, (res if res is not None else x)


def act_linear(gate_up: torch.Tensor,  # [rows, 2 * I]: gate then up
               act: str,
               weight: torch.Tensor,  # [N, I]
               config: dict | None = None,
               scale: torch.Tensor | None = None,  # [N, G] float32, an FP8 weight's
               group_k: int = 0) -> torch.Tensor:
    """act_and_mul(gate_up) @ weight.T: a gated MLP's down projection with its activation."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act_linear supports {ACTIVATIONS}, got {act!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * I], got {tuple(gate_up.shape)}")
    return _launch(gate_up, weight, None, PROLOGUE_ACT, gate_up.shape[1] // 2, act=act, config=config, scale=scale,
                   group_k=group_k)[0]


def linear_add(x: torch.Tensor,  # [rows, K]
               weight: torch.Tensor,  # [N, K]
               bias: torch.Tensor | None,  # [N]
               add: torch.Tensor,  # [rows, N]
               config: dict | None = None,
               scale: torch.Tensor | None = None,  # [N, G] float32, an FP8 weight's
               group_k: int = 0) -> torch.Tensor:
    """x @ weight.T + bias, rounded, + add: a projection and the residual add after it."""
    return _launch(x, weight, bias, PROLOGUE_NONE, x.shape[-1], add=add, config=config, scale=scale,
                   group_k=group_k)[0]


def linear_add_ss(x: torch.Tensor,  # [rows, K]
                  weight: torch.Tensor,  # [N, K]
                  bias: torch.Tensor | None,  # [N]
                  add: torch.Tensor,  # [rows, N]
                  config: dict | None = None,
                  scale: torch.Tensor | None = None,  # [N, G] float32, an FP8 weight's
                  group_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_add's output y, y's rows' sums of squares per column tile: float32 [column tiles, rows]), the
    second for the next norm (norm_linear's row_ss), whose statistics then cost no pass over y."""
    out, _, ss = _launch(x, weight, bias, PROLOGUE_NONE, x.shape[-1], add=add, config=config, ss_out=True,
                         scale=scale, group_k=group_k)
    return out, ss


