"""The target's logits processing for the requests that ask for any (penalties, logit_bias, masks, min_p).

Applied in torch to the raw target logits of a step, before the sampler or the rejection sampler, and only to the
rows whose PlannedRequest carries LogitsParams: a step without such requests does not call this at all.

Under speculation position j of a request scores the token after its j-th draft, so its history is the output so
far plus drafts[:j]. Each position is processed with that history, which makes p_j exactly the processed
distribution a plain decode would sample from at that point; rejection sampling against it then outputs tokens
that follow the processed target distribution exactly, whatever the draft proposed from.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sample.grammar_matchers import apply_bitmask, grammar_bitmask, new_bitmask
from engine.sample.logits_params import LogitsParams
from engine.sample.penalties import apply_penalties
from engine.sample.token_masks import (
    apply_allowed_token_ids,
    apply_bans,
    apply_logit_bias,
    apply_min_p,
    bad_word_bans,
    min_tokens_bans,
)
from engine.step.plan import PlannedRequest


def needs_processing(reqs: list[PlannedRequest]) -> bool:
    return any(r.logits_params is not None for r in reqs)


def needs_draft_history(reqs: list[PlannedRequest]) -> bool:
    """Whether some request's processing reads the drafts (penalties, multi-token bad words)."""
    return any(r.logits_params is not None and r.logits_params.needs_output_history for r in reqs)


def process_target_logits(logits: Tensor,  # [R, P, V] raw target logits; row i position j follows drafts[i][:j]
                          reqs: list[PlannedRequest],  # [R]
                          drafts: list[list[int]] | None,  # [R][k_i] each row's drafts (None: no drafts read)
                          start: int = 0,  # position p of the P axis follows start + p drafts (the draft: its step)
                          ) -> Tensor:
    """New [R, P, V] float32 logits: rows with LogitsParams processed at their positions start .. k_i (at most P),
    others as given."""
    out = logits.float().clone()
    if any(r.logits_params is not None and r.logits_params.grammar is not None for r in reqs):
        out = _apply_grammars(out, reqs, drafts, start)
    for i, r in enumerate(reqs):
        lp = r.logits_params
        if lp is None:
            continue
        k = len(drafts[i]) if drafts is not None else 0
        num_pos = min(1 + k - start, logits.shape[1])
        output = list(r.output_token_ids or [])
        row_drafts = drafts[i] if drafts is not None else []
        histories = [output + row_drafts[:start + j] for j in range(num_pos)] if lp.needs_output_history else None
        out[i, :num_pos] = _process_row(out[i, :num_pos], lp, r, histories, start)
    return out


def _apply_grammars(logits: Tensor,  # [R, P, V] float32
                    reqs: list[PlannedRequest], drafts: list[list[int]] | None, start: int) -> Tensor:
    """Structured outputs: each grammar row's masks at its positions, built on the host from its matcher (one
    bitmask for the batch, [R, P, ceil(V / 32)] int32), copied once and applied on the logits' device. First of
    all processing, as vLLM applies the grammar's bitmask before its sampler's processors."""
    num_reqs, num_pos, vocab = logits.shape
    bitmask = new_bitmask(num_reqs * num_pos, vocab, logits.device).view(num_reqs, num_pos, -1)
    for i, r in enumerate(reqs):
        lp = r.logits_params
        if lp is None or lp.grammar is None:
            continue
        row_drafts = drafts[i] if drafts is not None else []
        n = min(1 + len(row_drafts) - start, num_pos)
        grammar_bitmask(lp.grammar, r.request_id, list(r.output_token_ids or []), row_drafts, start, n, bitmask[i])
    return apply_bitmask(logits.view(num_reqs * num_pos, vocab), bitmask.view(num_reqs * num_pos, -1)
                         ).view(num_reqs, num_pos, vocab)


def _process_row(logits: Tensor, lp: LogitsParams, r: PlannedRequest, histories: list[list[int]] | None,
                 start: int) -> Tensor:
    """logits: [P, V] of one request; histories: [P] output history per position (None when not needed)."""
    num_pos, vocab = logits.shape
    logits = apply_allowed_token_ids(logits, lp.allowed_token_ids)
    if lp.bad_words_token_ids:
        hist = histories if histories is not None else [[] for _ in range(num_pos)]
        logits = apply_bans(logits, bad_word_bans(lp.bad_words_token_ids, hist))
    if lp.min_tokens:
        logits = apply_bans(logits, min_tokens_bans(lp.min_tokens, lp.min_tokens_stop_ids,
                                                    r.num_output_tokens + start, num_pos))
    logits = apply_logit_bias(logits, lp.logit_bias)
    if lp.presence_penalty or lp.frequency_penalty or lp.repetition_penalty != 1.0:
        assert histories is not None
        counts = torch.zeros(num_pos, vocab, dtype=torch.float32, device=logits.device)
        for j, history in enumerate(histories):
            if history:
                ids = torch.tensor(history, dtype=torch.int64, device=logits.device)
                counts[j].index_add_(0, ids, torch.ones(len(history), device=logits.device))
        prompt_mask = torch.zeros(1, vocab, dtype=torch.bool, device=logits.device)
        if lp.repetition_penalty != 1.0 and lp.prompt_token_ids:
            prompt_mask[0, torch.tensor(lp.prompt_token_ids, dtype=torch.int64, device=logits.device)] = True

        def one(x: float) -> Tensor:
            return torch.tensor([x], dtype=torch.float32, device=logits.device)

        logits = apply_penalties(logits[None], counts[None], prompt_mask, one(lp.presence_penalty),
                                 one(lp.frequency_penalty), one(lp.repetition_penalty))[0]
    return apply_min_p(logits, lp.min_p, r.temperature)
