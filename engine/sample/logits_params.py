"""A request's logits processing settings (penalties, biases, masks), as the plan carries them to the workers.

Only requests that use one of them get a LogitsParams in their PlannedRequest; the others cost nothing on the step
path. The per-step history the penalties and bad words need (output tokens so far) travels beside it in
PlannedRequest.output_token_ids.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine.sample.structured_output import GrammarSpec


@dataclass
class LogitsParams:
    presence_penalty: float = 0.0  # minus this for every token already in the output (OpenAI)
    frequency_penalty: float = 0.0  # minus this times the token's count in the output (OpenAI)
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / r if > 0, * r if <= 0 (HF, vLLM)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the token's logit
    allowed_token_ids: list[int] | None = None  # None: all; else every other token is masked
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # a word's last token is masked after its prefix
    min_tokens: int = 0  # stop tokens are masked until the output has this many tokens
    min_tokens_stop_ids: list[int] = field(default_factory=list)  # those stop tokens (EOS unless ignore_eos, stop ids)
    min_p: float = 0.0  # tokens with probability below min_p times the top token's (after temperature) are masked
    prompt_token_ids: list[int] = field(default_factory=list)  # for the repetition penalty only
    # Structured outputs: tokens the grammar does not allow after the history are masked (grammar_matchers.py).
    grammar: GrammarSpec | None = None

    @property
    def needs_output_history(self) -> bool:
        """Whether the step needs the request's output so far (penalties, multi-token bad words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or any(len(w) > 1 for w in self.bad_words_token_ids) or self.grammar is not None)


def logits_params_of(request: Any, eos_token_ids: Collection[int], grammar: GrammarSpec | None = None
                     ) -> LogitsParams | None:
    """The LogitsParams of an engine Request (engine.request.Request), or None when it processes no logits.
    grammar: its structured outputs' compiled grammar (structured_output.grammar_spec_of), if any."""
    p = request.params
    if not p.processes_logits and grammar is None:
        return None
    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else [t for t in eos_token_ids
                                                                    if t not in p.stop_token_ids])
    return LogitsParams(presence_penalty=float(p.presence_penalty), frequency_penalty=float(p.frequency_penalty),
                        repetition_penalty=float(p.repetition_penalty), logit_bias=dict(p.logit_bias or {}),
                        allowed_token_ids=list(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
                        bad_words_token_ids=[list(w) for w in p.bad_words_token_ids or []], min_tokens=p.min_tokens,
                        min_tokens_stop_ids=stop_ids, min_p=float(p.min_p),
                        prompt_token_ids=list(request.prompt_token_ids) if p.repetition_penalty != 1.0 else [],
                        grammar=grammar)
