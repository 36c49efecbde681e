"""Per-request token masks and biases: logit_bias, allowed_token_ids, bad words, min_tokens, min_p.

Each works on one request's [P, V] logits (P positions of a verify step, position j after j drafts) with that
position's output history, so a speculative step masks exactly what a plain decode at that point would mask.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEG_INF = float("-inf")


def apply_logit_bias(logits: Tensor, bias: dict[int, float]) -> Tensor:
    """logits: [P, V]; the bias is added at every position (OpenAI: to the logits before sampling)."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def apply_allowed_token_ids(logits: Tensor, allowed: list[int] | None) -> Tensor:
    """logits: [P, V]; every token outside `allowed` is masked (None: all allowed)."""
    if allowed is None:
        return logits
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[torch.tensor(allowed, dtype=torch.int64, device=logits.device)] = True
    return logits.masked_fill(~keep, NEG_INF)


def bad_word_bans(bad_words: list[list[int]], histories: list[list[int]]) -> list[list[int]]:
    """Per position (its output history), the tokens to ban: each bad word's last token when the history ends with
    the rest of the word (always, for a one-token word). vLLM's rule, on output tokens."""
    bans = []
    for history in histories:
        ban = []
        for word in bad_words:
            prefix = word[:-1]
            if not prefix or (len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix):
                ban.append(word[-1])
        bans.append(ban)
    return bans


def apply_bans(logits: Tensor, bans: list[list[int]]) -> Tensor:
    """logits: [P, V]; bans[j]: tokens masked at position j."""
    rows = [j for j, ban in enumerate(bans) for _ in ban]
    if not rows:
        return logits
    cols = [t for ban in bans for t in ban]
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = NEG_INF
    return logits


def min_tokens_bans(min_tokens: int, stop_ids: list[int], num_output_tokens: int, num_positions: int
                    ) -> list[list[int]]:
    """Position j emits output token number num_output_tokens + j: stop tokens are banned while that is below
    min_tokens."""
    return [list(stop_ids) if num_output_tokens + j < min_tokens else [] for j in range(num_positions)]


def apply_min_p(logits: Tensor, min_p: float, temperature: float) -> Tensor:
    """logits: [P, V] raw. Masks tokens whose probability after temperature is below min_p times the most likely
    token's: p_T(v) < min_p * max p_T  <=>  l_v < l_max + T log(min_p). Applied to the raw logits, so top-k and top-p
    then see the masked logits, as in vLLM (temperature, min_p, then top-k/top-p). Greedy rows are unaffected."""
    if min_p <= 0.0 or temperature <= 0.0:
        return logits
    threshold = logits.max(dim=-1, keepdim=True).values + temperature * math.log(min_p)
    return logits.masked_fill(logits < threshold, NEG_INF)
