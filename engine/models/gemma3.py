"""Gemma 3 text: per-layer sliding/full attention with two RoPE bases, q/k norms, pre- and post-norms
around attention and MLP, embeddings scaled by sqrt(hidden_size), query_pre_attn_scalar."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.kernels.small_m.linear import norm_linear, takes_rows
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderAttention, DecoderModel, input_norm
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.llama import GatedMLP, LlamaForCausalLM
from engine.quantization.fp8 import folded_scales


class Gemma3Attention(DecoderAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        hf = cfg.hf_config
        bias = bool(getattr(hf, "attention_bias", False))
        super().__init__(cfg, layer_id, rotary, qkv_bias=bias, o_bias=bias, scale=hf.query_pre_attn_scalar ** -0.5)

    def add_parameters(self, cfg: ModelConfig) -> None:
        hf = cfg.hf_config
        self.q_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(cfg.head_dim, hf.rms_norm_eps, offset=1.0)
        if getattr(hf, "attn_logit_softcapping", None):
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")

    def qk_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm


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
        h, residual = input_norm(self.input_layernorm, x, residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, h, md))
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def _forward_small_m(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward for a few rows: the input norm runs in the qkv product, the pre-feed-forward add+norm in the
        gate_up product and the activation in the down product (engine/kernels/small_m/linear.py). The
        post-attention norm stays a kernel of its own: it sits between the o_proj product and the residual add."""
        attn, mlp = self.self_attn, self.mlp
        n_in, n_ff = self.input_layernorm, self.pre_feedforward_layernorm
        qkv, residual = norm_linear(x, residual, n_in.weight, n_in.eps, n_in.offset, attn.qkv_proj.weight,
                                    attn.qkv_proj.bias, **folded_scales(attn.qkv_proj))
        o = attn.o_proj(attn.attn.forward_qkv(qkv, positions, md, attn.rotary, attn.q_norm, attn.k_norm))
        gate_up, residual = norm_linear(self.post_attention_layernorm(o), residual, n_ff.weight, n_ff.eps,
                                        n_ff.offset, mlp.gate_up_proj.weight, **folded_scales(mlp.gate_up_proj))
        return self.post_feedforward_layernorm(mlp.forward_gate_up(gate_up)), residual


class Gemma3Model(DecoderModel):
    norm_offset = 1.0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Gemma3DecoderLayer)
        self.embed_scale = math.sqrt(cfg.hidden_size)

    def layer_rotaries(self, cfg: ModelConfig) -> list[RotaryEmbedding]:
        """Sliding layers use the local RoPE base, full layers the global one (with its scaling)."""
        rotaries = {t: RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, layer_type=t)
                    for t in sorted(set(cfg.layer_types))}
        self.rotaries = nn.ModuleDict(rotaries)
        return [rotaries[t] for t in cfg.layer_types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF casts the scale to the weights' dtype before multiplying; do the same for bf16 parity.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
    tie_default = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.final_logit_softcapping = getattr(cfg.hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
