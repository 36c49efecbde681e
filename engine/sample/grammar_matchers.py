"""Grammar matchers and token bitmasks, on whichever side masks logits (the engine's process, each worker rank).

A matcher's state is a function of its grammar and the tokens it consumed, nothing else. So every side keeps its
own matchers, keyed by request and grammar, and brings one up to a plan's committed output history before it masks
(consuming only what is new since its last use; any mismatch rebuilds it from the compiled grammar). Nothing about
matcher state travels between processes, which keeps a side exact whatever ran before it: a draft worker and a
target worker each mask from the same plan, and a request that moved or resumed masks the same.

Within a step, position j of a request follows its drafts[:j]: the matcher consumes them one by one, the mask of
each position is taken from the state before the next draft, and the drafts are rolled back afterwards. A draft
the grammar does not allow ends the walk: the target gives it probability 0, so rejection sampling rejects it
surely and the positions after it are never output; their masks allow everything (any non-empty mask would do).
End-of-sequence tokens are never consumed: once the grammar is complete and an EOS comes, the output ends, and the
positions after it allow only EOS.

Compiled grammars are cached per process (keyed by grammar text, tokenizer, EOS ids and vocabulary width): a
request's matcher is a copy of its grammar's compiled template.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.sample.grammar_spec import GrammarSpec

_MAX_TEMPLATES = 512  # compiled grammars kept per process
_MAX_MATCHERS = 4096  # matchers kept per process (requests that never said they ended are evicted oldest first)
_lock = threading.Lock()
_hf_tokenizers: dict[str, Any] = {}  # tokenizer directory -> an HF tokenizer this process already loaded
_ll_tokenizers: dict[tuple[str, tuple[int, ...], int], Any] = {}
_templates: OrderedDict[GrammarSpec, Any] = OrderedDict()


def register_tokenizer(tokenizer: Any) -> str:
    """Make an HF tokenizer this process already holds the one for its directory (no second load); returns the
    directory, which a GrammarSpec names."""
    path = str(tokenizer.name_or_path)
    _hf_tokenizers.setdefault(path, tokenizer)
    return path


def _ll_tokenizer(spec: GrammarSpec) -> Any:
    key = (spec.tokenizer, spec.eos_token_ids, spec.vocab_size)
    tok = _ll_tokenizers.get(key)
    if tok is None:
        import llguidance.hf
        from transformers import AutoTokenizer

        hf = _hf_tokenizers.get(spec.tokenizer)
        if hf is None:
            hf = _hf_tokenizers[spec.tokenizer] = AutoTokenizer.from_pretrained(spec.tokenizer)
        # About 0.3 s for a 50k vocabulary: once per process and tokenizer.
        tok = _ll_tokenizers[key] = llguidance.hf.from_tokenizer(hf, n_vocab=spec.vocab_size,
                                                                 eos_token=list(spec.eos_token_ids))
    return tok


def compile_grammar(spec: GrammarSpec) -> Any:
    """The compiled grammar's template matcher (cached); ValueError for a grammar the backend cannot compile."""
    with _lock:
        template = _templates.get(spec)
        if template is not None:
            _templates.move_to_end(spec)
            return template
    import llguidance

    tok = _ll_tokenizer(spec)
    error = llguidance.LLMatcher.validate_grammar(spec.grammar, tok)
    if error:
        raise ValueError(f"the grammar does not compile: {error.strip()}")
    template = llguidance.LLMatcher(tok, spec.grammar, log_level=0)
    if template.is_error():
        raise ValueError(f"the grammar does not compile: {template.get_error().strip()}")
    with _lock:
        _templates[spec] = template
        while len(_templates) > _MAX_TEMPLATES:
            _templates.popitem(last=False)
    return template


@dataclass
class _Tracked:
    """One request's matcher and the committed output it has consumed."""

    matcher: Any
    consumed: list[int]
    ended: bool = False  # an EOS came after the grammar was complete: only EOS from here on
    broken: bool = False  # a committed token the grammar refused (never under exact masking): no mask any more


_matchers: OrderedDict[tuple[str, GrammarSpec], _Tracked] = OrderedDict()


def forget(request_ids: Iterable[str]) -> None:
    """Drop the matchers of requests that ended (a plan's finished ids)."""
    ids = set(request_ids)
    if not ids or not _matchers:
        return
    with _lock:
        for key in [key for key in _matchers if key[0] in ids]:
            del _matchers[key]


def _acquire(request_id: str, spec: GrammarSpec, output: list[int]) -> _Tracked:
    """The request's matcher at the state after `output`. Taken out of the pool while in use, so a draft and a
    target sharing this process never walk one matcher at once (the second would build its own)."""
    with _lock:
        tracked = _matchers.pop((request_id, spec), None)
    if tracked is None or tracked.consumed != output[:len(tracked.consumed)]:
        tracked = _Tracked(compile_grammar(spec).deep_copy(), [])
    eos = spec.eos_token_ids
    for token in output[len(tracked.consumed):]:
        tracked.consumed.append(token)
        if tracked.ended or tracked.broken:
            continue
        if token in eos and tracked.matcher.is_accepting():
            tracked.ended = True
        elif not tracked.matcher.consume_token(token):
            tracked.broken = True
    return tracked


def _release(request_id: str, spec: GrammarSpec, tracked: _Tracked) -> None:
    with _lock:
        _matchers[(request_id, spec)] = tracked
        while len(_matchers) > _MAX_MATCHERS:
            _matchers.popitem(last=False)


def grammar_bitmask(spec: GrammarSpec, request_id: str, output: list[int], drafts: list[int], start: int,
                    num_pos: int, out: Tensor) -> None:
    """Fill out[:num_pos] ([>= num_pos, ceil(V / 32)] int32 on the host; bit t of a row: token t allowed) with
    the masks of positions start .. start + num_pos - 1, position p following output + drafts[:p]."""
    import llguidance.torch as llt

    tracked = _acquire(request_id, spec, output)
    m, eos = tracked.matcher, spec.eos_token_ids
    consumed = 0
    dead = tracked.broken  # no mask: a refused token precedes the position
    ended = tracked.ended  # only EOS: the output ended before the position

    def advance(token: int) -> None:
        nonlocal consumed, dead, ended
        if dead or ended:
            return
        if token in eos and m.is_accepting():
            ended = True
        elif m.try_consume_tokens([token]) == 1:  # unlike consume_token, a refusal leaves the matcher usable
            consumed += 1
        else:
            dead = True

    try:
        for token in drafts[:start]:
            advance(token)
        for j in range(num_pos):
            if j:
                advance(drafts[start + j - 1])
            if dead:
                out[j] = -1
            elif ended:
                _only(out[j], eos)
            else:
                llt.fill_next_token_bitmask(m, out, j)
                if not bool(out[j].any()):  # never seen; a row must allow something for softmax to be defined
                    _only(out[j], eos)
    finally:
        if consumed:
            m.rollback(consumed)
        _release(request_id, spec, tracked)


def _only(row: Tensor, tokens: Iterable[int]) -> None:
    """row: [ceil(V / 32)] int32; allow exactly `tokens`."""
    row.zero_()
    for t in tokens:
        word, bit = divmod(t, 32)
        if word < row.shape[0]:
            value = 1 << bit
            row[word] |= value - (1 << 32) if value >= 1 << 31 else value  # bit 31 is int32's sign


def new_bitmask(rows: int, vocab_size: int, device: torch.device) -> Tensor:
    """[rows, ceil(V / 32)] int32 on the host, all allowed; pinned when the logits are on CUDA (async copy)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=device.type == "cuda")


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits: [N, V] on their device; bitmask: [N, ceil(V / 32)] int32 on the host. Disallowed tokens become -inf;
    the mask is copied once and unpacked on the logits' device."""
    n, vocab = logits.shape
    bits = bitmask.to(logits.device, non_blocking=True)  # [N, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(n, -1)[:, :vocab].bool()  # [N, V] bool
    return logits.masked_fill(~allowed, float("-inf"))
