"""Qwen3-MoE: Qwen3's attention (q/k norms, no biases) over layers whose feed-forward is a sparse MoE block
(float32 softmax over the experts, top-k, renormalised with norm_topk_prob; plain SwiGLU experts) except the
dense ones: those in mlp_only_layers and those off the decoder_sparse_step."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig
from engine.models.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from engine.models.llama import GatedMLP, LlamaAttention, LlamaForCausalLM
from engine.models.moe import FusedExperts, route_softmax_then_topk


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
        weights, ids = route_softmax_then_topk(F.linear(x, self.gate.weight), self.top_k, self.normalize)
        return self.experts(x, weights, ids)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.self_attn = LlamaAttention(cfg, layer_id, rotary)
        self.mlp: nn.Module = (Qwen3SparseMoE(cfg) if is_sparse_layer(hf, layer_id)
                               else GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act))
        self.input_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: (MLP output, residual stream before it), the add left to the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h, residual = self.post_attention_layernorm.forward_with_residual(self.self_attn(positions, h, md), residual)
        return self.mlp(h), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        return self.norm.forward_with_residual(x, residual)[0]


# A checkpoint stores each expert's Linear weights apart: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight.
_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 2)}


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg.hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_target(self, name: str) -> tuple[str, tuple[int, int]] | None:
        """(our parameter, shard) of a per-expert checkpoint tensor; None: the loader's usual mapping."""
        m = _EXPERT_WEIGHT.match(name)
        if m is None:
            return None
        param, part = _EXPERT_PART[m.group(3)]
        return f"{m.group(1)}.{param}", (int(m.group(2)), part)

    def persistent_layers(self) -> None:
        """The persistent decoder lays out dense Llama layers only."""
        return None
