"""Rejection sampling of one verify step: accepted draft prefix + one recovered or bonus token per request.

Terms, per request i with k_i = num_draft_tokens[i] draft tokens x_0 .. x_{k_i - 1}:
- q_j: the draft model's processed distribution that x_j was sampled from (draft_probs[i, j]).
- p_j: the target's processed distribution at position j (logits_to_probs of target_logits[i, j]), with the
  same temperature / top-k / top-p as q_j. p_{k_i} scores the position after the last draft.
- accepted: the longest prefix x_0 .. x_{n-1} that passes the mode's test; n = num_accepted[i].
- recovered token: the token output at position n < k_i, where x_n was rejected.
- bonus token: the token output at position k_i when all k_i drafts were accepted (drawn from p_{k_i}).
Every request outputs n + 1 tokens: the accepted drafts, then one recovered or bonus token.

Modes:
- "probabilistic" (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
  Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): accept x_j iff
  u_j < min(1, p_j(x_j) / q_j(x_j)), u_j ~ U[0, 1); at the first rejection output a sample of
  norm(max(0, p_j - q_j)) (p_j itself if that is all zero). Every output token then follows p exactly, at
  any temperature, top-k, top-p.
- "strict": sample the target's own token t_j ~ p_j at every position (the argmax at temperature 0); accept
  x_j while x_j == t_j; output t_n. Lossless, as the output is literally the target's samples.
- "synthetic" (benchmarks only, NOT lossless): accept each draft with a fixed probability a_k
  (u_j < a_k, stop at the first failure) and output the target's own sample t_n. The configured rate is the
  mean acceptance rate users see (accepted / drafted, as vLLM's synthetic mode), so a_k is solved per draft
  length k from E[accepted] / k = rate, where E[accepted] = a + a^2 + ... + a^k.
Greedy rows output exactly the target's argmax tokens in the strict and probabilistic modes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels.speculation.rejection_output import (  # noqa: F401 - public here
    MODES,
    RejectionOutput,
    synthetic_position_rate,
)
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.sampler import exponential_race, random_exponential, random_uniform


def rejection_sample(draft_token_ids: Tensor,  # [num_reqs, max_k] int64, -1 beyond num_draft_tokens
                     num_draft_tokens: Tensor,  # [num_reqs] int64, 0 .. max_k (0: plain decode)
                     draft_probs: Tensor | None,  # [num_reqs, max_k, V] float32 processed q
                     target_logits: Tensor,  # [num_reqs, max_k + 1, V] raw; row j scores position j
                     md: SamplingMetadata,  # one row per request
                     mode: str,  # "strict" | "probabilistic" | "synthetic"
                     synthetic_acceptance_rate: float | None = None) -> RejectionOutput:
    """Verify one speculation step for a batch of requests (see the module docstring for the terms).

    draft_probs may be None in "strict" and "synthetic" modes, and in "probabilistic" mode when max_k == 0.
    Random numbers: per request, max_k uniforms, then Exp(1) noise of [max_k + 1, V] ("strict": one target
    sample per position) or [1, V] (other modes: only the single recovered/bonus token is sampled, at a
    position chosen by the uniforms alone, so one noise row per request is enough). Seeded rows draw both
    from their own generator, so their result depends only on their own inputs and generator (for a given
    max_k and V).
    """
    if md.all_greedy and mode == "probabilistic":
        # With one-hot p, probabilistic acceptance is "x equals the argmax" whatever q is, and the residual
        # max(0, p - q) peaks at that argmax too: strict mode gives the same tokens without reading q.
        mode = "strict"
    _validate(draft_token_ids, num_draft_tokens, draft_probs, target_logits, md, mode,
              synthetic_acceptance_rate)
    num_reqs, max_k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device

    # Noise first, uniforms second: a seeded row then consumes its generator as a prefix that does not
    # depend on the batch's max_k (strict noise is row-major over positions, and uniforms beyond the
    # row's own k are never read), so its result is the same in any batch.
    exponentials = None
    if not md.all_greedy:
        noise_positions = max_k + 1 if mode == "strict" else 1
        exponentials = random_exponential(md, (noise_positions, vocab), device)
    uniforms = None
    if mode != "strict" and max_k > 0:
        uniforms = random_uniform(md, (max_k,), device)
    if md.all_greedy and mode != "probabilistic":
        # One-hot p only feeds an argmax here: skip softmax and top-k/top-p.
        target_probs = target_logits
    else:
        target_probs = logits_to_probs(target_logits, md)
    core = rejection_sample_from_noise
    if target_probs.is_cuda:
        from engine.kernels.speculation import rejection as rejection_kernel

        if rejection_kernel.HAS_TRITON:
            # One Triton program per request instead of ~30 small torch kernels: same tokens, bit for bit
            # (tests/gpu/test_kernels_cuda.py).
            core = rejection_kernel.rejection_sample_from_noise
    return core(draft_token_ids, num_draft_tokens, draft_probs, target_probs, mode, synthetic_acceptance_rate,
                uniforms, exponentials)


def rejection_sample_from_noise(
        draft_token_ids: Tensor,  # [num_reqs, max_k] int64, -1 beyond num_draft_tokens
        num_draft_tokens: Tensor,  # [num_reqs] int64
        draft_probs: Tensor | None,  # [num_reqs, max_k, V] float32 q (probabilistic mode only)
        target_probs: Tensor,  # [num_reqs, max_k + 1, V] float32 processed p (any scores for argmax use)
        mode: str,
        synthetic_acceptance_rate: float | None,
        uniforms: Tensor | None,  # [num_reqs, max_k] float32 in [0, 1); unused in strict mode
        exponentials: Tensor | None,  # [num_reqs, max_k + 1 or 1, V] float32 Exp(1) > 0; None: argmax
) -> RejectionOutput:
    """The deterministic core of `rejection_sample`, given pre-drawn random numbers (tests inject them).

    In "strict" mode `exponentials` must have max_k + 1 positions (independent target samples); None
    means every row is greedy and the target's tokens are argmaxes.
    """
    num_reqs, max_k = draft_token_ids.shape
    device = draft_token_ids.device
    rows = torch.arange(num_reqs, device=device)
    positions = torch.arange(max_k + 1, device=device)
    is_draft = positions[:max_k] < num_draft_tokens[:, None]  # [num_reqs, max_k] bool
    drafts = draft_token_ids.clamp(min=0)  # -1 padding would break gather; padded slots are masked anyway

    if mode == "strict":
        target_tokens = exponential_race(target_probs, exponentials)  # [num_reqs, max_k + 1]
        accepted = (draft_token_ids == target_tokens[:, :max_k]) & is_draft
        num_accepted = _prefix_length(accepted)
        # Accepted drafts equal the target's tokens, so the whole output is the target's tokens.
        out = torch.where(positions <= num_accepted[:, None], target_tokens, -1)
        return RejectionOutput(out, num_accepted, num_accepted + 1)

    if max_k == 0:
        accepted = is_draft
    elif mode == "probabilistic":
        p_x = target_probs[:, :max_k].gather(-1, drafts[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
        # u < p/q without dividing: also defined for q(x) = 0 (accept iff p(x) > 0); u < 1 makes p == q
        # accept always.
        accepted = (uniforms * q_x < p_x) & is_draft
    else:
        per_k = torch.tensor([synthetic_position_rate(synthetic_acceptance_rate, k) for k in range(max_k + 1)],
                             dtype=uniforms.dtype, device=device)
        accepted = (uniforms < per_k[num_draft_tokens][:, None]) & is_draft
    num_accepted = _prefix_length(accepted)

    # Only position n = num_accepted emits a sampled token, so build its distribution for that position
    # alone instead of residuals for all max_k positions.
    p_n = target_probs[rows, num_accepted]  # [num_reqs, V]
    if mode == "probabilistic" and max_k > 0:
        q_n = draft_probs[rows, num_accepted.clamp(max=max_k - 1)]
        residual = (p_n - q_n).clamp_(min=0)
        # Bonus position (all drafts accepted) samples p; an all-zero residual (p == q up to rounding) too.
        use_p = (num_accepted == num_draft_tokens)[:, None] | (residual.sum(-1, keepdim=True) <= 0)
        dist = torch.where(use_p, p_n, residual)
    else:
        dist = p_n  # synthetic: the target's own sample t_n, as in strict mode
    noise = None
    if exponentials is not None:
        noise = exponentials[rows, num_accepted] if exponentials.shape[1] > 1 else exponentials[:, 0]
    last_token = exponential_race(dist, noise)  # [num_reqs]

    draft_ext = torch.cat([draft_token_ids, draft_token_ids.new_full((num_reqs, 1), -1)], dim=1)
    n = num_accepted[:, None]
    out = torch.where(positions < n, draft_ext, torch.where(positions == n, last_token[:, None], -1))
    return RejectionOutput(out, num_accepted, num_accepted + 1)


def _prefix_length(accepted: Tensor) -> Tensor:
    """[num_reqs, max_k] bool -> [num_reqs] int64 length of the all-True prefix (stop at first False)."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _validate(draft_token_ids: Tensor, num_draft_tokens: Tensor, draft_probs: Tensor | None,
              target_logits: Tensor, md: SamplingMetadata, mode: str, rate: float | None) -> None:
    if mode not in MODES:
        raise ValueError(f"rejection sampling mode must be one of {MODES}, got {mode!r}")
    if mode == "synthetic":
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError("synthetic rejection sampling needs synthetic_acceptance_rate, a number in "
                             f"[0, 1], got {rate!r}")
    elif rate is not None:
        raise ValueError(f"synthetic_acceptance_rate is only used with mode 'synthetic' (mode is {mode!r}); "
                         "leave it None")
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [num_reqs, max_k], got {tuple(draft_token_ids.shape)}")
    num_reqs, max_k = draft_token_ids.shape
    if tuple(num_draft_tokens.shape) != (num_reqs,):
        raise ValueError(f"num_draft_tokens must be [{num_reqs}], got {tuple(num_draft_tokens.shape)}")
    if target_logits.dim() != 3 or target_logits.shape[:2] != (num_reqs, max_k + 1):
        raise ValueError(f"target_logits must be [{num_reqs}, {max_k + 1}, V], "
                         f"got {tuple(target_logits.shape)}")
    if md.num_reqs != num_reqs:
        raise ValueError(f"SamplingMetadata has {md.num_reqs} rows, expected one per request ({num_reqs})")
    if mode == "probabilistic" and max_k > 0:
        if draft_probs is None:
            raise ValueError("probabilistic rejection sampling needs draft_probs (the draft's q)")
        if tuple(draft_probs.shape) != (num_reqs, max_k, target_logits.shape[-1]):
            raise ValueError(f"draft_probs must be [{num_reqs}, {max_k}, {target_logits.shape[-1]}], "
                             f"got {tuple(draft_probs.shape)}")
