"""A request's compiled-grammar key (engine/sample/structured_output.py makes it, engine/sample/grammar_matchers.py
builds matchers from it): a module of its own so that neither of the two imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarSpec:
    """A request's compiled-grammar key, as the plan carries it: every side that masks logits (the engine's own
    process, each target and draft worker) builds its matchers from it, through a cache keyed by all of it."""

    grammar: str  # llguidance grammar text (StructuredOutputsParams.to_grammar)
    tokenizer: str  # the tokenizer's directory (the target model's), loaded once per process
    eos_token_ids: tuple[int, ...]  # the tokens that end the output once the grammar is complete
    vocab_size: int  # the logits' width (may exceed the tokenizer's; the extra ids are never allowed)
