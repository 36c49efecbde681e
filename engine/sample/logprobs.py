"""Log-probabilities of emitted tokens and of prompt tokens, and the most likely tokens at their positions, from
the target's logits.

As vLLM's default (`logprobs_mode="raw_logprobs"`), they are the log-softmax of the model's raw logits: before
temperature, top-k and top-p, so they describe the model, not the sampling settings. Under speculative decoding the
verify forward has the target's logits at every emitted position (each accepted draft, then the recovered or bonus
token, each conditioned on the tokens before it), so they are exactly what a plain decode would report. A prompt's
come from the rows of its prefill chunks, each position scoring the prompt token after it (vLLM's prompt_logprobs).
"""

from __future__ import annotations

import torch

from engine.host_copy import to_device

# One emitted token's logprobs: its own, then (token id, logprob) of the most likely tokens, most likely first.
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# One prompt token's logprobs: its own, its rank in the vocabulary (1: the most likely), then (token id, logprob) of
# the most likely tokens at its position, most likely first.
PromptTokenLogprobs = tuple[float, int, list[tuple[int, float]]]
# Rows log-softmaxed at once: a long prompt's [rows, V] float32 logprobs would otherwise take gigabytes.
_ROWS_AT_ONCE = 512


def emitted_logprobs(logits: torch.Tensor,  # [num_logit_rows, V] raw target logits of the step
                     rows: list[list[int]],  # per request: the logit row of each emitted token
                     tokens: list[list[int]],  # per request: the emitted tokens (same lengths as rows)
                     num_top: list[int],  # per request: how many most likely tokens to list (0: none)
                     ) -> list[list[TokenLogprobs]]:
    """Per request, one (logprob, top tokens) per emitted token."""
    return [[(lp, top) for lp, _, top in req] for req in _scored(logits, rows, tokens, num_top, with_rank=False)]


def prompt_token_logprobs(logits: torch.Tensor,  # [num_logit_rows, V] raw target logits of the step
                          rows: list[list[int]],  # per request: the logit row of each prompt token it predicts
                          tokens: list[list[int]],  # per request: those prompt tokens (same lengths as rows)
                          num_top: list[int],  # per request: how many most likely tokens to list (0: none)
                          ) -> list[list[PromptTokenLogprobs]]:
    """Per request, one (logprob, rank, top tokens) per prompt token, as vLLM's prompt_logprobs report them."""
    return _scored(logits, rows, tokens, num_top, with_rank=True)


def _scored(logits: torch.Tensor, rows: list[list[int]], tokens: list[list[int]], num_top: list[int],
            with_rank: bool) -> list[list[PromptTokenLogprobs]]:
    """Per request, (logprob, rank or 0, top tokens) per row: log_softmax of the row's logits, gathered."""
    flat_rows = [r for req in rows for r in req]
    flat_tokens = [t for req in tokens for t in req]
    k = min(max(num_top, default=0), logits.shape[-1])
    chosen: list[float] = []
    ranks: list[int] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for lo in range(0, len(flat_rows), _ROWS_AT_ONCE):
        index = to_device(flat_rows[lo:lo + _ROWS_AT_ONCE], torch.int64, logits.device)
        target = to_device(flat_tokens[lo:lo + _ROWS_AT_ONCE], torch.int64, logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [rows, V] float32
        own = logprobs.gather(1, target[:, None])  # [rows, 1]
        rank = (logprobs > own).sum(dim=1) + 1 if with_rank else None  # [rows]
        values, ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)  # [rows, k], queued before the sync
        # SYNC: the values go to the host with the tokens; only in steps where a request asked for logprobs (the
        # first copy waits for the kernels above, the others find them done).
        chosen.extend(own.squeeze(1).tolist())
        ranks.extend(rank.tolist() if rank is not None else [0] * len(index))
        if values is not None and ids is not None:
            top_values.extend(values.tolist())
            top_ids.extend(ids.tolist())
    out: list[list[PromptTokenLogprobs]] = []
    n = 0
    for req_rows, want in zip(rows, num_top):
        per_token = []
        for _ in req_rows:
            top = list(zip(top_ids[n][:want], top_values[n][:want])) if want else []
            per_token.append((chosen[n], ranks[n], top))
            n += 1
        out.append(per_token)
    return out
