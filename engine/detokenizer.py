"""Incremental detokenization and stop conditions (EOS, stop token ids, stop strings, lengths)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

try:  # tokenizers >= 0.21
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - the pinned versions have it
    Tokenizer, DecodeStream = None, None

from engine.request import Request, RequestStatus


class IncrementalDetokenizer:
    """Decodes a growing list of token ids without re-decoding all of it each time.

    Keeps a window of a few tokens before the unread ones so multi-token characters (byte-level BPE)
    and word-joining spaces come out right; text is only emitted once it no longer ends in U+FFFD. Two whole
    `decode` calls a token cost about 12 us with SmolLM2's tokenizer (2 cores, 2026-12-06): the host's largest
    per-token cost in a step's commit at batch 32-64. `for_tokenizer` takes the tokenizers library's own streaming
    decoder instead where the tokenizer is backed by one (StreamingDetokenizer).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    @staticmethod
    def for_tokenizer(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
                      ) -> IncrementalDetokenizer | StreamingDetokenizer:
        """The streaming decoder where it gives decode()'s text (a tokenizers-backed tokenizer that does not clean
        up spaces after decoding), else this class."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if (DecodeStream is not None and isinstance(backend, Tokenizer)
                and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
            return StreamingDetokenizer(tokenizer, backend, prompt_ids)
        return IncrementalDetokenizer(tokenizer, prompt_ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""


class StreamingDetokenizer:
    """IncrementalDetokenizer's text through the tokenizers library's DecodeStream (Rust): about 1.7 us a token
    against 12 with SmolLM2's tokenizer. Primed with the prompt's last tokens, as the window above starts from
    them, so that the first output token's leading space comes out as within the text. A token the stream cannot
    take (an id its vocabulary lacks) is decoded the other way from then on, from the same ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, backend: Tokenizer, prompt_ids: list[int]) -> None:
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=True)
        self.slow: IncrementalDetokenizer | None = None
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-5:])
        try:
            for tok in self.ids:
                self.stream.step(backend, tok)
        except Exception:  # noqa: BLE001 - any id the stream refuses: decode the other way
            self.slow = IncrementalDetokenizer(tokenizer, self.ids)

    def add(self, token_id: int) -> str:
        if self.slow is None:
            try:
                self.ids.append(token_id)
                return self.stream.step(self.backend, token_id) or ""
            except Exception:  # noqa: BLE001 - as in __init__; this token decoded the other way
                self.slow = IncrementalDetokenizer(self.tokenizer, self.ids[:-1])
        return self.slow.add(token_id)


class OutputProcessor:
    """Appends sampled tokens to requests and decides when each stops, token by token, so a stop
    inside a run of accepted speculative tokens ends the request at the right token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: list[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer | StreamingDetokenizer] = {}

    def append(self, request: Request, new_tokens: list[int]) -> int:
        """Append tokens until one ends the request; returns how many were kept."""
        params = request.params
        for n, tok in enumerate(new_tokens, start=1):
            request.output_token_ids.append(tok)
            new_text = self._add_text(request, tok)
            if tok in params.stop_token_ids:
                self._finish(request, RequestStatus.FINISHED_STOPPED, tok)
            elif tok in self.eos_token_ids and not params.ignore_eos:
                self._finish(request, RequestStatus.FINISHED_STOPPED, None)
            elif (params.stop and new_text and request.num_output_tokens >= params.min_tokens
                  and self._hit_stop_string(request, len(new_text))):
                pass  # _hit_stop_string finished it
            elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                self._finish(request, RequestStatus.FINISHED_LENGTH, None)
            if request.status.finished:
                return n
        return len(new_tokens)

    def _add_text(self, request: Request, tok: int) -> str:
        if self.tokenizer is None or not request.params.detokenize:
            return ""
        det = self._detok.get(request.request_id)
        if det is None:
            det = self._detok[request.request_id] = IncrementalDetokenizer.for_tokenizer(self.tokenizer,
                                                                                        request.prompt_token_ids)
        new_text = det.add(tok)
        request.output_text += new_text
        return new_text

    def _hit_stop_string(self, request: Request, num_new_chars: int) -> bool:
        """Search only where a stop string could newly end: the new text plus the longest stop's overlap."""
        text = request.output_text
        longest = max(len(s) for s in request.params.stop)
        start = max(0, len(text) - num_new_chars - longest + 1)
        hits = [(idx, s) for s in request.params.stop if (idx := text.find(s, start)) != -1]
        if hits:
            idx, stop = min(hits)  # the earliest stop string in the text wins
            # The stop string itself is not returned (OpenAI), unless include_stop_str_in_output (vLLM).
            request.output_text = text[:idx + (len(stop) if request.params.include_stop_str_in_output else 0)]
            self._finish(request, RequestStatus.FINISHED_STOPPED, stop)
            return True
        return False

    def _finish(self, request: Request, status: RequestStatus, reason: str | int | None) -> None:
        request.status = status
        request.finish_reason = status.value
        request.stop_reason = reason

    def release(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
