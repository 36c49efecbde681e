"""Gemma 3 text: per-layer sliding/full attention with two RoPE bases, q/k norms, pre- and post-norms
around attention and MLP, embeddings scaled by sqrt(hidden_size), query_pre_attn_scalar."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.kernels.small_m_linear import norm_linear, takes_rows
from engine.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.models.llama import GatedMLP, LlamaForCausalLM


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps, offset=1.0)
        self.rotary = rotary
        if getattr(hf, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, hf.query_pre_attn_scalar ** -0.5,
                              cfg.layer_sliding_windows[layer_id], layer_id)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn.forward_qkv(self.qkv_proj(x), positions, md, self.rotary, self.q_norm,
                                                 self.k_norm))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = hf.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_id, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_activation)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset=1.0)
        self.small_m_rows = 0  # as GatedMLP.small_m_rows, for the whole layer

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (post-feed-forward-normed MLP output, residual stream)."""
        if takes_rows(x, self.small_m_rows):
            return self._forward_small_m(positions, x, residual, md)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, h, md))
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def _forward_small_m(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward for a few rows: the input norm runs in the qkv product, the pre-feed-forward add+norm in the
        gate_up product and the activation in the down product (engine/kernels/small_m_linear.py). The
        post-attention norm stays a kernel of its own: it sits between the o_proj product and the residual add."""
        attn, mlp = self.self_attn, self.mlp
        n_in, n_ff = self.input_layernorm, self.pre_feedforward_layernorm
        qkv, residual = norm_linear(x, residual, n_in.weight, n_in.eps, n_in.offset, attn.qkv_proj.weight,
                                    attn.qkv_proj.bias)
        o = attn.o_proj(attn.attn.forward_qkv(qkv, positions, md, attn.rotary, attn.q_norm, attn.k_norm))
        gate_up, residual = norm_linear(self.post_attention_layernorm(o), residual, n_ff.weight, n_ff.eps,
                                        n_ff.offset, mlp.gate_up_proj.weight)
        return self.post_feedforward_layernorm(mlp.forward_gate_up(gate_up)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        # Sliding layers use the local RoPE base, full layers the global one (with its scaling).
        rotaries = {t: RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, layer_type=t)
                    for t in sorted(set(cfg.layer_types))}
        self.rotaries = nn.ModuleDict(rotaries)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, rotaries[cfg.layer_types[i]])
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps, offset=1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF casts the scale to the weights' dtype before multiplying; do the same for bf16 parity.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        return self.norm.forward_with_residual(x, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg.hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = getattr(cfg.hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
