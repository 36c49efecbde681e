"""GPT-OSS: attention with a learned sink logit per query head, sliding-window (128) and full layers alternating
(two KV-cache groups), YaRN RoPE, biases on q/k/v/o, and an MoE feed-forward (router with bias: top-k of the
logits, softmax over those k; clamped SwiGLU experts with biases, optionally MXFP4-packed). Norms in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.kernels.rms_norm import use_fused_kernels
from engine.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import FusedExperts, route_topk_then_softmax
from engine.parallel import get_tp_group
from engine.quantization import mxfp4


class Fp32RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies the float32 normalised rows before the cast back (GPT-OSS), where Llama casts
    first. The fused kernel keeps Llama's order: one bf16 rounding apart, on GPU only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return super().forward(x)
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_fused_kernels(x):
            return super().forward_with_residual(x, residual)
        s = x + residual
        return self(s), s


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        bias = bool(getattr(hf, "attention_bias", True))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        # One logit per query head (this rank's heads) that joins the softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                              cfg.layer_sliding_windows[layer_id], layer_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The sinks: this rank's query heads of the checkpoint's [num_heads]."""
        rank = get_tp_group().rank
        if loaded.shape != (self.num_heads * get_tp_group().size,):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit the model's "
                             f"({self.num_heads * get_tp_group().size},)")
        param.data.copy_(loaded.narrow(0, rank * self.num_heads, self.num_heads).float())

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn.forward_qkv(self.qkv_proj(x), positions, md, self.rotary, sinks=self.sinks))


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.num_experts_per_tok
        self.num_experts = hf.num_local_experts
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=True)
        self.router.weight.requires_grad_(False)
        self.router.bias.requires_grad_(False)
        packed = mxfp4.quantized(hf, f"model.layers.{layer_id}.mlp.experts")
        self.experts = FusedExperts(self.num_experts, cfg.hidden_size, hf.intermediate_size, bias=True,
                                    activation="swiglu_oai", packed=packed, in_by_out=True,
                                    alpha=getattr(hf, "swiglu_alpha", 1.702), limit=hf.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk_then_softmax(F.linear(x, self.router.weight, self.router.bias), self.top_k)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = cfg.hf_config.rms_norm_eps
        self.self_attn = GptOssAttention(cfg, layer_id, rotary)
        self.mlp = GptOssMoE(cfg, layer_id)
        self.input_layernorm = Fp32RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = Fp32RMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: (MLP output, residual stream before it), the add left to the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h, residual = self.post_attention_layernorm.forward_with_residual(self.self_attn(positions, h, md), residual)
        return self.mlp(h), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)  # YaRN, one table for all layers
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = Fp32RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        return self.norm.forward_with_residual(x, residual)[0]


class GptOssForCausalLM(LlamaForCausalLM):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GptOssModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def persistent_layers(self) -> None:
        """The persistent decoder lays out dense Llama layers only."""
        return None
