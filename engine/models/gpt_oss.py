"""GPT-OSS: attention with a learned sink logit per query head, sliding-window (128) and full layers alternating
(two KV-cache groups), YaRN RoPE, biases on q/k/v/o, and an MoE feed-forward (router with bias: top-k of the
logits, softmax over those k; clamped SwiGLU experts with biases, optionally MXFP4-packed). Norms in float32."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.rms_norm import use_fused_kernels
from engine.model_config import ModelConfig
from engine.models.decoder import (
    QKV_PACKED,
    DecoderAttention,
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.moe import FusedExperts, route_tokens
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


class GptOssAttention(DecoderAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        bias = bool(getattr(cfg.hf_config, "attention_bias", True))
        super().__init__(cfg, layer_id, rotary, qkv_bias=bias, o_bias=bias)

    def add_parameters(self, cfg: ModelConfig) -> None:
        # One logit per query head (this rank's heads) that joins the softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The sinks: this rank's query heads of the checkpoint's [num_heads]."""
        rank = get_tp_group().rank
        if loaded.shape != (self.num_heads * get_tp_group().size,):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit the model's "
                             f"({self.num_heads * get_tp_group().size},)")
        param.data.copy_(loaded.narrow(0, rank * self.num_heads, self.num_heads).float())

    def sink_logits(self) -> torch.Tensor:
        return self.sinks


class GptOssMoE(nn.Module):
    softmax_first = False  # GPT-OSS routes by the top-k logits, then a softmax over those k

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.top_k = hf.num_experts_per_tok
        self.num_experts = hf.num_local_experts
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=True)
        self.router.weight.requires_grad_(False)
        self.router.bias.requires_grad_(False)
        packed = mxfp4.quantized(hf, f"model.layers.{layer_id}.mlp.experts")
        # Older transformers' GptOssConfig holds neither key; gpt-oss's values are 1.702 and 7.0.
        self.experts = FusedExperts(self.num_experts, cfg.hidden_size, hf.intermediate_size, bias=True,
                                    activation="swiglu_oai", packed=packed, in_by_out=True,
                                    alpha=getattr(hf, "swiglu_alpha", 1.702), limit=getattr(hf, "swiglu_limit", 7.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_tokens(x, self.router.weight, self.router.bias, self.top_k, self.softmax_first)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        eps = cfg.hf_config.rms_norm_eps
        super().__init__(GptOssAttention(cfg, layer_id, rotary), GptOssMoE(cfg, layer_id),
                         Fp32RMSNorm(cfg.hidden_size, eps), Fp32RMSNorm(cfg.hidden_size, eps))


class GptOssModel(DecoderModel):
    """YaRN RoPE, one table for all layers; the final norm in float32 as the layers'."""

    norm_cls = Fp32RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, GptOssDecoderLayer)


class GptOssForCausalLM(DecoderForCausalLM):
    packed_modules = QKV_PACKED
    model_cls = GptOssModel
