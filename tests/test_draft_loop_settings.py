"""The draft loop's per-row settings (each row's draft count and column-0 guess mode) are staged and uploaded in one
copy, and only when a proposal's differ from the last one's: whatever the sequence of proposals, the device rows
must hold the current proposal's settings, with padding rows at no drafts and no guess."""

from __future__ import annotations

import torch
from fast_path_support import draft_runner

from engine.speculation.draft_loop import DraftLoop


def test_row_settings_follow_every_proposal(tiny_drafts):
    loop = DraftLoop(draft_runner(tiny_drafts["llama-1l"], "cpu", 6, 4, graphs=False), 6, keep_probs=False)
    sequence = [
        (2, [4, 3], [0, 0]),
        (2, [4, 3], [0, 0]),  # unchanged: nothing uploaded (checked below), the rows still right
        (2, [4, 2], [0, 1]),
        (3, [4, 2], [0, 1]),  # a padding row joins: no drafts, no guess
        (1, [5], [2]),
        (4, [1, 6, 2], [2, 0, 1]),
        (2, [6, 6], [0, 0]),
    ]
    for b, ks, guesses in sequence:
        loop._set_row_settings(b, ks, guesses)
        pad = b - len(ks)
        assert loop.num_draft[:b].tolist() == ks + [0] * pad, (b, ks, guesses)
        assert loop.guess[:b].tolist() == guesses + [0] * pad, (b, ks, guesses)
    # The same proposal again uploads nothing: a row changed on the device behind the loop's back stays changed...
    loop.num_draft[0] = 9
    loop._set_row_settings(2, [6, 6], [0, 0])
    assert loop.num_draft[0].item() == 9
    # ...and the next different proposal writes every row again.
    loop._set_row_settings(2, [6, 5], [0, 0])
    assert loop.num_draft[:2].tolist() == [6, 5] and loop.guess[:2].tolist() == [0, 0]
    assert loop.num_draft.dtype == loop.guess.dtype == torch.int64
