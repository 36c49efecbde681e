"""Presence, frequency and repetition penalties (OpenAI's and HF/vLLM's definitions), batched over positions.

Under speculation a verify step scores k + 1 positions per request, and position j's history is the output so far
plus the drafts before it: `counts` carries that per position, so each position is penalised exactly as a plain
decode at that point would be.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_penalties(logits: Tensor,  # [R, P, V] float32
                    counts: Tensor,  # [R, P, V] float32: each token's count in the output history at the position
                    prompt_mask: Tensor,  # [R, V] bool: tokens of the prompt
                    presence: Tensor,  # [R] float32
                    frequency: Tensor,  # [R] float32
                    repetition: Tensor,  # [R] float32; 1 = off
                    ) -> Tensor:
    """Repetition first (on prompt and output tokens), then frequency and presence (on output tokens): vLLM's
    order. Returns new logits."""
    seen = (counts > 0) | prompt_mask[:, None, :]
    r = repetition[:, None, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency[:, None, None] * counts
    return logits - presence[:, None, None] * (counts > 0).to(logits.dtype)


def apply_penalties_reference(logits: list[float], output: list[int], prompt: list[int], presence: float,
                              frequency: float, repetition: float) -> list[float]:
    """One position, plain Python: the definition the batched version must equal."""
    out = list(logits)
    for v in range(len(out)):
        if v in output or v in prompt:
            out[v] = out[v] / repetition if out[v] > 0 else out[v] * repetition
        n = output.count(v)
        out[v] -= frequency * n + (presence if n else 0.0)
    return out
