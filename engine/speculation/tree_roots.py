"""The roots of a pre-drafted tree: for each verify outcome, the draft's likeliest candidates for the target's token.

After a window d_1..d_k, outcome a (a drafts accepted) leaves the target's token at position prefix_len + a: for
a < k a replacement of d_{a+1} (rejection sampling never emits the rejected token there at temperature 0, and its
residual is small elsewhere), for a = k the bonus token. Its candidates are the draft's top F_a tokens there, d_{a+1}
excluded for a < k. The draft's logits at position prefix_len + a are those the proposal drew d_{a+1} from (a < k)
and, for the bonus, those after feeding d_k (`TreeDraft.window_logits[k - 1]`, or a forward of d_k alone).
"""

from __future__ import annotations

import torch


def top_f_roots(logits: torch.Tensor, window: list[int], fanout: list[int]) -> list[list[int]]:
    """logits: [k + 1, V] float32, the draft's logits at positions prefix_len .. prefix_len + k; window: d_1..d_k;
    fanout: [k + 1] F_a per outcome. Returns [k + 1][F_a] candidate tokens, likeliest first."""
    k = len(window)
    if logits.shape[0] != k + 1 or len(fanout) != k + 1:
        raise ValueError(f"a window of {k} drafts has {k + 1} outcomes: got {logits.shape[0]} logits rows and "
                         f"{len(fanout)} fan-outs")
    masked = logits.clone()
    if k:
        rows = torch.arange(k, device=logits.device)
        masked[rows, torch.tensor(window, dtype=torch.int64, device=logits.device)] = float("-inf")
    top = masked.topk(max(fanout, default=0), dim=-1).indices.tolist()  # SYNC: the roots are host lists
    return [row[:f] for row, f in zip(top, fanout)]
