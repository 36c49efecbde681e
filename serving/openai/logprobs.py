"""Logprobs in the API's responses: the emitted tokens' (completions' legacy lists or chat's content), and a prompt's:
vLLM's `prompt_logprobs` field, and completions' `echo` with `logprobs`, OpenAI's legacy way of scoring a prompt (what
evaluation harnesses send to score a continuation).

A delta (serving.router.client) carries, with logprobs asked for, one `[logprob, [[token_id, logprob], ...]]` per
new token (the emitted token's log-probability and the most likely tokens at its position). With prompt logprobs
asked for, the request's first delta carries `prompt_logprobs`: one (logprob, rank, top tokens) per prompt token from
the second on (engine.sample.logprobs.PromptTokenLogprobs); nothing predicts the first token, which gets None.
"""

from __future__ import annotations

from typing import Any


def token_text(tokenizer: Any, token_id: int, as_ids: bool = False) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


class LogprobsBuilder:
    """Accumulates one choice's logprobs in the endpoint's shape (completions' legacy lists or chat's content)."""

    def __init__(self, tokenizer: Any, chat: bool, num_top: int, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.num_top = num_top
        self.as_ids = as_ids  # return_tokens_as_token_ids: "token_id:N" instead of the token's text
        self.offset = 0

    def render(self, token_ids: list[int], logprobs: list[Any]) -> dict[str, Any]:
        """The logprobs object for these tokens (one delta's, or a whole choice's)."""
        if self.chat:
            content = []
            for tok, (lp, top) in zip(token_ids, logprobs):
                s = token_text(self.tokenizer, tok, self.as_ids)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [self._chat_top(t, v) for t, v in top[:self.num_top]]})
            return {"content": content}
        out: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tok, (lp, top) in zip(token_ids, logprobs):
            s = token_text(self.tokenizer, tok, self.as_ids)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            # The emitted token is always listed, then the most likely ones (vLLM: up to logprobs + 1 entries).
            top_dict = {s: lp}
            for t, v in top[:self.num_top]:
                top_dict.setdefault(token_text(self.tokenizer, t, self.as_ids), v)
            out["top_logprobs"].append(top_dict)
        return out

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = token_text(self.tokenizer, token_id, self.as_ids)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}


def logprobs_builder(body: Any, tokenizer: Any, chat: bool) -> LogprobsBuilder | None:
    as_ids = body.return_tokens_as_token_ids
    if chat:
        return LogprobsBuilder(tokenizer, True, body.top_logprobs or 0, as_ids) if body.logprobs else None
    return LogprobsBuilder(tokenizer, False, body.logprobs, as_ids) if body.logprobs is not None else None


def vllm_prompt_logprobs(tokenizer: Any, prompt_ids: list[int], entries: list[Any], num_top: int,
                         as_ids: bool = False) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: None for the first prompt token, then per token {token id: {logprob, rank, decoded_token}} for
    the token itself and the `num_top` most likely tokens at its position (ids as strings, as JSON keys are)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tok, (lp, rank, top) in zip(prompt_ids[1:], entries):
        entry = {str(tok): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, tok, as_ids)}}
        for r, (t, v) in enumerate(top[:num_top], start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": token_text(tokenizer, t, as_ids)})
        out.append(entry)
    return out


def echo_logprobs(builder: LogprobsBuilder, prompt_ids: list[int], entries: list[Any]) -> dict[str, list[Any]]:
    """Completions' legacy logprobs of an echoed prompt: its first token with none (null logprob and top), then
    each token's as the output's are listed. Render it before the output: the output's text offsets follow it."""
    first = token_text(builder.tokenizer, prompt_ids[0], builder.as_ids)  # a prompt is never empty (a 400)
    out: dict[str, list[Any]] = {"text_offset": [builder.offset], "token_logprobs": [None], "tokens": [first],
                                 "top_logprobs": [None]}
    builder.offset += len(first)
    rest = builder.render(prompt_ids[1:], [(lp, top) for lp, _rank, top in entries])
    return joined(out, rest)


def joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two legacy logprobs objects as one (the echoed prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}
