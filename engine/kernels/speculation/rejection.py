"""Rejection sampling of one verify step as one Triton kernel (one program per request).

Same arguments, result and token-for-token output as `rejection_sample_from_noise` in
engine/speculation/rejection_sampler.py, which is the reference (its module docstring defines the modes and terms).
A program walks its request's drafts in order and stops at the first rejection, so it reads the vocabulary
only at the positions it needs: in "strict" mode one exponential race per position up to the first mismatch,
in the other modes a gather per draft and one race at the output position. Races run over the vocabulary
in BLOCK_V lanes, each lane keeping its first maximum; ties then resolve to the lowest index, as
torch.argmax does. Divisions are IEEE round-to-nearest (div_rn), as torch's, so the scores and therefore
the tokens are bit-identical (inputs with NaN are out of scope).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.speculation.rejection_output import MODES, RejectionOutput, synthetic_position_rate
from engine.kernels.triton_compat import HAS_TRITON, require_triton, tl, triton

__all__ = ["HAS_TRITON", "rejection_sample_from_noise"]

_STRICT, _PROBABILISTIC, _SYNTHETIC = 0, 1, 2
# Vocabulary lanes per loop iteration; warps per program (one program per request) grow with it, 8 lanes a
# thread. Measured on an H100 (vocab 151936, probabilistic, batch 1): 4096 lanes / 8 warps 146 us, 4096 / 16
# 89 us, 8192 / 32 74 us; a single program per request is bound by its one SM's loads and IEEE divisions.
_BLOCK_V = 8192


@triton.jit
def _race_update(score, idx, best_val, best_idx):
    # Strictly greater: a lane keeps the first (lowest-index) occurrence of its maximum.
    better = score > best_val
    return tl.where(better, score, best_val), tl.where(better, idx, best_idx)


@triton.jit
def _race_winner(best_val, best_idx):
    top = tl.max(best_val, 0)
    return tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)


# max_k (and the row strides sized by it) follow the load-adaptive draft length step by step: they must not pick a
# compiled variant (see paged_attention).
@triton.jit(do_not_specialize=["max_k", "stride_dr", "stride_qr", "stride_pr", "stride_ur", "stride_er", "stride_or"])
def _rejection_kernel(
        draft_ptr, num_draft_ptr, q_ptr, p_ptr, u_ptr, e_ptr, rate_ptr,
        out_ptr, num_accepted_ptr, num_output_ptr,
        max_k, vocab,
        stride_dr, stride_dk,
        stride_qr, stride_qk, stride_qv,
        stride_pr, stride_pk, stride_pv,
        stride_ur, stride_uk,
        stride_er, stride_ek, stride_ev,
        stride_or, stride_ok,
        MODE: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    k_req = tl.load(num_draft_ptr + req).to(tl.int32)
    draft_row = draft_ptr + req * stride_dr
    p_req = p_ptr + req * stride_pr
    e_req = e_ptr + req * stride_er
    lanes = tl.arange(0, BLOCK_V)  # [BLOCK_V]

    n = 0  # accepted drafts
    last = 0  # the recovered / bonus token at position n
    if MODE == 0:  # strict: the target's own sample t_j at each position until a draft differs from it
        done = 0
        for j in range(0, max_k + 1):
            if done == 0:
                best_val = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
                best_idx = lanes
                for v0 in range(0, vocab, BLOCK_V):
                    idx = v0 + lanes
                    in_vocab = idx < vocab
                    score = tl.load(p_req + j * stride_pk + idx * stride_pv, mask=in_vocab,
                                    other=float("-inf")).to(tl.float32)
                    if HAS_NOISE:
                        noise = tl.load(e_req + j * stride_ek + idx * stride_ev, mask=in_vocab, other=1.0)
                        score = tl.math.div_rn(score, noise)
                    best_val, best_idx = _race_update(score, idx, best_val, best_idx)
                token = _race_winner(best_val, best_idx)
                draft = tl.load(draft_row + j * stride_dk, mask=j < max_k, other=-1)
                if (j < k_req) & (draft == token):
                    n += 1
                else:
                    last = token
                    done = 1
    else:
        # Acceptance tests in order; the first failure ends the walk.
        done = 0
        for j in range(0, max_k):
            if done == 0:
                if j < k_req:
                    u = tl.load(u_ptr + req * stride_ur + j * stride_uk)
                    if MODE == 1:
                        x = tl.maximum(tl.load(draft_row + j * stride_dk), 0)
                        p_x = tl.load(p_req + j * stride_pk + x * stride_pv).to(tl.float32)
                        q_x = tl.load(q_ptr + req * stride_qr + j * stride_qk + x * stride_qv).to(tl.float32)
                        # u < p/q without dividing, as the reference: defined for q(x) = 0 too.
                        accept = u * q_x < p_x
                    else:
                        accept = u < tl.load(rate_ptr + k_req)
                    if accept:
                        n += 1
                    else:
                        done = 1
                else:
                    done = 1

        # Position n samples the residual max(0, p - q) after a probabilistic rejection, else p. An all-zero
        # residual (p == q up to rounding) samples p too, as the reference does: a second pass that then runs.
        p_row = p_req + n * stride_pk
        e_row = e_req + n * stride_ek  # stride_ek is 0 when there is one noise row per request
        race_p = 1
        if MODE == 1:
            if n < k_req:
                q_row = q_ptr + req * stride_qr + n * stride_qk
                best_val = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
                best_idx = lanes
                residual_max = tl.zeros([BLOCK_V], dtype=tl.float32)
                for v0 in range(0, vocab, BLOCK_V):
                    idx = v0 + lanes
                    in_vocab = idx < vocab
                    p = tl.load(p_row + idx * stride_pv, mask=in_vocab, other=0.0).to(tl.float32)
                    q = tl.load(q_row + idx * stride_qv, mask=in_vocab, other=0.0).to(tl.float32)
                    residual = tl.maximum(p - q, 0.0)
                    residual_max = tl.maximum(residual_max, residual)
                    if HAS_NOISE:
                        noise = tl.load(e_row + idx * stride_ev, mask=in_vocab, other=1.0)
                        residual = tl.math.div_rn(residual, noise)
                    best_val, best_idx = _race_update(residual, idx, best_val, best_idx)
                last = _race_winner(best_val, best_idx)
                race_p = (tl.max(residual_max, 0) <= 0).to(tl.int32)
        if race_p != 0:
            best_val = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
            best_idx = lanes
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + lanes
                in_vocab = idx < vocab
                score = tl.load(p_row + idx * stride_pv, mask=in_vocab, other=float("-inf")).to(tl.float32)
                if HAS_NOISE:
                    noise = tl.load(e_row + idx * stride_ev, mask=in_vocab, other=1.0)
                    score = tl.math.div_rn(score, noise)
                best_val, best_idx = _race_update(score, idx, best_val, best_idx)
            last = _race_winner(best_val, best_idx)

    out_row = out_ptr + req * stride_or
    for j in range(0, max_k + 1):
        draft = tl.load(draft_row + j * stride_dk, mask=j < max_k, other=-1)
        token = tl.where(j < n, draft, tl.where(j == n, last.to(tl.int64), -1))
        tl.store(out_row + j * stride_ok, token)
    tl.store(num_accepted_ptr + req, n.to(tl.int64))
    tl.store(num_output_ptr + req, n.to(tl.int64) + 1)


def rejection_sample_from_noise(
        draft_token_ids: torch.Tensor,  # [num_reqs, max_k] int64, -1 beyond num_draft_tokens
        num_draft_tokens: torch.Tensor,  # [num_reqs] int64
        draft_probs: torch.Tensor | None,  # [num_reqs, max_k, V] float32 q (probabilistic mode only)
        target_probs: torch.Tensor,  # [num_reqs, max_k + 1, V] float32 processed p (any scores for argmax use)
        mode: str,
        synthetic_acceptance_rate: float | None,
        uniforms: torch.Tensor | None,  # [num_reqs, max_k] float32 in [0, 1); unused in strict mode
        exponentials: torch.Tensor | None,  # [num_reqs, max_k + 1 or 1, V] float32 Exp(1) > 0; None: argmax
) -> RejectionOutput:
    """Triton version of engine.speculation.rejection_sampler.rejection_sample_from_noise (same contract and tokens).

    No host sync; after the first call for a given synthetic rate and max_k it allocates only its outputs.
    """
    if mode not in MODES:
        raise ValueError(f"rejection sampling mode must be one of {MODES}, got {mode!r}")
    if mode == "synthetic" and not isinstance(synthetic_acceptance_rate, (int, float)):
        raise ValueError("synthetic mode needs synthetic_acceptance_rate, a number in [0, 1], got "
                         f"{synthetic_acceptance_rate!r}")
    num_reqs, max_k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if tuple(target_probs.shape) != (num_reqs, max_k + 1, vocab) or tuple(num_draft_tokens.shape) != (num_reqs,):
        raise ValueError(f"target_probs must be [{num_reqs}, {max_k + 1}, V] and num_draft_tokens [{num_reqs}], "
                         f"got {tuple(target_probs.shape)} and {tuple(num_draft_tokens.shape)}")
    needs_q = mode == "probabilistic" and max_k > 0
    if needs_q and (draft_probs is None or tuple(draft_probs.shape) != (num_reqs, max_k, vocab)):
        raise ValueError(f"probabilistic mode needs draft_probs of shape [{num_reqs}, {max_k}, {vocab}], got "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    needs_u = mode != "strict" and max_k > 0
    if needs_u and (uniforms is None or tuple(uniforms.shape) != (num_reqs, max_k)):
        raise ValueError(f"{mode} mode needs uniforms of shape [{num_reqs}, {max_k}], got "
                         f"{None if uniforms is None else tuple(uniforms.shape)}")
    if exponentials is not None and (exponentials.dim() != 3 or exponentials.shape[0] != num_reqs
                                     or exponentials.shape[1] not in (1, max_k + 1) or exponentials.shape[2] != vocab):
        raise ValueError(f"exponentials must be [{num_reqs}, {max_k + 1} or 1, {vocab}], got "
                         f"{tuple(exponentials.shape)}")
    tensors = [t for t in (draft_token_ids, num_draft_tokens, draft_probs, target_probs, uniforms, exponentials)
               if t is not None]
    require_triton("rejection_sample_from_noise", *tensors)

    device = target_probs.device
    out = torch.empty((num_reqs, max_k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    num_output = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return RejectionOutput(out, num_accepted, num_output)

    # Unused pointers get a tensor of the right dtype that is never read, so no empty or absent tensor
    # reaches the launcher.
    drafts = draft_token_ids if max_k > 0 else out
    q = draft_probs if needs_q else target_probs
    u = uniforms if needs_u else target_probs
    e = exponentials if exponentials is not None else target_probs
    rates = target_probs
    if mode == "synthetic" and max_k > 0:
        rates = _synthetic_rates(float(synthetic_acceptance_rate), max_k, uniforms.dtype, device)
    d_strides = drafts.stride()[:2] if max_k > 0 else (0, 0)
    q_strides = q.stride() if needs_q else (0, 0, 0)
    u_strides = u.stride()[:2] if needs_u else (0, 0)
    e_strides = (0, 0, 0)
    if exponentials is not None:
        e_strides = (e.stride(0), e.stride(1) if e.shape[1] > 1 else 0, e.stride(2))
    block_v = min(_BLOCK_V, triton.next_power_of_2(vocab))
    _rejection_kernel[(num_reqs,)](
        drafts, num_draft_tokens, q, target_probs, u, e, rates, out, num_accepted, num_output,
        max_k, vocab, *d_strides, *q_strides, *target_probs.stride(), *u_strides, *e_strides, *out.stride(),
        MODE={"strict": _STRICT, "probabilistic": _PROBABILISTIC, "synthetic": _SYNTHETIC}[mode],
        HAS_NOISE=exponentials is not None, BLOCK_V=block_v, num_warps=max(4, block_v // 256))
    return RejectionOutput(out, num_accepted, num_output)


@functools.lru_cache(maxsize=64)
def _synthetic_rates(rate: float, max_k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_k + 1] per-position acceptance probability by draft length, rounded to the uniforms' dtype as the
    reference rounds it. Cached: the host-to-device copy happens once, outside any CUDA-graph capture."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"synthetic_acceptance_rate must be in [0, 1], got {rate}")
    return torch.tensor([synthetic_position_rate(rate, k) for k in range(max_k + 1)], dtype=dtype, device=device)


def warm_up(vocab: int, device: torch.device) -> int:
    """Compile every variant a verify can select (each mode, with and without noise) before the first request:
    compiled lazily, the first speculation step of a fresh process stalled 0.2-0.75 s (one H100). The shapes
    do not matter (sizes and k are not specialized on, `vocab` fixes BLOCK_V). Returns the variants run."""
    if not HAS_TRITON or device.type != "cuda":
        return 0
    runs = 0
    drafts = torch.zeros(1, 1, dtype=torch.int64, device=device)  # [1, 1] int64
    counts = torch.ones(1, dtype=torch.int64, device=device)  # [1] int64
    p = torch.full((1, 2, vocab), 1.0 / vocab, dtype=torch.float32, device=device)  # [1, 2, V] float32
    q = p[:, :1].contiguous()  # [1, 1, V] float32
    u = torch.zeros(1, 1, dtype=torch.float32, device=device)  # [1, 1] float32
    for mode in MODES:
        for noise in (None, torch.ones(1, 2 if mode == "strict" else 1, vocab, dtype=torch.float32, device=device)):
            rejection_sample_from_noise(drafts, counts, q if mode == "probabilistic" else None, p, mode,
                                        0.5 if mode == "synthetic" else None, u, noise)
            runs += 1
    torch.cuda.synchronize(device)  # SYNC: start-up only
    return runs
