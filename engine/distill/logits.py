"""Next-token logits of an HF causal LM at the scored positions of a batch only.

The vocabulary projection is the largest tensor of a distillation step (tokens x vocab, 49152 wide for SmolLM2,
262144 for Gemma 3); computing it only where the loss looks halves or better the memory of a step.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.distill.data import Batch


def logits_at_targets(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """[N, vocab] float32 logits at the N positions of `batch.loss_mask` (row-major order: sequence, then
    position), exactly as the model's own forward would give them there."""
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    logits = model.get_output_embeddings()(hidden[batch.loss_mask]).float()
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2/3 cap logits after the head
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def autocast(device: torch.device) -> torch.autocast:
    """bf16 on GPU (what the engine serves in); a disabled context on CPU, where fp32 is exact and fast enough."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
