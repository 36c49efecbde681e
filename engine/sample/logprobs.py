"""Log-probabilities of emitted tokens, and the most likely tokens at their positions, from the target's logits.

As vLLM's default (`logprobs_mode="raw_logprobs"`), they are the log-softmax of the model's raw logits: before
temperature, top-k and top-p, so they describe the model, not the sampling settings. Under speculative decoding the
verify forward has the target's logits at every emitted position (each accepted draft, then the recovered or bonus
token, each conditioned on the tokens before it), so they are exactly what a plain decode would report.
"""

from __future__ import annotations

import torch

from engine.host_copy import to_device

# One emitted token's logprobs: its own, then (token id, logprob) of the most likely tokens, most likely first.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def emitted_logprobs(logits: torch.Tensor,  # [num_logit_rows, V] raw target logits of the step
                     rows: list[list[int]],  # per request: the logit row of each emitted token
                     tokens: list[list[int]],  # per request: the emitted tokens (same lengths as rows)
                     num_top: list[int],  # per request: how many most likely tokens to list (0: none)
                     ) -> list[list[TokenLogprobs]]:
    """Per request, one (logprob, top tokens) per emitted token."""
    flat_rows = [r for req in rows for r in req]
    if not flat_rows:
        return [[] for _ in rows]
    dev = logits.device
    index = to_device(flat_rows, torch.int64, dev)
    flat_tokens = to_device([t for req in tokens for t in req], torch.int64, dev)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [num emitted, V] float32
    chosen = logprobs.gather(1, flat_tokens[:, None]).squeeze(1)  # [num emitted]
    k = min(max(num_top), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)  # [num emitted, k], queued before the sync
    # SYNC: the values go to the host with the tokens; only for steps where a request asked for logprobs (the first
    # copy waits for the kernels above, the others find them done).
    chosen_host = chosen.tolist()
    top_values: list[list[float]] = values.tolist() if values is not None else []
    top_ids: list[list[int]] = ids.tolist() if ids is not None else []
    out: list[list[TokenLogprobs]] = []
    n = 0
    for req_rows, want in zip(rows, num_top):
        per_token = []
        for _ in req_rows:
            top = list(zip(top_ids[n][:want], top_values[n][:want])) if want else []
            per_token.append((chosen_host[n], top))
            n += 1
        out.append(per_token)
    return out
