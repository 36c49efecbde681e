"""The decoder scaffolding every model family builds on: attention's projections around the attention layer, the
pre-norm decoder layer, the embeddings -> layers -> final norm model, and the causal LM over it (LM head, tied
embeddings, the checkpoint's fused-name mapping). A family file adds what is its own (its norms, its feed-forward,
its fast paths) on top."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.kernels.small_m.linear import linear_add, norm_linear, takes_rows
from engine.model_config import ModelConfig
from engine.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from engine.quantization.fp8 import folded_scales

# checkpoint name fragment -> (our fused parameter fragment, shard id): q/k/v into the fused qkv projection
QKV_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
# ... and gate/up into the gated MLP's fused gate_up projection
GATE_UP_PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DecoderAttention(nn.Module):
    """The fused qkv projection, the attention layer (RoPE and the KV cache inside) and o_proj. A family adds its
    q/k norms or sinks in `add_parameters`, which runs between the projections and the attention layer."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 scale: float | None = None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.add_parameters(cfg)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5 if scale is None else scale,
                              cfg.layer_sliding_windows[layer_id], layer_id)

    def add_parameters(self, cfg: ModelConfig) -> None:
        """A family's own attention parameters (q/k norms, sinks); none here."""

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        """(q_norm, k_norm) applied per head before RoPE, or (None, None)."""
        return None, None

    def sink_logits(self) -> torch.Tensor | None:
        """[num_heads] float32 sink logits (GPT-OSS), or None."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, md, self.rotary, *self.qk_norms(),
                                                 sinks=self.sink_logits()))


def input_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm over the deferred residual add: (norm(x + residual), x + residual), or (norm(x), x) on
    the first layer, whose x is the embeddings and has no residual yet."""
    if residual is None:
        return norm(x), x
    return norm.forward_with_residual(x, residual)


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), each add deferred into the next norm's kernel.

    Up to `small_m_rows` rows (a decode, a verify, a draft's steps; the runner sets it: ModelRunner._set_small_m_rows)
    the attention's products fold the input norm and the residual add (engine/kernels/small_m/linear.py), biases
    included, and the feed-forward runs as it is after the post-attention norm: the MoE layers' path (GPT-OSS,
    Qwen3-MoE), whose feed-forward has kernels of its own. cuBLAS took qkv and o_proj with their biases there, and the
    norms and adds were launches of their own. Llama and Gemma 3 fold their MLPs too (their own forwards)."""

    small_m_rows = 0

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input before the residual add (the previous layer's MLP output, or the embeddings with
        residual None). Returns (MLP output, residual stream before it): the add lands in the next norm's kernel."""
        if takes_rows(x, self.small_m_rows):
            return self._forward_small_m(positions, x, residual, md)
        h, residual = input_norm(self.input_layernorm, x, residual)
        h, residual = self.post_attention_layernorm.forward_with_residual(self.self_attn(positions, h, md), residual)
        return self.mlp(h), residual

    def _forward_small_m(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward for a few rows: norm+qkv, attention, o_proj+residual in the folded kernels, then the post-attention
        norm and the feed-forward; the feed-forward's output's add is deferred as in `forward`."""
        attn, n1, n2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        qkv, residual = norm_linear(x, residual, n1.weight, n1.eps, n1.offset, attn.qkv_proj.weight,
                                    attn.qkv_proj.bias, **folded_scales(attn.qkv_proj))
        o = attn.attn.forward_qkv(qkv, positions, md, attn.rotary, *attn.qk_norms(), sinks=attn.sink_logits())
        residual = linear_add(o, attn.o_proj.weight, attn.o_proj.bias, residual, **folded_scales(attn.o_proj))
        return self.mlp(n2(residual)), residual


# (cfg, layer_id, the layer's rotary embedding) -> the decoder layer
LayerFactory = Callable[[ModelConfig, int, RotaryEmbedding], nn.Module]


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm. One rotary table for every layer unless a family's `layer_rotaries` says
    otherwise; the final norm is `norm_cls` with `norm_offset` (Gemma's (1 + w))."""

    norm_cls: type[RMSNorm] = RMSNorm
    norm_offset = 0.0

    def __init__(self, cfg: ModelConfig, layer: LayerFactory) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotaries = self.layer_rotaries(cfg)
        self.layers = nn.ModuleList(layer(cfg, i, rotaries[i]) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.hf_config.rms_norm_eps, offset=self.norm_offset)
        # Layers whose incoming residual stream each forward keeps for an EAGLE-3 head (set before the runner
        # captures its graphs: engine/speculation/speculative_step.py); (): none kept.
        self.aux_layer_ids: tuple[int, ...] = ()
        # [num_tokens, len(aux_layer_ids) * hidden_size] of the last forward, the streams side by side in ascending
        # layer order (a graph replay restores its own: engine/runner/cuda_graphs.py); None without aux_layer_ids.
        self.aux_hidden: torch.Tensor | None = None

    def layer_rotaries(self, cfg: ModelConfig) -> list[RotaryEmbedding]:
        """The rotary embedding of each layer: one table shared by all."""
        return [RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)] * cfg.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:  # the stream entering layer i: the last output plus its deferred residual
                aux.append(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, md)
        if self.aux_layer_ids:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm.forward_with_residual(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The model and its LM head (tied to the embeddings where the config says so, `tie_default` where it is
    silent); `packed_modules` maps the checkpoint's separate projections onto our fused ones."""

    packed_modules: dict[str, tuple[str, str | int]] = {**QKV_PACKED, **GATE_UP_PACKED}
    model_cls: type[nn.Module]
    tie_default = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg.hf_config, "tie_word_embeddings", self.tie_default))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def persistent_layers(self) -> None:
        """The persistent decoder lays out dense Llama layers only."""
        return None
