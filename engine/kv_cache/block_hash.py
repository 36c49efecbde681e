"""Content addresses of full KV blocks: a hash chain over a request's tokens.

Block i's hash covers its parent's hash (so it stands for the whole prefix, not just its own tokens), its
block_size token ids, and extra keys: anything else that decides who may reuse the KV those tokens produce. Today
that is the request's `cache_salt` (in the first block: the chain carries it to every later one), so requests
share cached blocks only with requests of the same salt; a feature that makes KV depend on more than the tokens
(a LoRA adapter, an image) must add its key in `extra_keys` too.

SHA-256 rather than Python's `hash`: a collision would silently reuse another prefix's KV, so the address must
be collision-resistant, and it costs microseconds per block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


def extra_keys(request: Request, block_index: int) -> bytes:
    """What besides the tokens keys this block: the cache salt, in block 0 (see the module docstring)."""
    salt = request.params.cache_salt
    if block_index or salt is None:
        return b""
    return b"salt:" + salt.encode()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to every full block of its tokens (prompt and output); returns it.

    Tokens never change once committed, so hashes are computed once per block."""
    hashes = request.block_hashes
    n_full = request.num_tokens // block_size
    prompt, output = request.prompt_token_ids, request.output_token_ids
    n = len(prompt)
    for i in range(len(hashes), n_full):
        # The block's tokens sliced from prompt and output, not from their join: a decode step fills a block every
        # block_size steps, and joining a long context's tokens for it would copy them all.
        start, end = i * block_size, (i + 1) * block_size
        tokens = prompt[start:end] if end <= n else prompt[start:end] + output[max(0, start - n):end - n]
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, tokens, extra_keys(request, i)))
    return hashes
