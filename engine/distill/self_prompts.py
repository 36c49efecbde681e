"""Prompts written by the target itself, for more distillation data than a hand-written prompt set holds.

An instruct model given its chat template only up to where a user's words begin writes a user turn, in the style
and on the topics it was tuned on (Magpie: Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing"). Its answers to those turns are then what the draft must learn to predict. No data
set has to be downloaded, and the prompts follow the target, whatever it was tuned on.

A prompt is kept as token ids, exactly as the target wrote it between the template's frame (prefix + user text +
end of turn + assistant header): no decode/re-encode round trip can change it. A target without a chat template
(a base model) gets the bare frame: its unconditional text, started from BOS, is the prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from engine.llm import LLM
from engine.request import SamplingParams

logger = logging.getLogger("specserve")

# Stands in for the user's text while the template renders: splitting the rendered string here gives what the
# template puts before and after a user turn. Control characters cannot occur in any template's own text.
_SENTINEL = "\x07\x07user-text\x07\x07"


@dataclass(frozen=True)
class ChatFrame:
    """What surrounds a user turn's text in the target's chat template, as token ids."""

    prefix: list[int]  # up to the first token of the user's text (system turn, user header)
    suffix: list[int]  # after it: end of the user turn, then the assistant's header (generation prompt)
    end_of_turn: list[int]  # token ids that end the user's text when the model writes it

    def wrap(self, user_ids: Sequence[int]) -> list[int]:
        return [*self.prefix, *user_ids, *self.suffix]


def chat_frame(tokenizer: PreTrainedTokenizerBase | None, bos_token_id: int | None,
               eos_token_ids: Sequence[int]) -> ChatFrame:
    """The frame of a user turn in `tokenizer`'s chat template; without one, BOS alone (a base model's text)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        if bos_token_id is None:
            raise ValueError("self-written prompts need a chat template or a BOS token to start the text from")
        return ChatFrame([bos_token_id], [], list(eos_token_ids))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                             tokenize=False)
    if not isinstance(rendered, str) or rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not render a user message's text exactly once; "
                         "self-written prompts need a template that does")
    before, after = rendered.split(_SENTINEL)
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    suffix = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not suffix:
        raise ValueError("the chat template puts nothing after a user message: there is no token that ends a "
                         "user turn for self-written prompts to stop at")
    # The model ends its user turn with the suffix's first token (ChatML's <|im_end|>, Gemma's <end_of_turn>);
    # EOS ends it too where a model prefers that.
    return ChatFrame(list(prefix), list(suffix), sorted({suffix[0], *eos_token_ids}))


def synthesize_prompts(llm: LLM, frame: ChatFrame, num_prompts: int, max_tokens: int = 96, min_tokens: int = 4,
                       temperature: float = 1.0, top_p: float = 0.95, exclude: Collection[Sequence[int]] = (),
                       chunk: int = 2048, progress: bool = True) -> list[list[int]]:
    """Up to `num_prompts` distinct user turns written by the target, each wrapped in `frame`.

    Kept: turns the model ended itself (a turn cut at `max_tokens` is unfinished) with at least `min_tokens`
    tokens, not already written, and none equal to a prompt of `exclude` (the evaluation split must stay unseen).
    Sampling is not seeded per request: the engine's seed makes a run repeatable, and per-request generators cost
    a kernel per row per step.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    excluded = {tuple(p) for p in exclude}
    seen: set[tuple[int, ...]] = set()
    kept: list[list[int]] = []
    dropped = {"unfinished": 0, "short": 0, "duplicate": 0, "excluded": 0}
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=frame.end_of_turn, detokenize=False)
    bar = tqdm(total=num_prompts, desc="self-written prompts", unit="prompt", disable=not progress)
    for start in range(0, num_prompts, chunk):
        n = min(chunk, num_prompts - start)
        for out in llm.generate([frame.prefix] * n, params):
            user = [t for t in out.token_ids if t not in frame.end_of_turn]
            prompt = tuple(frame.wrap(user))
            if out.finish_reason != "stop":
                dropped["unfinished"] += 1
            elif len(user) < min_tokens:
                dropped["short"] += 1
            elif prompt in seen:
                dropped["duplicate"] += 1
            elif prompt in excluded:
                dropped["excluded"] += 1
            else:
                seen.add(prompt)
                kept.append(list(prompt))
        bar.update(n)
    bar.close()
    logger.info("self-written prompts: kept %d of %d (dropped %s)", len(kept), num_prompts, dropped)
    return kept
