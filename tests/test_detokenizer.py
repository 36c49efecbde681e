"""Incremental detokenization (engine/detokenizer.py): the tokenizers library's streaming decoder gives the text of
the two-decode window piece for piece, with real tokenizers of both decoder kinds (SmolLM2's byte-level BPE, Gemma
3's SentencePiece with byte fallback, and a Metaspace decoder that drops a first word's space), on text and on random
ids; it is taken only where it can match; and an id it
refuses falls back to the window without losing text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, StreamingDetokenizer
from engine.llm import load_tokenizer

TEXTS = ["Hello, world! café naïve — 日本語のテキスト 🚀🚀 done.\n\n  indented\tTab and a  double space",
         "Special tokens mid-text: <|im_start|>user<|im_end|> <bos><eos> then more, and ... punctuation ?!"]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer whose decoder drops the space before the first word it decodes (Llama 2's
    and Mistral's kind): what priming the stream with the prompt's last tokens is for."""
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "!": 3, "\u2581a": 4, "b": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "metaspace"])
def tokenizer(request):
    if request.param == "smollm2":
        return load_tokenizer(request.getfixturevalue("smollm2_path"))
    if request.param == "gemma3":
        return load_tokenizer(request.getfixturevalue("gemma3_path"))
    tok = metaspace_tokenizer()
    assert tok.decode([1, 2]) == "hello world" and tok.decode([2]) == "world"
    return tok


def _cases(tok) -> list[list[int]]:  # noqa: ANN001 - a transformers tokenizer
    rng = random.Random(0)
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS] + [
        [rng.randrange(len(tok)) for _ in range(300)], [rng.choice(tok.all_special_ids) for _ in range(8)]]


def _pieces(det, ids: list[int]) -> list[str]:  # noqa: ANN001
    return [det.add(t) for t in ids]


def test_streaming_detokenizer_gives_the_windows_text_piece_for_piece(tokenizer):
    """Every case from the same prompt suffix: the same piece at every token (a character split across tokens comes
    out at the same token, not before), whatever the ids."""
    for ids in _cases(tokenizer):
        prompt, out = ids[:7], ids[7:]
        fast = IncrementalDetokenizer.for_tokenizer(tokenizer, prompt)
        assert isinstance(fast, StreamingDetokenizer)
        assert _pieces(fast, out) == _pieces(IncrementalDetokenizer(tokenizer, prompt), out)


def test_streaming_is_taken_only_where_it_matches_decode(smollm2_path, monkeypatch):
    """A tokenizer that cleans up spaces after decoding (which the stream does not) keeps the window."""
    tok = load_tokenizer(smollm2_path)
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    assert type(IncrementalDetokenizer.for_tokenizer(tok, [1, 2])) is IncrementalDetokenizer


def test_an_id_the_stream_refuses_falls_back_without_losing_text(smollm2_path, monkeypatch):
    """The stream raising at one token (as for an id outside its vocabulary): that token and the rest are decoded
    through the window, and the whole text equals the window's."""
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    prompt, out = ids[:5], ids[5:]
    fast = IncrementalDetokenizer.for_tokenizer(tok, prompt)
    refused = out[10]
    step = fast.stream.step

    class Refusing:
        def step(self, backend, token_id):  # noqa: ANN001, ANN201
            if token_id == refused:
                raise ValueError("an id the stream cannot take")
            return step(backend, token_id)

    fast.stream = Refusing()
    text = "".join(_pieces(fast, out))
    assert fast.slow is not None
    assert text == "".join(_pieces(IncrementalDetokenizer(tok, prompt), out))
