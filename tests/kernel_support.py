"""Inputs for the Triton kernel tests (tests/test_kernels.py on CPU, tests/gpu/test_kernels_cuda.py on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import exponential_race


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens + padding, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    max_query_len: int
    scale: float
    sliding_window: int | None

    def args(self, out: torch.Tensor, kv_cache: torch.Tensor | None = None) -> tuple:
        kv = self.kv_cache if kv_cache is None else kv_cache
        return (self.query, kv[0], kv[1], out, self.query_start_loc, self.seq_lens, self.block_table, self.scale,
                self.sliding_window, self.max_query_len)

    @property
    def num_valid_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def attention_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, query_lens: list[int],
                   context_lens: list[int], sliding_window: int | None, dtype: torch.dtype, device: str = "cpu",
                   seed: int = 0, padding_tokens: int = 3, extra_blocks: int = 2) -> AttentionCase:
    """Requests with the given query lengths after cached prefixes of the given lengths (q_len 0: a padding
    request, which the kernel must skip). Blocks are shuffled over the cache and unused blocks hold large
    values, so a read of a wrong block shows; block-table entries past a request's length are null."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + extra_blocks
    num_blocks = 1 + sum(blocks_per_req) + 4
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 50
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = order[used:used + n]
        used += n
    kv[:, order[:used]] /= 50  # blocks in use: N(0, 1); the others stay large
    kv[:, 0] = 0  # null block
    kv = kv.to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1] + padding_tokens, num_heads, head_dim, generator=g).to(dtype)
    return AttentionCase(query.to(device), kv.to(device), torch.tensor(qsl, dtype=torch.int32, device=device),
                         torch.tensor(seq_lens, dtype=torch.int32, device=device), table.to(device),
                         max(query_lens), head_dim ** -0.5, sliding_window)


def poison_outside_window(case: AttentionCase) -> torch.Tensor:
    """A copy of the cache whose keys/values before every request's earliest window start are NaN and whose
    block-table entries entirely before it are released (null), as a sliding-window group frees them. A
    kernel that reads any of them returns NaN."""
    kv = case.kv_cache.clone()
    block_size = kv.shape[2]
    starts = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        first_visible = seq_len - q_len - case.sliding_window + 1  # of the request's first query token
        if q_len == 0 or first_visible <= 0:
            continue
        pos = torch.arange(first_visible, device=kv.device)
        kv[:, case.block_table[i, pos // block_size].long(), pos % block_size] = float("nan")
        case.block_table[i, :first_visible // block_size] = 0
    kv[:, 0] = 0
    return kv


@dataclass
class RejectionCase:
    draft_token_ids: torch.Tensor  # [num_reqs, max_k] int64
    num_draft_tokens: torch.Tensor  # [num_reqs] int64
    draft_probs: torch.Tensor | None  # [num_reqs, max_k, V] float32
    target_probs: torch.Tensor  # [num_reqs, max_k + 1, V]
    mode: str
    rate: float | None
    uniforms: torch.Tensor | None  # [num_reqs, max_k]
    exponentials: torch.Tensor | None  # [num_reqs, max_k + 1 or 1, V]

    def args(self) -> tuple:
        return (self.draft_token_ids, self.num_draft_tokens, self.draft_probs, self.target_probs, self.mode,
                self.rate, self.uniforms, self.exponentials)


def rejection_case(mode: str, num_reqs: int, max_k: int, vocab: int, noise: bool, seed: int = 0,
                   device: str = "cpu", ties: bool = False, raw_logits: bool = False) -> RejectionCase:
    """Random peaked p and q; about half the drafts are the target's own tokens (so prefixes get accepted),
    the rest random. ties: p quantised to a few levels, so argmax ties are common. raw_logits: greedy
    scores with negative values (what the sampler passes for all-greedy strict/synthetic batches)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (num_reqs,), generator=g)
    p = torch.rand(num_reqs, max_k + 1, vocab, generator=g) ** 8
    p[torch.rand(p.shape, generator=g) < 0.3] = 0  # outside top-k / top-p
    if ties:
        p = (torch.rand(p.shape, generator=g) * 2).floor() + 1  # half the tokens share the maximum
    p = p / p.sum(-1, keepdim=True)
    if raw_logits:
        p = torch.randn(num_reqs, max_k + 1, vocab, generator=g) * 3 - 10
    q = torch.rand(num_reqs, max_k, vocab, generator=g) ** 8
    q = q / q.sum(-1, keepdim=True)
    # Every other request's draft puts half its mass on the target's top token: its residual max(0, p - q)
    # then peaks elsewhere, so sampling p instead of the residual after a rejection shows.
    top = torch.nn.functional.one_hot(p[:, :max_k].argmax(-1), vocab).float()
    q[::2] = 0.5 * q[::2] + 0.5 * top[::2]
    if max_k > 1:
        q[0, 1] = p[0, 1]  # p == q at a position: an all-zero residual there samples p
    exps = None
    if noise:
        positions = max_k + 1 if mode == "strict" else 1
        exps = torch.empty(num_reqs, positions, vocab).exponential_(generator=g)
        exps.clamp_(min=torch.finfo(torch.float32).tiny)
    own = exponential_race(p[:, :max_k], exps[:, :max_k] if (exps is not None and mode == "strict") else None)
    drafts = torch.where(torch.rand(num_reqs, max_k, generator=g) < 0.6, own,
                         torch.randint(0, vocab, (num_reqs, max_k), generator=g))
    if mode == "probabilistic" and max_k > 0:
        # Some drafts the draft model could not have sampled (q(x) = 0): accepted iff p(x) > 0.
        q[:, 0].scatter_(-1, drafts[:, :1], 0.0)
    drafts = torch.where(torch.arange(max_k) < k[:, None], drafts, -1)
    uniforms = torch.rand(num_reqs, max_k, generator=g) if mode != "strict" else None
    t = {"device": device}
    return RejectionCase(drafts.to(**t), k.to(**t), q.to(**t) if mode == "probabilistic" else None, p.to(**t), mode,
                         0.7 if mode == "synthetic" else None, None if uniforms is None else uniforms.to(**t),
                         None if exps is None else exps.to(**t))


@dataclass
class DecodeCase:
    """Inputs of engine.kernels.decode_attention: a step of at most one query token per request."""

    qkv: torch.Tensor  # [num_tokens + padding, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor  # [num_tokens + padding] int64
    cos: torch.Tensor  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor  # [max_positions, head_dim / 2] float32
    slot_mapping: torch.Tensor  # [num_tokens + padding] int64; -1 for padding tokens
    attention: AttentionCase  # the cache, query layout, block table and window (its query is unused)
    q_norm_weight: torch.Tensor | None  # [head_dim]
    k_norm_weight: torch.Tensor | None  # [head_dim]
    norm_offset: float

    def args(self, out: torch.Tensor, kv_cache: torch.Tensor, counters: torch.Tensor) -> tuple:
        a = self.attention
        return (self.qkv, self.num_heads, self.num_kv_heads, self.positions, self.cos, self.sin, kv_cache[0],
                kv_cache[1], self.slot_mapping, out, a.query_start_loc, a.seq_lens, a.block_table, a.scale,
                a.sliding_window, counters, self.q_norm_weight, self.k_norm_weight, 1e-6, self.norm_offset)


def decode_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, query_lens: list[int],
                context_lens: list[int], sliding_window: int | None, dtype: torch.dtype, norm: str | None,
                device: str = "cpu", seed: int = 0) -> DecodeCase:
    """A decode step (query lengths 0 or 1) over attention_case's cache: the projection's output, rotary tables,
    the new tokens' slots (from the block table) and, with norm "llama" or "gemma", per-head q/k norm weights."""
    a = attention_case(num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, sliding_window,
                       dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = a.query.shape[0]  # valid tokens, then padding tokens
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim // 2).float() / (head_dim // 2)))
    angles = torch.arange(max(context_lens) + 64).float()[:, None] * inv[None, :]  # room for later steps
    positions = torch.zeros(n, dtype=torch.int64)
    slots = torch.full((n,), -1, dtype=torch.int64)
    tok = 0
    for i, q_len in enumerate(query_lens):
        if q_len:
            pos = context_lens[i]
            positions[tok] = pos
            slots[tok] = int(a.block_table[i, pos // block_size]) * block_size + pos % block_size
            tok += q_len
    weights = (None, None)
    if norm is not None:
        base = 0.0 if norm == "gemma" else 1.0
        weights = tuple((torch.randn(head_dim, generator=g) * 0.3 + base).to(dtype=dtype, device=device)
                        for _ in range(2))
    return DecodeCase(qkv.to(dtype=dtype, device=device), num_heads, num_kv_heads, positions.to(device),
                      angles.cos().to(device), angles.sin().to(device), slots.to(device), a, weights[0], weights[1],
                      1.0 if norm == "gemma" else 0.0)


def check_decode_attention(case: DecodeCase, atol: float, rtol: float, splits: int | None = None,
                           tickets: bool | None = None) -> None:
    """The fused decode kernel against its reference: the output of every valid token, the whole cache (the new
    keys and values stored, nothing else touched), padding tokens left alone and the counters left at zero."""
    from engine.kernels import decode_attention

    a = case.attention
    sentinel = 7.0
    out = torch.full((case.qkv.shape[0], case.num_heads, a.query.shape[-1]), sentinel, dtype=case.qkv.dtype,
                     device=case.qkv.device)
    ref = out.clone()
    counters = torch.zeros(len(a.seq_lens) * case.num_kv_heads + 3, dtype=torch.int32, device=out.device)
    kv_ref = a.kv_cache.clone()
    decode_attention.decode_attention_ref(*case.args(ref, kv_ref, counters))
    # The kernel runs on a cache whose keys before each window are NaN (and their blocks released): it must not
    # read them. The reference ran before the poisoning, on the whole cache.
    kv = poison_outside_window(a) if a.sliding_window is not None else a.kv_cache.clone()
    kept = ~kv.isnan()
    for _ in range(2):  # twice: the counters must be back at zero for the second launch
        decode_attention.decode_attention(*case.args(out, kv, counters), num_kv_splits=splits, tickets=tickets)
        assert int(counters.abs().sum()) == 0, "split counters were not reset"
        n = a.num_valid_tokens
        torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
        assert bool((out[n:] == sentinel).all()), "padding tokens were written"
        torch.testing.assert_close(kv[kept].float(), kv_ref[kept].float(), atol=atol, rtol=rtol)
