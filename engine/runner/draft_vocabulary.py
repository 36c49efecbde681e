"""A draft whose LM head covers part of the vocabulary (EngineConfig.draft_token_map).

A small draft spends a large share of its step on the LM head: a Qwen3-0.6B-shaped draft reads 311 MB of head
(151936 x 1024, bf16) against 881 MB for all 28 layers, at batch 1 where the step is bound by weight bytes. Restricted
to the tokens a workload actually produces (the "hot" tokens: FR-Spec, SGLang's speculative token map, EAGLE-3's
draft vocabulary), the head shrinks by the same factor while the draft still proposes what it proposed before on
nearly every step.

Exactness does not depend on which tokens are kept: the draft's logits of every other token are a very negative
constant, so its q gives them probability 0 (exp underflows to exactly 0 in float32), it never proposes them, and
rejection sampling, which uses that same q, keeps the target's distribution; a greedy target rejects a draft token
that is not its own argmax, as always. The constant is finite, not -inf, so that a row whose every finite logit is
masked (a grammar that allows only tokens outside the map) still has a distribution: there q falls on the allowed
tokens outside the map, which rejection sampling accounts for as any other q.

The map is a file of token ids: a JSON list, or a 1-D integer tensor saved with torch.save (the form SGLang reads).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

# The logit of a token outside the map: exp(MASKED - max) is 0 in float32 for any real max, and it stays finite
# through temperature (down to 1e-6) and penalties, so an all-masked row still softmaxes to a distribution.
MASKED_LOGIT = -1e30


def load_token_map(path: str, vocab_size: int) -> list[int]:
    """The sorted, distinct token ids of a map file; ValueError naming draft_token_map for any bad content."""
    where = f"draft_token_map {path!r}"
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text())
        else:
            t = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError("expected a 1-D integer tensor")
            raw = t.tolist()
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: unreadable ({e}); give a JSON list of token ids or a 1-D integer tensor saved "
                         f"with torch.save") from None
    if not isinstance(raw, list) or not raw or any(not isinstance(i, int) or isinstance(i, bool) for i in raw):
        raise ValueError(f"{where}: expected a non-empty list of integer token ids")
    bad = [i for i in raw if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids must be in [0, {vocab_size}) (the draft's vocabulary), got {bad[:5]}")
    return sorted(set(raw))


class DraftVocabularyHead(nn.Module):
    """The draft's LM head restricted to the map's tokens: [n, hidden] -> [n, num_ids] (the model's
    compute_logits then casts and soft-caps these as it did the whole row); `widen` puts them back in place."""

    def __init__(self, head: nn.Module, ids: list[int], vocab_size: int) -> None:
        super().__init__()
        full = head.weight  # [vocab (per rank), hidden]; one rank: the draft's own head is unsharded
        self.vocab_size = vocab_size
        self.num_ids = len(ids)
        idx = torch.tensor(ids, dtype=torch.long, device=full.device)
        self.contiguous = ids == list(range(len(ids)))
        # A prefix of the vocabulary is a view (no copy; byte-level BPE vocabularies number tokens by merge rank,
        # roughly by frequency); any other map takes its own rows (num_ids x hidden).
        weight = full.detach()[:len(ids)] if self.contiguous else full.detach().index_select(0, idx).contiguous()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("ids", idx, persistent=False)  # [num_ids] int64

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, num_ids] float32 -> [n, vocab_size] float32, MASKED_LOGIT outside the map."""
        out = torch.full((logits.shape[0], self.vocab_size), MASKED_LOGIT, dtype=logits.dtype, device=logits.device)
        if self.contiguous:
            out[:, :self.num_ids] = logits
        else:
            out.index_copy_(1, self.ids, logits)
        return out


def check_token_map(path: str, vocab_size: int, tp_size: int) -> list[int]:
    """The map's ids, after the checks a draft of this vocabulary and tensor-parallel size needs (ValueError)."""
    if tp_size != 1:
        raise ValueError(f"draft_token_map needs the draft in one process (tensor parallel size 1, got {tp_size}): a "
                         f"sharded head would need the map's rows gathered across ranks")
    return load_token_map(path, vocab_size)


def restrict_draft_head(model: nn.Module, path: str, vocab_size: int, tp_size: int) -> DraftVocabularyHead:
    """Swap the draft model's LM head for one over the map's tokens; returns it (its `widen` completes logits).
    The tied embedding (the same tensor) is left whole."""
    head = DraftVocabularyHead(model.lm_head, check_token_map(path, vocab_size, tp_size), vocab_size)
    model.lm_head = head
    return head
