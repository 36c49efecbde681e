"""The roots of a pre-drafted tree: for each verify outcome, the draft's likeliest candidates for the target's token.

After a window d_1..d_k, outcome a (a drafts accepted) leaves the target's token at position prefix_len + a: for
a < k a replacement of d_{a+1} (rejection sampling never emits the rejected token there at temperature 0, and its
residual is small elsewhere), for a = k the bonus token. Its candidates are the draft's top F_a tokens there, d_{a+1}
excluded for a < k, and none whose logit is -inf there (masked by the request's logits processing). The draft's
logits at position prefix_len + a are those the proposal drew d_{a+1} from (a < k)
and, for the bonus, those after feeding d_k (`TreeDraft.window_logits[k - 1]`, or a forward of d_k alone).
"""

from __future__ import annotations

import torch

from engine.host_copy import to_device


def top_f_roots(logits: torch.Tensor, window: list[int], fanout: list[int]) -> list[list[int]]:
    """logits: [k + 1, V] float32, the draft's logits at positions prefix_len .. prefix_len + k; window: d_1..d_k;
    fanout: [k + 1] F_a per outcome. Returns [k + 1][F_a] candidate tokens, likeliest first."""
    return top_f_roots_many([logits], [window], [fanout])[0]


def top_f_roots_many(logits: list[torch.Tensor], windows: list[list[int]],
                     fanouts: list[list[int]]) -> list[list[list[int]]]:
    """`top_f_roots` of several trees: one top-k and one copy to the host for all of them."""
    if not logits:
        return []
    values, indices = _top_candidates(logits, windows, fanouts)
    # A token whose logit is -inf (the rejected draft, or one the request's logits processing masks there: a
    # grammar's refusal, a ban) is never a root: the target never emits it there, so its branch could never hit.
    top = indices.masked_fill(values == float("-inf"), -1).tolist()  # SYNC: the roots are host lists
    out: list[list[list[int]]] = []
    offset = 0
    for fanout in fanouts:
        out.append([[t for t in row[:f] if t >= 0] for row, f in zip(top[offset:offset + len(fanout)], fanout)])
        offset += len(fanout)
    return out


def top_f_roots_on_device(logits: list[torch.Tensor], windows: list[list[int]],
                          fanouts: list[list[int]]) -> torch.Tensor:
    """The roots of `top_f_roots_many` without a copy to the host: [sum of every F_a] int64 on the logits' device,
    tree by tree, outcome by outcome, likeliest first. Every tree has exactly its F_a candidates a outcome: a
    candidate whose logit is -inf stays in (its branch can never hit, which costs rows, not exactness); so this is
    for logits no processing masks, where -inf marks only the excluded draft."""
    _, indices = _top_candidates(logits, windows, fanouts)
    width = indices.shape[1]
    flat: list[int] = []
    offset = 0
    for fanout in fanouts:
        for a, f in enumerate(fanout):
            flat += range((offset + a) * width, (offset + a) * width + f)
        offset += len(fanout)
    return indices.reshape(-1).index_select(0, to_device(flat, torch.int64, indices.device))


def _top_candidates(logits: list[torch.Tensor], windows: list[list[int]],
                    fanouts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [sum of k + 1, max F_a]: each outcome's top tokens, d_{a+1} masked to -inf for a < k."""
    rows: list[int] = []
    cols: list[int] = []
    offset = 0
    for x, window, fanout in zip(logits, windows, fanouts, strict=True):
        k = len(window)
        if x.shape[0] != k + 1 or len(fanout) != k + 1:
            raise ValueError(f"a window of {k} drafts has {k + 1} outcomes: got {x.shape[0]} logits rows and "
                             f"{len(fanout)} fan-outs")
        rows += range(offset, offset + k)
        cols += window
        offset += k + 1
    masked = torch.cat(logits)  # a copy: the caller's logits stay as they are
    if rows:
        dev = masked.device
        masked[to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev)] = float("-inf")
    width = max((f for fanout in fanouts for f in fanout), default=0)
    return masked.topk(width, dim=-1)
