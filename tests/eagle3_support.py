"""EAGLE-3 heads for the tests: random heads written in both public checkpoint formats, and an independent plain-torch
reference of the head's drafting (the target's auxiliary states from HF transformers' output_hidden_states)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


@dataclass
class HeadWeights:
    """One head's tensors by their module names (the layer's under `layer.`), and its shape."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    draft_vocab: int
    layer_type: str  # "llama" | "qwen3" (q/k norms)
    aux_layers: tuple[int, ...]
    norm_before_residual: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    eps: float = 1e-6
    # The speculators options (input_norm / fc_norm.i weights in `tensors` where set).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def target_ids(self) -> torch.Tensor:  # [draft_vocab] int64
        return torch.arange(self.draft_vocab) + self.tensors["d2t"]


def random_head(target_config, *, draft_vocab: int = 48, seed: int = 0, layer_type: str = "llama",
                aux_layers: tuple[int, ...] | None = None, norm_before_residual: bool = False,
                scale: float = 4.0, norm_before_fc: bool = False, fc_norm: bool = False,
                norm_output: bool = False) -> HeadWeights:
    """A random head for `target_config`'s hidden states; matrices scaled up (peaked distributions, clear argmaxes)
    and norm weights away from 1 (so a skipped norm shows). norm_before_fc, fc_norm, norm_output: the speculators
    options (their norms' weights drawn too)."""
    g = torch.Generator().manual_seed(seed)
    h, nh, nkv, hd = target_config.hidden_size, 4, 2, 16
    inter, vocab = 96, target_config.vocab_size
    n = target_config.num_hidden_layers
    aux = aux_layers if aux_layers is not None else (2, n // 2, n - 3)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * scale / math.sqrt(cols)

    def norm(dim: int) -> torch.Tensor:
        return 0.5 + torch.rand(dim, generator=g)

    t = {
        "fc.weight": mat(h, len(aux) * h),
        "layer.self_attn.q_proj.weight": mat(nh * hd, 2 * h),
        "layer.self_attn.k_proj.weight": mat(nkv * hd, 2 * h),
        "layer.self_attn.v_proj.weight": mat(nkv * hd, 2 * h),
        "layer.self_attn.o_proj.weight": mat(h, nh * hd),
        "layer.mlp.gate_proj.weight": mat(inter, h),
        "layer.mlp.up_proj.weight": mat(inter, h),
        "layer.mlp.down_proj.weight": mat(h, inter),
        "layer.input_layernorm.weight": norm(h),
        "layer.hidden_norm.weight": norm(h),
        "layer.post_attention_layernorm.weight": norm(h),
        "norm.weight": norm(h),
        "lm_head.weight": mat(draft_vocab, h),
    }
    if layer_type == "qwen3":
        t["layer.self_attn.q_norm.weight"] = norm(hd)
        t["layer.self_attn.k_norm.weight"] = norm(hd)
    # The draft vocabulary: a random subset of the target's ids, ascending (as the trainers build it).
    target_ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t["d2t"] = target_ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    t["t2d"] = t2d
    if norm_before_fc:
        t["input_norm.weight"] = norm(len(aux) * h)
    if fc_norm:
        for i in range(len(aux)):
            t[f"fc_norm.{i}.weight"] = norm(h)
    return HeadWeights(h, nh, nkv, hd, inter, vocab, draft_vocab, layer_type, tuple(aux), norm_before_residual, t,
                       norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output)


def _layer_config(w: HeadWeights) -> dict:
    return dict(model_type=w.layer_type, hidden_size=w.hidden, intermediate_size=w.inter,
                num_attention_heads=w.num_heads, num_key_value_heads=w.num_kv_heads, head_dim=w.head_dim,
                num_hidden_layers=1, vocab_size=w.vocab, max_position_embeddings=512, rms_norm_eps=w.eps,
                hidden_act="silu", tie_word_embeddings=False)


def write_flat(w: HeadWeights, path: Path, aux_in_config: bool = True) -> str:
    """The EAGLE / SpecForge layout: LlamaForCausalLMEagle3, midlayer.*, no embedding."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**_layer_config(w), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": w.draft_vocab}
    if w.layer_type != "llama":
        raise ValueError("the flat format's layer is a Llama layer")
    if aux_in_config:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(w.aux_layers)}
    if w.norm_before_residual:
        cfg["norm_before_residual"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {(("midlayer." + k[len("layer."):]) if k.startswith("layer.") else k): v.contiguous()
               for k, v in w.tensors.items()}
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def write_speculators(w: HeadWeights, path: Path, embedding: torch.Tensor | None = None) -> str:
    """The speculators layout: Eagle3Speculator, transformer_layer_config, layers.0.*, an embedding where given."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": _layer_config(w), "draft_vocab_size": w.draft_vocab,
           "norm_before_residual": w.norm_before_residual, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": list(w.aux_layers), "norm_before_fc": w.norm_before_fc,
           "fc_norm": w.fc_norm, "norm_output": w.norm_output}
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {(("layers.0." + k[len("layer."):]) if k.startswith("layer.") else k): v.contiguous()
               for k, v in w.tensors.items()}
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding.detach().clone().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


# ------------------------------------------------------------------------------------------------------------
# The reference: plain torch, the whole sequence recomputed at every draft step (no KV cache).
# ------------------------------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [T, heads, d] rotated by position (the half-split layout Llama checkpoints use)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [T, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_head_layer(w: HeadWeights, emb: torch.Tensor, hidden: torch.Tensor,
                         skip_hidden_norm: bool = False) -> torch.Tensor:
    """emb, hidden [T, H] (the hidden at the head's width) -> the layer's pre-norm output [T, H], causal."""
    t = w.tensors
    T = emb.shape[0]
    e = _rms(emb, t["layer.input_layernorm.weight"], w.eps)
    hn = hidden if skip_hidden_norm else _rms(hidden, t["layer.hidden_norm.weight"], w.eps)
    residual = hn if w.norm_before_residual else hidden
    x = torch.cat([e, hn], dim=-1)
    q = (x @ t["layer.self_attn.q_proj.weight"].T).view(T, w.num_heads, w.head_dim)
    k = (x @ t["layer.self_attn.k_proj.weight"].T).view(T, w.num_kv_heads, w.head_dim)
    v = (x @ t["layer.self_attn.v_proj.weight"].T).view(T, w.num_kv_heads, w.head_dim)
    if w.layer_type == "qwen3":
        q = _rms(q, t["layer.self_attn.q_norm.weight"], w.eps)
        k = _rms(k, t["layer.self_attn.k_norm.weight"], w.eps)
    pos = torch.arange(T)
    q, k = _rope(q, pos), _rope(k, pos)
    rep = w.num_heads // w.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(w.head_dim)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    h = o @ t["layer.self_attn.o_proj.weight"].T + residual
    m = _rms(h, t["layer.post_attention_layernorm.weight"], w.eps)
    mlp = (F.silu(m @ t["layer.mlp.gate_proj.weight"].T) * (m @ t["layer.mlp.up_proj.weight"].T)) \
        @ t["layer.mlp.down_proj.weight"].T
    return mlp + h


def reference_drafts(w: HeadWeights, target_hf: torch.nn.Module, context: list[int], k: int,
                     aux_layers: tuple[int, ...] | None = None, skip_hidden_norm: bool = False,
                     target_ids: torch.Tensor | None = None, skip_fc_norms: bool = False,
                     feed_prenorm: bool = False) -> list[int]:
    """The head's k greedy drafts after `context` (prompt and output so far; its last token has no target state
    yet). The keyword arguments break the reference on purpose (the tests show each makes it disagree): skip_fc_norms
    leaves out norm_before_fc's and fc_norm's norms, feed_prenorm ignores norm_output."""
    aux_layers = aux_layers if aux_layers is not None else w.aux_layers
    ids = target_ids if target_ids is not None else w.target_ids
    with torch.no_grad():
        out = target_hf(torch.tensor([context]), output_hidden_states=True)
        # hidden_states[i]: the residual stream entering layer i (0: the embeddings).
        aux = torch.cat([out.hidden_states[i][0] for i in sorted(aux_layers)], dim=-1)[:-1]  # [T, 3H]
        embed = target_hf.get_input_embeddings().weight
        tokens = list(context[1:])  # the token each head position pairs with its state
        aux = aux.float()
        if w.norm_before_fc and not skip_fc_norms:
            aux = _rms(aux, w.tensors["input_norm.weight"], w.eps)
        if w.fc_norm and not skip_fc_norms:
            parts = aux.chunk(len(aux_layers), dim=-1)
            aux = torch.cat([_rms(x, w.tensors[f"fc_norm.{i}.weight"], w.eps) for i, x in enumerate(parts)], dim=-1)
        hidden = aux @ w.tensors["fc.weight"].T  # [T, H]
        drafts: list[int] = []
        for _ in range(k):
            pre = reference_head_layer(w, embed[torch.tensor(tokens)], hidden, skip_hidden_norm)
            last = pre[-1]
            normed = _rms(last, w.tensors["norm.weight"], w.eps)
            logits = normed @ w.tensors["lm_head.weight"].T
            d = int(ids[int(logits.argmax())])
            drafts.append(d)
            tokens.append(d)
            # Eagle 3.1 (norm_output): the next step reads the final norm's output.
            fed = normed if w.norm_output and not feed_prenorm else last
            hidden = torch.cat([hidden, fed[None]], dim=0)
    return drafts
