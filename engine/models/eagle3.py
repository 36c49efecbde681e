"""The EAGLE-3 head: one decoder layer over concat(embedding, hidden state), fed by the target's auxiliary states.

A head position p pairs the token at p + 1 with a hidden state of position p: the target's auxiliary states there
(the residual stream entering each of its auxiliary layers, concatenated, brought to the head's width by `fc`), or,
for a position the head drafts itself, the head's own pre-norm output at p - 1. The layer normalises the embedding
(input_layernorm) and the hidden state (hidden_norm), feeds their concatenation ([n, 2 * hidden]) to q/k/v, and
keeps the hidden state (normalised or not: norm_before_residual) as the residual. The final norm's input is the
pre-norm state the next draft step feeds; its output goes through the head's LM head over the draft vocabulary,
whose ids map to the target's through d2t (target id = draft id + d2t[draft id]).

Three speculators options change that math (as the speculators library defines them): norm_before_fc (one RMSNorm
over the concatenated auxiliary states before fc: `input_norm`, as gpt-oss heads are trained), fc_norm (an RMSNorm
per auxiliary state before the concatenation: `fc_norm.i`) and norm_output (the state a draft step feeds the next is
the final norm's output, not its input: Eagle 3.1).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.kernels.speculation.argmax import greedy_tokens
from engine.models.eagle3_config import Eagle3ModelConfig
from engine.models.layers import ParallelLMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from engine.models.llama import GatedMLP, LlamaAttention
from engine.models.loader import load_weights


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.self_attn = LlamaAttention(cfg, 0, rotary)
        # q/k/v read the embedding and the hidden state side by side.
        attn = self.self_attn
        self.self_attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                                    cfg.num_kv_heads, attn.qkv_proj.bias is not None)
        self.mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """embeds, hidden: [n, hidden_size] -> the layer's output stream (pre-norm) [n, hidden_size]."""
        e = self.input_layernorm(embeds)
        if self.norm_before_residual:
            h = self.hidden_norm(hidden)
            residual = h
        else:
            residual = hidden
            h = self.hidden_norm(hidden)
        a = self.self_attn(positions, torch.cat([e, h], dim=-1), md)
        h, residual = self.post_attention_layernorm.forward_with_residual(a, residual)
        return self.mlp(h) + residual


class Eagle3Head(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard id), as LlamaForCausalLM's
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    tie_word_embeddings = False

    def __init__(self, cfg: Eagle3ModelConfig, own_embedding: bool) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        # Without an embedding of its own the head reads the target's (`share_embedding`), kept out of the module
        # tree so the loader does not ask the checkpoint for it.
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h) if own_embedding else None
        self._shared_embedding: list[VocabParallelEmbedding] = []
        num_aux, eps = len(cfg.aux_layer_ids), cfg.hf_config.rms_norm_eps
        self.input_norm = RMSNorm(num_aux * cfg.target_hidden_size, eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, eps) for _ in range(num_aux)]
                                     ) if cfg.fc_norm else None
        self.norm_output = cfg.norm_output
        self.fc = nn.Linear(num_aux * cfg.target_hidden_size, h, bias=False)
        self.fc.weight.requires_grad_(False)
        rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len)
        self.layer = Eagle3DecoderLayer(cfg, rotary)
        self.norm = RMSNorm(h, cfg.hf_config.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h)
        # [draft_vocab] int64: the target id of each draft id (d2t's offsets added). t2d, which only marks the target
        # ids the draft vocabulary covers, is not needed to draft.
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))

    def share_embedding(self, embedding: VocabParallelEmbedding) -> None:
        """The target's embedding, for a head without one of its own."""
        if self.embed_tokens is None:
            self._shared_embedding[:] = [embedding]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens if self.embed_tokens is not None else (self._shared_embedding or [None])[0]
        if emb is None:
            raise RuntimeError("the EAGLE-3 head has no embedding: share the target's first (share_embedding)")
        return emb(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                hidden: torch.Tensor | None = None, from_target: bool = False) -> torch.Tensor:
        """input_ids, positions: [n]; hidden: [n, len(aux) * target_hidden], the target's auxiliary states
        (from_target: through fc), or [n, hidden_size], the head's own pre-norm outputs; None: zeros (the runner's
        padding-only warm-up forwards, which read and write no KV). Returns the pre-norm output [n, hidden_size]."""
        if hidden is None:
            hidden = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.fc.weight.dtype,
                                 device=input_ids.device)
            from_target = False
        if from_target:
            hidden = self.fc(self._fc_input(hidden))
        return self.layer(positions, self.embed(input_ids), hidden, md)

    def _fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, len(aux) * target_hidden] target states through the head's input norms (none by default)."""
        if self.input_norm is not None:
            return self.input_norm(aux)
        if self.fc_norm is not None:
            parts = aux.chunk(len(self.fc_norm), dim=-1)
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return aux

    def next_state(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[n, hidden] the state a draft step hands the next: the layer's output, or with norm_output its final
        norm's."""
        return self.norm(prenorm) if self.norm_output else prenorm

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[n, hidden] pre-norm states -> [n, draft vocab] logits in the head's dtype."""
        return self.lm_head(self.norm(prenorm))

    def greedy_ids(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n] int64 target ids of the rows' argmax. Taken over the draft vocabulary, then mapped: a greedy step
        never builds the target-wide logits (a fill, a scatter and an argmax over 150k float32 columns cost a
        Qwen3-8B head's graphed step a few us of its 305) and the argmax runs in slices
        (engine/kernels/speculation/argmax.py)."""
        return self.draft_to_target[greedy_tokens(draft_logits)]

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n, draft vocab] -> [n, target vocab] float32: the draft vocabulary's logits at their target ids, -inf
        elsewhere (so the softmax is the draft's distribution scattered over the target's vocabulary)."""
        out = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf"),
                                    dtype=torch.float32)
        out[:, self.draft_to_target] = draft_logits.float()
        return out

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[n, hidden] pre-norm states -> [n, target vocab] float32 (to_target of draft_logits)."""
        return self.to_target(self.draft_logits(prenorm))

    def attention_layers(self) -> list[Attention]:
        return [self.layer.self_attn.attn]


def _checkpoint_tensors(cfg: Eagle3ModelConfig) -> dict[str, torch.Tensor]:
    files = sorted(cfg.path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {cfg.path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = sf.get_tensor(name)
    return out


def _canonical(name: str) -> str:
    """A checkpoint name in the head's module names: midlayer.* (flat) and layers.0.* (speculators) -> layer.*."""
    for prefix in ("model.", ""):
        if name.startswith(prefix + "midlayer."):
            return "layer." + name[len(prefix + "midlayer."):]
        if name.startswith(prefix + "layers.0."):
            return "layer." + name[len(prefix + "layers.0."):]
    if name.startswith("model.") and name[len("model."):] in ("embed_tokens.weight", "fc.weight", "norm.weight"):
        return name[len("model."):]
    return name


def draft_to_target_ids(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[draft_vocab] int64 target ids from a checkpoint's d2t offsets; checked to be distinct target ids."""
    d2t = d2t.to(torch.int64)
    ids = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t
    if ids.min() < 0 or ids.max() >= target_vocab:
        raise ValueError(f"d2t maps draft ids outside the target's vocabulary of {target_vocab}")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("d2t maps two draft ids to one target id")
    return ids


def build_eagle3_head(cfg: Eagle3ModelConfig, device: torch.device, dtype: torch.dtype,
                      load_format: str = "auto") -> Eagle3Head:
    """The head on `device` in `dtype`, weights loaded from its checkpoint (either format); every parameter must be
    set. load_format "dummy": random weights and an identity d2t (benchmarks of a shape from its config.json)."""
    tensors = _checkpoint_tensors(cfg) if load_format != "dummy" else {}
    canon = {_canonical(n): t for n, t in tensors.items()}
    own_embedding = "embed_tokens.weight" in canon
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(cfg, own_embedding)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(0)
        for p in head.parameters():
            if p.dim() == 2:  # norms keep their neutral built values
                p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
        return head.eval()
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    d2t = canon.pop("d2t", None)
    canon.pop("t2d", None)
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"{cfg.path}: a draft vocabulary of {cfg.draft_vocab_size} tokens needs its d2t map")
    else:
        if d2t.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"{cfg.path}: d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)")
        head.draft_to_target.copy_(draft_to_target_ids(d2t, cfg.vocab_size))
    load_weights(head, _iter(canon))  # type: ignore[arg-type]
    return head.eval()


def _iter(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from tensors.items()
