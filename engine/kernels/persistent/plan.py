"""The persistent decoder's plan (shapes, tiles, the per-layer pointer table, workspaces), its typed wrapper and its
plain-torch reference; the kernel is engine/kernels/persistent/decoder.py.

`PersistentDecoder` is built once per model after the KV cache is bound (the pointer table holds each layer's
cache addresses) and called inside the model's forward, CUDA-graph captured like the rest of it: a decode step of
at most `max_rows` requests of one token each, on one KV-cache group (Llama-family models without tensor
parallelism: Llama, SmolLM2, Qwen2, Qwen3, Mistral's window). Anything else runs the ordinary layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.activation import act_and_mul_ref
from engine.kernels.attention.paged import paged_attention_ref
from engine.kernels.attention.qk_norm_rope_store import qk_norm_rope_store_ref
from engine.kernels.persistent.decoder import NUM_PTRS, NUM_STAGES, _persistent_decoder_kernel
from engine.kernels.rms_norm import rms_norm_ref
from engine.kernels.triton_compat import interpreting, require_triton, triton

__all__ = ["LayerWeights", "DecoderShape", "PersistentDecoder", "persistent_decode_ref"]

_TILE_ELEMS = 32768  # weight elements a program holds per stage (64 KB of bf16): one load of a whole tile
_MAX_SPLITS = 16


@dataclass
class LayerWeights:
    """One decoder layer's tensors, as the model holds them (no copies)."""
    qkv: torch.Tensor  # [(nq + 2 nkv) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(nq + 2 nkv) * head_dim] (Qwen2)
    o: torch.Tensor  # [hidden, nq * head_dim]
    gate_up: torch.Tensor  # [2 * inter, hidden]
    down: torch.Tensor  # [hidden, inter]
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, nkv, head_dim] strided view of the layer's cache
    value_cache: torch.Tensor  # [num_blocks, block_size, nkv, head_dim]


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inter: int
    eps: float  # the layers' RMSNorm eps
    qk_eps: float  # the q/k norms' eps (Qwen3)
    scale: float  # softmax scale
    window: int | None  # sliding window of every layer, or None
    act: str  # "silu" | "gelu_pytorch_tanh"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _tile_rows(n: int, k: int, programs: int, elems: int) -> int:
    """Output features a tile: an equal share of n over the programs, as few as needed to keep the tile's
    elements (its power-of-two block times K's) within `elems`."""
    bn = -(-n // programs)
    while bn > 1 and _pow2(bn) * _pow2(k) > elems:
        bn = -(-bn // 2)
    return bn


class PersistentDecoder:
    """Every decoder layer of a few-row decode step in one launch (engine/kernels/persistent/decoder.py)."""

    def __init__(self, shape: DecoderShape, layers: list[LayerWeights], cos: torch.Tensor, sin: torch.Tensor,
                 max_rows: int, programs: int | None = None, tile_elems: int = _TILE_ELEMS,
                 num_warps: int = 8, timing: bool = False) -> None:
        """cos, sin: [max_positions, head_dim / 2] float32 (the model's rotary tables); programs: the grid (one
        program per SM by default; every program must be resident at once); timing: program 0 records the global
        timer at each stage's start and arrival into `times` (benchmarks/gpu_persistent.py reads them)."""
        dev = layers[0].qkv.device
        if shape.head_dim % 2 or _pow2(shape.head_dim // 2) != shape.head_dim // 2:
            raise ValueError(f"persistent decoder: head_dim must be twice a power of two, got {shape.head_dim}")
        if shape.act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"persistent decoder: activation {shape.act!r} is not supported")
        if not 1 <= max_rows <= 8:
            raise ValueError(f"persistent decoder: max_rows must be in [1, 8], got {max_rows}")
        half = shape.head_dim // 2
        if cos.dtype != torch.float32 or cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
            raise ValueError(f"persistent decoder: the rotary tables must be float32 [positions, head_dim / 2 = "
                             f"{half}] (rotary over the whole head), got {tuple(cos.shape)} {cos.dtype}")
        self.shape, self.layers, self.max_rows = shape, layers, max_rows
        nqkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        self._check_layers(nqkv)
        require_triton("persistent_decoder", layers[0].qkv)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        if programs is None:
            programs = 4 if interpreting() else torch.cuda.get_device_properties(dev).multi_processor_count
        self.programs, self.num_warps = programs, num_warps
        s, kc = shape, layers[0].key_cache
        self.dtype = layers[0].qkv.dtype
        self.block_size = kc.shape[1]
        self.strides = kc.stride()[:3]
        self.bn = {"qkv": _tile_rows(nqkv, s.hidden, programs, tile_elems),
                   "o": _tile_rows(s.hidden, s.num_heads * s.head_dim, programs, tile_elems),
                   "gu": _tile_rows(s.inter, s.hidden, programs, tile_elems // 2),
                   "down": _tile_rows(s.hidden, s.inter, programs, tile_elems)}
        self.splits = min(_MAX_SPLITS, _pow2(max(1, programs // (max_rows * s.num_kv_heads))))
        if self.splits * max_rows * s.num_kv_heads > programs:
            self.splits = max(1, self.splits // 2)
        self.table = torch.tensor([[self._addr(t) for t in (
            w.qkv, w.qkv_bias, w.o, w.gate_up, w.down, w.input_norm, w.post_norm, w.q_norm, w.k_norm,
            w.key_cache, w.value_cache)] for w in layers], dtype=torch.int64, device=dev)
        assert self.table.shape[1] == NUM_PTRS
        # The stages' activations and the splits' partials, at fixed addresses (graphs capture them).
        r, f32 = max_rows, torch.float32
        self.qkv = torch.empty(r, nqkv, dtype=self.dtype, device=dev)  # [max_rows, (nq + 2 nkv) * head_dim]
        self.attn = torch.empty(r, s.num_heads * s.head_dim, dtype=self.dtype, device=dev)  # [max_rows, nq * hd]
        self.act = torch.empty(r, s.inter, dtype=self.dtype, device=dev)  # [max_rows, inter] act(gate) * up
        self.partial_ml = torch.empty(r, s.num_heads, self.splits, 2, dtype=f32, device=dev)  # running max, sum
        self.partial_acc = torch.empty(r, s.num_heads, self.splits, s.head_dim, dtype=f32, device=dev)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=dev)  # [1] zeroed before each launch
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)  # [1] 1: a barrier wait gave up (tests read it)
        self.calls = 0  # forwards run here (captures count once; tests read it)
        self.timing = timing
        self.times = torch.zeros(len(layers) * 12 + 1, dtype=torch.int64, device=dev)  # [layers * 12 + 1] ns

    def _addr(self, t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    def _check_layers(self, nqkv: int) -> None:
        s, w0 = self.shape, self.layers[0]
        for i, w in enumerate(self.layers):
            want = {"qkv": (nqkv, s.hidden), "o": (s.hidden, s.num_heads * s.head_dim),
                    "gate_up": (2 * s.inter, s.hidden), "down": (s.hidden, s.inter)}
            for name, shp in want.items():
                t = getattr(w, name)
                if tuple(t.shape) != shp or not t.is_contiguous() or t.dtype != w0.qkv.dtype:
                    raise ValueError(f"persistent decoder: layer {i} {name} must be a contiguous {shp} "
                                     f"{w0.qkv.dtype} tensor, got {tuple(t.shape)} {t.dtype}")
            if (w.qkv_bias is None) != (w0.qkv_bias is None) or (w.q_norm is None) != (w0.q_norm is None):
                raise ValueError(f"persistent decoder: layer {i} differs from layer 0 in its biases or q/k norms")
            for c in (w.key_cache, w.value_cache):
                if c.stride() != w0.key_cache.stride() or c.shape != w0.key_cache.shape or c.stride(3) != 1:
                    raise ValueError(f"persistent decoder: layer {i}'s cache views differ from layer 0's")
                if c.dtype != w0.qkv.dtype:
                    raise ValueError("persistent decoder: the KV cache must hold the model's dtype")

    def takes(self, num_tokens: int, num_reqs: int, max_query_len: int) -> bool:
        """Whether a step of this launch shape runs here: one token per request, at most max_rows of them."""
        return 0 < num_tokens <= self.max_rows and num_tokens == num_reqs and max_query_len == 1

    def __call__(self, h: torch.Tensor,  # [rows, hidden] the embeddings; overwritten by the residual stream
                 positions: torch.Tensor,  # [rows] int64
                 slot_mapping: torch.Tensor,  # [rows] int64; < 0: padding, nothing stored
                 seq_lens: torch.Tensor,  # [rows] int32; 0: a padding request
                 block_table: torch.Tensor,  # [rows, max_blocks] int32
                 ) -> torch.Tensor:
        """Run every layer over h in place; returns h (the last layer's residual sum, before the final norm)."""
        rows = h.shape[0]
        if not 0 < rows <= self.max_rows or h.dtype != self.dtype or not h.is_contiguous():
            raise ValueError(f"persistent decoder: h must be a contiguous [1..{self.max_rows}, hidden] "
                             f"{self.dtype} tensor, got {tuple(h.shape)} {h.dtype}")
        self.calls += 1
        if interpreting() or h.device.type != "cuda":
            # The interpreter runs programs one after another: a spinning barrier would never open.
            return self.run_staged(h, positions, slot_mapping, seq_lens, block_table)
        self.barrier.zero_()
        self._launch(h, positions, slot_mapping, seq_lens, block_table, 0, len(self.layers), -1)
        return h

    def run_staged(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The same work one (layer, stage) a launch, without barriers (what the interpreter runs): tests compare
        it with the one-launch form on the GPU."""
        for layer in range(len(self.layers)):
            for stage in range(NUM_STAGES):
                self._launch(h, positions, slot_mapping, seq_lens, block_table, layer, layer + 1, stage)
        return h

    def _launch(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, begin: int, end: int, only_stage: int) -> None:
        s, bn = self.shape, self.bn
        half = s.head_dim // 2
        group = s.num_heads // s.num_kv_heads
        _persistent_decoder_kernel[(self.programs,)](
            self.table, h, self.qkv, self.attn, self.act, self.partial_ml, self.partial_acc,
            positions, slot_mapping, seq_lens, block_table, self.cos, self.sin, self.barrier, self.error, self.times,
            h.shape[0], begin, end, s.eps, s.qk_eps, s.scale * 1.4426950408889634, s.window or 0,
            bn["qkv"], bn["o"], bn["gu"], bn["down"],
            block_table.stride(0), *self.strides,
            H=s.hidden, NQ=s.num_heads, NKV=s.num_kv_heads, HALF=half, INTER=s.inter,
            BK_H=_pow2(s.hidden), BK_O=_pow2(s.num_heads * s.head_dim), BK_I=_pow2(s.inter),
            BN_QKV=_pow2(bn["qkv"]), BN_O=_pow2(bn["o"]), BN_GU=_pow2(bn["gu"]), BN_DOWN=_pow2(bn["down"]),
            ROWS=self.max_rows, SPLITS=self.splits, GROUP_P=_pow2(group), TILE_KV=32,
            BLOCK_SIZE=self.block_size, HAS_QKV_BIAS=self.layers[0].qkv_bias is not None,
            HAS_QK_NORM=self.layers[0].q_norm is not None, HAS_WINDOW=s.window is not None,
            GELU_TANH=s.act != "silu", ONLY_STAGE=only_stage, GRID_SYNC=only_stage < 0,
            TIMING=self.timing and only_stage < 0, num_warps=self.num_warps)


def persistent_decode_ref(shape: DecoderShape, layers: list[LayerWeights], h: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same layers through the unfused layers' torch references (rounding included); returns the residual sum
    after the last layer and stores each layer's new keys and values as the kernel does."""
    s = shape
    h = h.clone()
    rows = h.shape[0]
    dt = h.dtype
    real = seq_lens[:rows] > 0
    # padding requests (graph padding, at the end) hold no query token
    query_start = torch.cat([real.new_zeros(1, dtype=torch.int64), torch.cumsum(real.long(), 0)])
    for w in layers:
        x = rms_norm_ref(h, w.input_norm, s.eps)
        qkv = (x.float() @ w.qkv.float().T + (w.qkv_bias.float() if w.qkv_bias is not None else 0)).to(dt)
        q = qk_norm_rope_store_ref(qkv, s.num_heads, s.num_kv_heads, positions[:rows], cos, sin, w.key_cache,
                                   w.value_cache, slot_mapping[:rows], w.q_norm, w.k_norm, s.qk_eps)
        attn = torch.zeros(rows, s.num_heads, s.head_dim, dtype=dt, device=h.device)
        paged_attention_ref(q, w.key_cache, w.value_cache, attn, query_start, seq_lens[:rows].long(),
                            block_table[:rows].long(), s.scale, s.window, 1)
        attn = torch.where(real[:, None, None], attn, torch.zeros_like(attn)).reshape(rows, -1)
        h = (h.float() + (attn.float() @ w.o.float().T).to(dt).float()).to(dt)
        x = rms_norm_ref(h, w.post_norm, s.eps)
        gu = (x.float() @ w.gate_up.float().T).to(dt)
        gate, up = gu.chunk(2, dim=-1)
        act_name = "silu" if s.act == "silu" else "gelu_tanh"
        a = act_and_mul_ref(torch.cat([gate, up], -1), act_name)
        h = (h.float() + (a.float() @ w.down.float().T).to(dt).float()).to(dt)
    return h
