"""The limits a request must fit in to be served: a prompt that is not empty and leaves room to generate, token ids
inside the vocabulary, and a prompt whose KV fits each model's whole cache. Each is refused with a ValueError that
says what to change, before the request is queued."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheManager
    from engine.request import Request


def check_request_limits(request: Request, max_model_len: int, vocab_size: int) -> None:
    """Raise ValueError for a prompt that is empty or leaves no room to generate, or for token ids (the prompt's,
    or those its sampling parameters name) outside the vocabulary."""
    n, limit, vocab = request.num_prompt_tokens, max_model_len, vocab_size
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    if n >= limit:
        raise ValueError(f"prompt has {n} tokens but max_model_len is {limit}, which leaves no room to "
                         f"generate; shorten the prompt to at most {limit - 1} tokens")
    bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    for name, ids in request.params.token_ids_used().items():
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} names token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def check_prompt_fits(num_prompt_tokens: int, kv_managers: list[tuple[str, KVCacheManager]]) -> None:
    """Raise ValueError for a prompt whose KV alone outgrows a model's whole cache (kv_managers: (model, its KV
    manager)): it could never run, and saying so up front beats failing it once it reaches the head of the queue."""
    for model, kv in kv_managers:
        need = -(-num_prompt_tokens // kv.block_size)
        have = min(pool.num_usable for pool in kv.pools)
        if need > have:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, which need {need} KV blocks of "
                             f"{kv.block_size} tokens, but the {model} model's KV cache holds {have} blocks "
                             f"({have * kv.block_size} tokens); shorten the prompt")
