"""The Llama family: Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from engine.attention.metadata import AttentionMetadata
from engine.kernels.activation import ACTIVATIONS, act_and_mul
from engine.kernels.persistent.plan import DecoderShape, LayerWeights, PersistentDecoder
from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.small_m.linear import (
    FMA_MAX_ROWS,
    RowSquares,
    act_linear,
    linear_add,
    linear_add_ss,
    norm_linear,
    takes_rows,
)
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from engine.models.layers import MergedColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from engine.quantization.fp8 import folded_scales


class LlamaAttention(DecoderAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        hf = cfg.hf_config
        # Qwen2 always has q/k/v biases and no o bias; the others follow `attention_bias` everywhere.
        is_qwen2 = hf.model_type == "qwen2"
        bias = bool(getattr(hf, "attention_bias", False))
        super().__init__(cfg, layer_id, rotary, qkv_bias=bias or is_qwen2, o_bias=bias and not is_qwen2)

    def add_parameters(self, cfg: ModelConfig) -> None:
        hf = cfg.hf_config
        # Qwen3 normalises q and k per head before RoPE.
        self.qk_norm = hf.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps)

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        return (self.q_norm, self.k_norm) if self.qk_norm else (None, None)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); the activation is SiLU for Llama, tanh-GELU for Gemma."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act = ACT2FN[act]
        self.act_name = act
        # Rows up to which the activation runs as the down projection's prologue (engine/kernels/small_m/linear.py);
        # 0: never. The runner sets it (0 under tensor parallelism, whose down projection is all-reduced).
        self.small_m_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_gate_up(self.gate_up_proj(x))

    def forward_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) from the gate_up projection's output."""
        if self.act_name in ACTIVATIONS and takes_rows(gate_up, self.small_m_rows):
            return act_linear(gate_up, self.act_name, self.down_proj.weight, **folded_scales(self.down_proj))
        if self.act_name in ACTIVATIONS and use_fused_kernels(gate_up):
            return self.down_proj(act_and_mul(gate_up, self.act_name))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        hf = cfg.hf_config
        super().__init__(LlamaAttention(cfg, layer_id, rotary),
                         GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act),
                         RMSNorm(cfg.hidden_size, hf.rms_norm_eps), RMSNorm(cfg.hidden_size, hf.rms_norm_eps))
        self.small_m_rows = 0  # as GatedMLP.small_m_rows, for the whole layer
        # Rows past FMA_MAX_ROWS up to which the layer takes the wide path whatever small_m_rows: where this GPU
        # measured that path faster for the layer's shape (small_m_tiles.WIDE_LAYERS_MEASURED); the runner sets it.
        self.wide_rows = 0
        # Whether the layer's products take the tl.dot forms at every row count (FP8 weights: small_m_tiles.fp8_tiles),
        # so that it takes the wide path from one row: the DOT form's narrow K tiles would make every program of a
        # norm's product walk the whole row for its statistics, which the wide path's products write instead.
        self.dot_products = False

    def product_shapes(self) -> tuple[tuple[int, int], ...]:
        """(N, K) of qkv, o_proj, gate_up and down: the key of the layer's measured tilings."""
        attn, mlp = self.self_attn, self.mlp
        return tuple(tuple(p.weight.shape) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | RowSquares | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | RowSquares]:
        """x: this layer's input before the residual add (the previous layer's MLP output, or the embeddings
        with residual None). Returns (MLP output, residual stream): the add lands in the next norm's kernel. On the
        wide few-row path (5-64 rows) the layer returns (residual stream, RowSquares): the add done already."""
        if (x.shape[0] > FMA_MAX_ROWS or self.dot_products) and takes_rows(x, self.wide_rows):
            return self._forward_wide(positions, x, residual, md)
        if takes_rows(x, self.small_m_rows):
            if x.shape[0] > FMA_MAX_ROWS and self.mlp.act_name in ACTIVATIONS:
                return self._forward_wide(positions, x, residual, md)
            return self._forward_small_m(positions, x, residual, md)
        if isinstance(residual, RowSquares):  # not reached while every layer takes the same rows; x is the stream
            residual = None
        return super().forward(positions, x, residual, md)

    def _forward_small_m(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward for a few rows, norms and adds folded into the products: norm+qkv, attention's prologue,
        attention, o_proj+residual, norm+gate_up, act+down (six launches, seven with split-KV attention)."""
        attn, mlp, n1, n2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv, residual = norm_linear(x, residual, n1.weight, n1.eps, n1.offset, attn.qkv_proj.weight,
                                    attn.qkv_proj.bias, **folded_scales(attn.qkv_proj))
        o = attn.attn.forward_qkv(qkv, positions, md, attn.rotary, *attn.qk_norms())
        residual = linear_add(o, attn.o_proj.weight, attn.o_proj.bias, residual, **folded_scales(attn.o_proj))
        gate_up, _ = norm_linear(residual, None, n2.weight, n2.eps, n2.offset, mlp.gate_up_proj.weight,
                                 **folded_scales(mlp.gate_up_proj))
        return mlp.forward_gate_up(gate_up), residual

    def _forward_wide(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | RowSquares | None,
                      md: AttentionMetadata) -> tuple[torch.Tensor, RowSquares]:
        """forward for 5-64 rows (a tree's or a verify's), the DOT form: each residual add is the epilogue of the
        product before it (o_proj, down), which also writes the sum's row statistics, so the norm after it reads
        [tiles, rows] floats where it would read every row whole in every program; the activation is gate_up's
        epilogue, so down has no prologue. Six launches as at one row: norm+qkv, attention's prologue, attention,
        o_proj+residual, norm+gate_up+act, down+residual."""
        attn, mlp, n1, n2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        if isinstance(residual, RowSquares):
            qkv, residual = norm_linear(x, None, n1.weight, n1.eps, n1.offset, attn.qkv_proj.weight,
                                        attn.qkv_proj.bias, row_ss=residual.ss, **folded_scales(attn.qkv_proj))
        else:
            qkv, residual = norm_linear(x, residual, n1.weight, n1.eps, n1.offset, attn.qkv_proj.weight,
                                        attn.qkv_proj.bias, **folded_scales(attn.qkv_proj))
        o = attn.attn.forward_qkv(qkv, positions, md, attn.rotary, *attn.qk_norms())
        residual, ss = linear_add_ss(o, attn.o_proj.weight, attn.o_proj.bias, residual, **folded_scales(attn.o_proj))
        act, _ = norm_linear(residual, None, n2.weight, n2.eps, n2.offset, mlp.gate_up_proj.weight, row_ss=ss,
                             glu=mlp.act_name, **folded_scales(mlp.gate_up_proj))
        out, ss = linear_add_ss(act, mlp.down_proj.weight, None, residual, **folded_scales(mlp.down_proj))
        return out, RowSquares(ss)


class LlamaModel(DecoderModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, LlamaDecoderLayer)
        # Every layer of a few-row decode step in one launch (engine/kernels/persistent/plan.py); the runner sets it.
        self.persistent: PersistentDecoder | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        pd, c = self.persistent, md.common
        if (pd is not None and md.backend == "triton" and md.tree is None and not self.aux_layer_ids
                and pd.takes(c.num_tokens, c.num_reqs, c.max_query_len)):
            g = md.groups[0]
            return self.norm(pd(x.contiguous(), positions, g.slot_mapping, c.seq_lens, g.block_table))
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                # The stream entering layer i: the embeddings, the stream itself (the wide path's RowSquares), or
                # the last output with the residual its add is deferred to.
                aux.append(x if residual is None or isinstance(residual, RowSquares) else x + residual)
            x, residual = layer(positions, x, residual, md)
        if self.aux_layer_ids:  # in ascending layer order, whatever order the head's config lists them in
            self.aux_hidden = torch.cat(aux, dim=-1)
        if isinstance(residual, RowSquares):  # the wide few-row path: x is the residual stream
            return self.norm(x)
        return self.norm.forward_with_residual(x, residual)[0]


class LlamaForCausalLM(DecoderForCausalLM):
    model_cls = LlamaModel

    def persistent_layers(self) -> tuple[DecoderShape, list[LayerWeights]] | None:
        """The layers as the persistent decoder reads them (after the KV cache is bound), or None where it does not
        apply: an o_proj bias, a model whose layers differ in window, an activation it lacks."""
        layers = self.model.layers
        a0, m0 = layers[0].self_attn, layers[0].mlp
        windows = {layer.self_attn.attn.sliding_window for layer in layers}
        if len(windows) != 1 or a0.o_proj.bias is not None or m0.act_name not in ACTIVATIONS:
            return None
        n0 = layers[0].input_layernorm
        shape = DecoderShape(hidden=self.config.hidden_size, num_heads=a0.num_heads, num_kv_heads=a0.num_kv_heads,
                             head_dim=a0.head_dim, inter=m0.down_proj.weight.shape[1], eps=n0.eps,
                             qk_eps=a0.q_norm.eps if a0.qk_norm else n0.eps, scale=a0.attn.scale,
                             window=windows.pop(), act=m0.act_name)
        weights = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            kv = a.attn.kv_cache
            if kv is None:
                return None
            weights.append(LayerWeights(
                qkv=a.qkv_proj.weight, qkv_bias=a.qkv_proj.bias, o=a.o_proj.weight, gate_up=m.gate_up_proj.weight,
                down=m.down_proj.weight, input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight, q_norm=a.q_norm.weight if a.qk_norm else None,
                k_norm=a.k_norm.weight if a.qk_norm else None, key_cache=kv[0], value_cache=kv[1]))
        return shape, weights
