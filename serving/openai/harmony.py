"""GPT-OSS's harmony format, read from the output's token ids: reasoning, content and tool calls apart, whole or
streamed.

A harmony output is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>` (the prompt's
generation prompt already wrote the first `<|start|>assistant`). The header names the channel and, for a tool call,
its recipient: `<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
{"city": "Paris"}<|call|>`. The markers are special tokens, which the output text leaves out, so the split reads
the token ids and decodes the text between the markers itself (the openai-harmony package would fetch its
vocabulary over the network; this needs only the checkpoint's tokenizer).

Where each message's body goes: `analysis` (and calls of built-in tools, recipients outside `functions.`) to
`reasoning_content`; `final`, `commentary` without a recipient (a preamble the user sees) to `content`; a
recipient `functions.NAME` that names one of the request's tools to a tool call, its body the arguments. A call of
a function the request did not give (or any call when the request parses none) is content: nothing is dropped.
Several messages of one kind are joined by a blank line.

A malformed header never fails the request: a header with an unknown channel or none is content; a header that
never reaches `<|message|>` is dropped when it held a marker (`<|channel|>`, `<|constrain|>`) and is content when
it is plain text (a model writing without the format), streamed as content once it is longer than any header;
a `<|channel|>` inside a body ends that message and opens a new header; stray `<|message|>` / `<|constrain|>`
tokens in a body, and other special tokens, are skipped. `<|return|>` and `<|call|>` end the output (the server
adds them to a request's stop tokens); an output cut by max_tokens inside a call drops that call, as the other
parsers do.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                         "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."
MAX_HEADER_TOKENS = 64  # a header of plain text longer than this is a model writing without the format: content
SEPARATOR = "\n\n"  # between two messages of the same kind
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(frozen=True)
class HarmonyTokens:
    """A tokenizer's harmony token ids."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int
    special: frozenset[int]  # every special token of the tokenizer (skipped where they are not markers)

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end a harmony output: the answer's end and a tool call's."""
        return [self.return_, self.call]

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens | None:
        """The harmony tokens of a tokenizer that has all of them as added tokens (GPT-OSS's o200k_harmony); None
        for any other tokenizer."""
        try:
            added = tokenizer.get_added_vocab()
        except (AttributeError, NotImplementedError):
            return None
        if not all(t in added for t in HARMONY_TOKENS):
            return None
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
        # Every added special token (GPT-OSS's reserved ones too), not only those the special-tokens map names.
        special |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                    if getattr(t, "special", False)}
        ids = [int(added[t]) for t in HARMONY_TOKENS]
        return cls(*ids, special=frozenset(special | set(ids)))


class _Decoder:
    """One body's text from its token ids, incrementally: text is released once it does not end inside a
    character (byte-level tokens split UTF-8 characters), with a short window before the unread ids so that the
    pieces join as the whole decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._read(final=False)

    def flush(self) -> str:
        return self._read(final=True)

    def _read(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        if final:
            self.read_offset = len(self.ids)
        return ""


@dataclass
class HarmonyDelta:
    """What one feed releases: reasoning and content text, and finished tool calls (OpenAI's objects with an
    index)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Header:
    role: str
    channel: str
    recipient: str | None
    content_type: str


class HarmonyStream:
    """One choice's output token ids into reasoning, content and tool calls, as they come.

    tool_names: the request's functions whose calls become tool calls (None: the request parses no calls)."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Any, tool_names: set[str] | None) -> None:
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.tool_names = tool_names
        self.state = "header"  # header | body | between (after a message's end)
        self.header_ids: list[int] = []
        self.header_marked = False  # the header holds <|channel|> or <|constrain|>
        self.kind = "content"  # the body's: reasoning | content | call
        self.call_name = ""
        self.decoder = _Decoder(tokenizer)
        self.call_text = ""
        self.emitted = {"reasoning": False, "content": False}  # a separator is due before the next message's text
        self.body_started = False
        self.num_calls = 0
        self.saw_reasoning = False
        self.finished = False

    # --- feeding ----------------------------------------------------------------------------------------------
    def feed(self, token_ids: list[int], final: bool = False, truncated: bool = False) -> HarmonyDelta:
        """New output ids in; what they release out. final: the output ended (truncated: by max_tokens)."""
        out = HarmonyDelta()
        t = self.tokens
        for tok in token_ids:
            if self.finished:
                break
            if tok in (t.return_, t.call, t.end):
                self._close(out, closed=True)
                self.state = "between"
            elif tok == t.start:
                self._close(out, closed=True)
                self._new_header()
            elif tok == t.channel:
                if self.state == "body":  # a new header without the old message's end: the body ended
                    self._close(out, closed=True)
                if self.state != "header":
                    self._new_header()
                self.header_ids.append(tok)
                self.header_marked = True
            elif tok == t.constrain:
                if self.state == "header":
                    self.header_ids.append(tok)
                    self.header_marked = True
            elif tok == t.message:
                if self.state == "header":
                    self._open(self._parse_header())
            elif tok in t.special:
                continue  # a special token outside the format (<|endoftext|>, ...): no text
            elif self.state == "body":
                self._text(out, self.decoder.add(tok))
            else:
                if self.state == "between":  # text without <|start|>: a header all the same
                    self._new_header()
                self.header_ids.append(tok)
                if len(self.header_ids) > MAX_HEADER_TOKENS and not self.header_marked:
                    ids, self.header_ids = self.header_ids, []
                    self._open(_Header("", "", None, ""))
                    for i in ids:
                        self._text(out, self.decoder.add(i))
        if final:
            self._close(out, closed=not truncated)
            self.finished = True
        return out

    # --- messages ---------------------------------------------------------------------------------------------
    def _new_header(self) -> None:
        self.state, self.header_ids, self.header_marked = "header", [], False

    def _parse_header(self) -> _Header:
        parts: dict[str, list[int]] = {"role": [], "channel": [], "constrain": []}
        where = "role"
        for i in self.header_ids:
            if i == self.tokens.channel:
                where = "channel"
            elif i == self.tokens.constrain:
                where = "constrain"
            else:
                parts[where].append(i)
        text = {k: self.tokenizer.decode(v) if v else "" for k, v in parts.items()}
        recipient = None
        for key in ("role", "channel"):
            if m := _RECIPIENT.search(text[key]):
                recipient = m.group(1)
                text[key] = text[key][:m.start()] + text[key][m.end():]
        words = text["channel"].split()
        return _Header(text["role"].strip(), words[0] if words else "", recipient,
                       text["constrain"].strip() or (words[1] if len(words) > 1 else ""))

    def _open(self, header: _Header) -> None:
        self.header_ids, self.header_marked = [], False
        self.state = "body"
        self.decoder = _Decoder(self.tokenizer)
        self.body_started = False
        self.call_text = ""
        if header.recipient is not None and header.recipient.startswith(FUNCTIONS):
            self.kind, self.call_name = "call", header.recipient[len(FUNCTIONS):]
        elif header.recipient is not None or header.channel == "analysis":
            self.kind = "reasoning"  # thinking, and calls of the model's built-in tools (python, browser)
        else:
            self.kind = "content"  # final, a commentary preamble, and any header the split does not know
        if self.kind == "reasoning":
            self.saw_reasoning = True

    def _text(self, out: HarmonyDelta, text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            self.call_text += text
            return
        if not self.body_started:
            self.body_started = True
            if self.emitted[self.kind]:
                text = SEPARATOR + text
            self.emitted[self.kind] = True
        if self.kind == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: HarmonyDelta, closed: bool) -> None:
        """The current message ended: closed by a marker or the output's own end (False: cut by max_tokens)."""
        if self.state == "header":
            if self.header_ids and not self.header_marked:  # plain text without the format: content
                ids = self.header_ids
                self._open(_Header("", "", None, ""))
                for i in ids:
                    self._text(out, self.decoder.add(i))
            else:  # a header that never reached <|message|>: markup, not text
                self.header_ids, self.header_marked = [], False
                return
        if self.state != "body":
            return
        self._text(out, self.decoder.flush())
        self.state = "between"
        if self.kind != "call":
            return
        text, self.call_text = self.call_text, ""
        if not closed:
            return  # a call cut by max_tokens: unfinished, dropped
        if self.tool_names is None or self.call_name not in self.tool_names:
            self.kind = "content"
            self._text(out, text)
            return
        out.calls.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": self.call_name, "arguments": text.strip() or "{}"}})
        self.num_calls += 1


@dataclass
class HarmonyResult:
    reasoning: str | None  # None: the output had no reasoning message
    content: str
    calls: list[dict[str, Any]]


def parse_harmony(token_ids: list[int], tokens: HarmonyTokens, tokenizer: Any, tool_names: set[str] | None,
                  truncated: bool = False) -> HarmonyResult:
    """A finished output's split (the same as streaming it, fed in any chunks)."""
    stream = HarmonyStream(tokens, tokenizer, tool_names)
    delta = stream.feed(list(token_ids), final=True, truncated=truncated)
    return HarmonyResult(delta.reasoning if stream.saw_reasoning else None, delta.content, delta.calls)
