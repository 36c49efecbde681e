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
tile's arrival counter (engine/kernels/arrival_counters.py: zero between launches, so no memset per call and the
launch replays in a CUDA graph); the program that arrives last sums the SPLIT_K partials in split order, adds the
bias, rounds, applies the epilogue and sets the counter back to 0. The norm's row statistics still span the whole
K in every program, and one program writes the residual sum. SPLIT_K=1 is the plain path, without partials or
atomics.

Rounding is that of the unfused layers: the residual sum is rounded to the activation dtype; the norm's
statistics are float32 and its output is rounded to the dtype (Llama form: the normalised row is rounded before
the weight multiplies it; Gemma's offset form multiplies by (offset + w) in float32); act(gate) is rounded before
it multiplies up, the product rounded again; the product accumulates in float32 (fp32 operands: IEEE, never
TF32), the bias is added in float32, the result is rounded, and the epilogue's residual add rounds once more.
Only the order of the float32 sums differs from a BLAS library's (split K changes that order only: each split sums
its K range, then the splits are added in order; the result does not depend on which program arrived last).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.activation import ACTIVATIONS, act_and_mul, act_and_mul_ref
from engine.kernels.arrival_counters import arrival_counters
from engine.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_ref, use_fused_kernels
from engine.kernels.small_m_tiles import FMA_MAX_ROWS, split_k_range, tiles_for
from engine.kernels.triton_compat import launch, require_triton, tl, triton, wait_for_previous_kernel

__all__ = ["FMA_MAX_ROWS", "MAX_ROWS", "takes_rows", "rows_limit", "norm_linear", "norm_linear_ref", "act_linear",
           "act_linear_ref", "linear_add", "linear_add_ref"]

MAX_ROWS = 64  # rows the kernel takes (split-K DOT form beyond 4); larger batches are matrix-bound enough for cuBLAS
_NONE, _NORM, _ACT = 0, 1, 2  # prologues


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, GELU_TANH: tl.constexpr):
    """The product's input at rows x columns kk, in the activation dtype (see the module docstring)."""
    mask = m_mask[:, None] & k_mask[None, :]
    ptrs = x_ptr + rows[:, None] * stride_x + kk[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    dt = x.dtype
    if PROLOGUE == 1:
        if HAS_RES:
            x = (x + tl.load(res_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)).to(dt)
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32) * rstd[:, None]
        if HAS_OFFSET:
            x = (xf * (offset + nw[None, :])).to(dt)
        else:
            x = (xf.to(dt).to(tl.float32) * nw[None, :]).to(dt)
    elif PROLOGUE == 2:
        gate = x.to(tl.float32)
        up = tl.load(ptrs + inter, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))  # tanh(z) = 2 sigmoid(2z) - 1
        else:
            act = gate / (1.0 + tl.exp(-gate))
        x = (act.to(dt).to(tl.float32) * up).to(dt)
    return x


@triton.jit
def _multiply_add(acc, a, w, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr):
    """acc + a @ w.T for an input tile a [BLOCK_M, BLOCK_K] and a weight tile w [BLOCK_N, BLOCK_K]: into acc
    [BLOCK_M, BLOCK_N] with tl.dot, or into acc [BLOCK_M, BLOCK_N, BLOCK_K] (FMA form, summed over K at the end)."""
    if USE_DOT:
        if DOT_IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a.to(w.dtype), tl.trans(w))
    else:
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, GELU_TANH: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr, ROW_LOOP: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc plus the product of the input's columns kk with the weight tile w [BLOCK_N, BLOCK_K]. ROW_LOOP: one row
    at a time into acc [BLOCK_M, BLOCK_N], each row's products summed over the tile at once, so the weight tile
    keeps its one-row size whatever the rows (the FMA form's accumulator grows with them)."""
    if ROW_LOOP:
        wf = w.to(tl.float32)
        for i in tl.static_range(BLOCK_M):
            row = i + tl.arange(0, 1)
            rstd_i = tl.sum(tl.where(rows == i, rstd, 0.0), axis=0) + tl.zeros([1], dtype=tl.float32)
            a = _input_tile(x_ptr, res_ptr, nw_ptr, row, kk, row < M, k_mask, stride_x, stride_r, inter, rstd_i,
                            offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH)
            part = tl.sum(a.to(tl.float32) * wf, axis=1)  # [BLOCK_N]
            acc = tl.where((rows == i)[:, None], acc + part[None, :], acc)
    else:
        a = _input_tile(x_ptr, res_ptr, nw_ptr, rows, kk, m_mask, k_mask, stride_x, stride_r, inter, rstd, offset,
                        PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH)
        acc = _multiply_add(acc, a, w, USE_DOT, DOT_IEEE)
    return acc


@triton.jit
def _store_output(acc, b_ptr, add_ptr, out_ptr, rows, cols, m_mask, n_mask, stride_a, stride_o,
                  HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr):
    """The float32 product acc [BLOCK_M, BLOCK_N] plus the bias, rounded, plus the epilogue's add, stored."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        add = tl.load(add_ptr + rows[:, None] * stride_a + cols[None, :], mask=out_mask, other=0.0)
        y = (y.to(tl.float32) + add.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=out_mask)


@triton.jit
def _small_m_linear_kernel(
        x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, b_ptr, add_ptr, out_ptr, part_ptr, count_ptr,
        M, N, K, K_SPLIT, NUM_SPLITS, stride_x, stride_r, stride_ro, stride_w, stride_a, stride_o, eps, offset,
        PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_OFFSET: tl.constexpr, GELU_TANH: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr,
        ROW_LOOP: tl.constexpr, USE_PDL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    kk = k_lo + offs_k
    k_mask = kk < k_hi
    # The first weight tile is requested before the wait: no kernel writes the weights, so that is safe, and under
    # dependent launch its HBM round trip then overlaps the previous kernel's tail instead of following it (at one
    # row most programs own one or two tiles). Everything else this kernel reads or writes (the split-K partials
    # and counters included) comes after the wait.
    w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    wait_for_previous_kernel(USE_PDL)  # see triton_compat (programmatic dependent launch)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:
        # Row statistics of the norm's input, over the whole K whatever the split: every program computes them (the
        # rows are a few KB, in L2); the first also writes the residual sum out, so each element is written once.
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        k_written = tl.where(first, K, 0)  # columns the residual sum is stored for: all in the first program only
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
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
    acc = _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x, stride_r, K, rstd,
                      offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH, USE_DOT, DOT_IEEE, ROW_LOOP, BLOCK_M)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _accumulate(acc, w, x_ptr, res_ptr, nw_ptr, M, rows, kk, m_mask, k_mask, stride_x, stride_r, K, rstd,
                          offset, PROLOGUE, HAS_RES, HAS_OFFSET, GELU_TANH, USE_DOT, DOT_IEEE, ROW_LOOP, BLOCK_M)
    if not USE_DOT and not ROW_LOOP:
        acc = tl.sum(acc, axis=2)
    if not SPLIT:
        _store_output(acc, b_ptr, add_ptr, out_ptr, rows, cols, m_mask, n_mask, stride_a, stride_o, HAS_BIAS, HAS_ADD)
    else:
        # Split K: the partial sums go to the workspace [NUM_SPLITS, M, N]; the program that arrives last at this
        # column tile's counter sums them, in split order whichever arrived last (so a result does not depend on
        # the arrival order), finishes the output and sets the counter back to 0 for the next launch.
        out_mask = m_mask[:, None] & n_mask[None, :]
        parts = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(parts + tl.program_id(1) * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partials stored before the (one-thread) release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(NUM_SPLITS):  # from L2 (.cg): another SM's writes, never a stale L1 line
                acc += tl.load(parts + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_output(acc, b_ptr, add_ptr, out_ptr, rows, cols, m_mask, n_mask, stride_a, stride_o, HAS_BIAS,
                          HAS_ADD)
            tl.atomic_xchg(count_ptr + pid, 0)


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


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int, k: int,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            offset: float = 0.0, act: str = "silu", add: torch.Tensor | None = None,
            config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = [t for t in (x, weight, bias, residual, norm_weight, add) if t is not None]
    require_triton("small_m_linear", *tensors)
    m, n = x.shape[0], weight.shape[0]
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError(f"x [rows, {k}] and weight [out, {k}] must be contiguous in their last dimension, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if m > MAX_ROWS:
        raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {m}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} and {weight.dtype}")
    for t, shape in ((residual, (m, k)), (add, (m, n)), (bias, (n,)), (norm_weight, (k,))):
        if t is not None and (tuple(t.shape) != shape or t.stride(-1) != 1):
            raise ValueError(f"expected a tensor of shape {shape}, contiguous in its last dimension, got "
                             f"{tuple(t.shape)}")
    cfg = {}
    if m:  # an explicit config (tests, sweeps) overrides the rule's tiles, not this GPU model's exceptions: it asks
        # for the kernel, unless it is CUBLAS itself
        cfg = {"ROW_LOOP": False, "SPLIT_K": 1, **tiles_for(m, n, k, x.device, measured=config is None),
               **(config or {})}
    if cfg.get("CUBLAS"):
        return _unfused(x, weight, bias, prologue, residual, norm_weight, eps, offset, act, add)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else None
    if m:
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        # The split count is a run-time argument (one compiled kernel whatever the split), SPLIT whether there is one.
        splits, k_split = split_k_range(k, cfg["BLOCK_K"], cfg.pop("SPLIT_K"))
        if splits > 1:  # fp32 partials [splits, rows, N] (from the graph pool under capture)
            parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
            counts = arrival_counters(x.device, tiles)
        else:
            parts, counts = out, out  # not read: the plain path
        launch(_small_m_linear_kernel, (tiles, splits), x.device,
               x, residual if residual is not None else x, res_out if res_out is not None else out,
               norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight,
               add if add is not None else out, out, parts, counts,
               m, n, k, k_split, splits, x.stride(0), residual.stride(0) if residual is not None else 0,
               res_out.stride(0) if res_out is not None else 0, weight.stride(0),
               add.stride(0) if add is not None else 0, out.stride(0), eps, offset,
               PROLOGUE=prologue, HAS_RES=residual is not None, HAS_OFFSET=bool(offset),
               GELU_TANH=act == "gelu_pytorch_tanh", HAS_BIAS=bias is not None, HAS_ADD=add is not None,
               DOT_IEEE=x.dtype == torch.float32, SPLIT=splits > 1, **cfg)
    return out, res_out


def _unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
             residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, offset: float, act: str,
             add: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The product through cuBLAS, its prologue or epilogue a kernel of its own (the engine's norm and activation
    kernels, a plain add): what small_m_tiles.CUBLAS asks for where that measured faster. Rounding as the fused
    form's, which is the unfused layers'."""
    res_out = None
    if prologue == _NORM:
        if residual is not None:
            x, res_out = add_rms_norm(x, residual, norm_weight, eps, offset)
        else:
            x = rms_norm(x, norm_weight, eps, offset)
    elif prologue == _ACT:
        x = act_and_mul(x, act)
    out = F.linear(x, weight, bias)
    return (out + add if add is not None else out), res_out


def norm_linear(x: torch.Tensor,  # [rows, K], rows <= MAX_ROWS
                residual: torch.Tensor | None,  # [rows, K] or None
                norm_weight: torch.Tensor,  # [K]
                eps: float, offset: float,
                weight: torch.Tensor,  # [N, K]
                bias: torch.Tensor | None = None,  # [N]
                config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T + bias, x + residual), x itself as the second when residual is None."""
    out, res = _launch(x, weight, bias, _NORM, x.shape[-1], residual, norm_weight, eps, offset, config=config)
    return out, (res if res is not None else x)


def act_linear(gate_up: torch.Tensor,  # [rows, 2 * I]: gate then up
               act: str,
               weight: torch.Tensor,  # [N, I]
               config: dict | None = None) -> torch.Tensor:
    """act_and_mul(gate_up) @ weight.T: a gated MLP's down projection with its activation."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act_linear supports {ACTIVATIONS}, got {act!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * I], got {tuple(gate_up.shape)}")
    return _launch(gate_up, weight, None, _ACT, gate_up.shape[1] // 2, act=act, config=config)[0]


def linear_add(x: torch.Tensor,  # [rows, K]
               weight: torch.Tensor,  # [N, K]
               bias: torch.Tensor | None,  # [N]
               add: torch.Tensor,  # [rows, N]
               config: dict | None = None) -> torch.Tensor:
    """x @ weight.T + bias, rounded, + add: a projection and the residual add after it."""
    return _launch(x, weight, bias, _NONE, x.shape[-1], add=add, config=config)[0]


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    offset: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual if residual is not None else x
    return F.linear(rms_norm_ref(s, norm_weight, eps, offset), weight, bias), s


def act_linear_ref(gate_up: torch.Tensor, act: str, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(act_and_mul_ref(gate_up, act), weight)


def linear_add_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   add: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias) + add
