"""Qwen3-MoE: Qwen3's attention (q/k norms, no biases) over layers whose feed-forward is a sparse MoE block
(float32 softmax over the experts, top-k, renormalised with norm_topk_prob; plain SwiGLU experts) except the
dense ones: those in mlp_only_layers and those off the decoder_sparse_step."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.llama import GatedMLP, LlamaAttention
from engine.models.moe import FusedExperts, route_tokens


def is_sparse_layer(hf_config: object, layer_id: int) -> bool:
    """Whether the layer's feed-forward is the MoE block (transformers' rule for Qwen3-MoE)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and getattr(hf_config, "num_experts", 0) > 0 and (layer_id + 1) % step == 0)


class Qwen3SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.top_k, self.num_experts = hf.num_experts_per_tok, hf.num_experts
        self.normalize = bool(hf.norm_topk_prob)
        self.gate = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        if hf.hidden_act != "silu":
            raise ValueError(f"Qwen3-MoE experts with activation {hf.hidden_act!r} are not supported (silu only)")
        self.experts = FusedExperts(self.num_experts, cfg.hidden_size, hf.moe_intermediate_size, bias=False,
                                    activation="silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_tokens(x, self.gate.weight, None, self.top_k, True, self.normalize)
        return self.experts(x, weights, ids)


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        hf = cfg.hf_config
        attn = LlamaAttention(cfg, layer_id, rotary)
        mlp = (Qwen3SparseMoE(cfg) if is_sparse_layer(hf, layer_id)
               else GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act))
        eps = hf.rms_norm_eps
        super().__init__(attn, mlp, RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps))


class Qwen3MoeModel(DecoderModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Qwen3MoeDecoderLayer)


# A checkpoint stores each expert's Linear weights apart: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight.
_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 2)}


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    model_cls = Qwen3MoeModel

    def checkpoint_target(self, name: str) -> tuple[str, tuple[int, int]] | None:
        """(our parameter, shard) of a per-expert checkpoint tensor; None: the loader's usual mapping."""
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            return None
        param, part = _EXPERT_PART[m.group(3)]
        return f"{m.group(1)}.{param}", (int(m.group(2)), part)
