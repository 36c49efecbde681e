"""Token sampling from processed probabilities, with per-request generators for seeded requests.

Random rows use the exponential race: argmax_v p(v) / E_v with E_v ~ Exp(1) i.i.d. picks v with
probability p(v) (the minimum of independent exponentials with rates p(v) is at v with probability
p(v) / sum p). It needs no normalisation, no cumulative sum, and no host sync, and a row of one-hot
probabilities always yields its argmax, so greedy rows need no separate path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs

# An Exp(1) draw of exactly 0 (CPU computes -log(1 - u) and u can be 0) would turn p / E into inf, or NaN
# for a masked token with p = 0, and argmax treats NaN as the maximum; the clamp keeps masked tokens out.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


def random_uniform(md: SamplingMetadata, shape_per_row: Sequence[int],
                   device: torch.device | str) -> Tensor:
    """[num_rows, *shape_per_row] float32 uniforms in [0, 1).

    Rows in md.generators draw from their own generator (so a seeded request's numbers depend only on
    its generator and shape_per_row, never on the batch); all other rows come from one vectorized draw
    from md.default_generator (the global RNG if None).
    """
    shape = (md.num_reqs, *shape_per_row)
    out = torch.rand(shape, generator=md.default_generator, device=device)
    for row, gen in md.generators.items():
        out[row] = torch.rand(tuple(shape_per_row), generator=gen, device=device)
    return out


def random_exponential(md: SamplingMetadata, shape_per_row: Sequence[int],
                       device: torch.device | str) -> Tensor:
    """[num_rows, *shape_per_row] float32 Exp(1) draws, > 0; generators as in `random_uniform`."""
    shape = (md.num_reqs, *shape_per_row)
    out = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=md.default_generator)
    if md.generators:
        # A seeded greedy row never reads its noise (one-hot p wins the race with any E > 0), so it does
        # not draw any: its generator's stream then does not depend on whether other rows are random.
        temps = md.host_temperature
        if temps is None:
            # SYNC: one read of the temperatures, only when the batch has seeded rows and the metadata was not
            # built from host lists (from_lists keeps them, so the step path never waits here).
            temps = md.temperature.tolist()
        for row, gen in md.generators.items():
            if temps[row] > 0:
                out[row].exponential_(generator=gen)
    return out.clamp_(min=_MIN_EXPONENTIAL)


def exponential_race(probs: Tensor, exponentials: Tensor | None) -> Tensor:
    """Sample index argmax(probs / E) along the last dim; `exponentials` None means plain argmax.

    probs: [..., V] float32, unnormalised is fine; exponentials: broadcastable to probs, > 0.
    Returns [...] int64.
    """
    if exponentials is None:
        return probs.argmax(dim=-1)
    return (probs / exponentials).argmax(dim=-1)


def sample_from_probs(probs: Tensor, md: SamplingMetadata) -> Tensor:
    """probs: [num_rows, V] float32 (from `logits_to_probs`) -> [num_rows] int64 tokens."""
    if md.all_greedy:
        return probs.argmax(dim=-1)
    return exponential_race(probs, random_exponential(md, probs.shape[1:], probs.device))


class Sampler:
    """Samples one token per row: argmax for greedy rows, the exponential race for the others."""

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> Tensor:
        """logits: [num_rows, V] -> [num_rows] int64."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        return self.sample_with_probs(logits, md)[0]

    def sample_with_probs(self, logits: Tensor, md: SamplingMetadata) -> tuple[Tensor, Tensor]:
        """logits: [num_rows, V] -> (tokens [num_rows] int64, probs [num_rows, V] float32).

        The draft model keeps `probs` (its q) for rejection sampling.
        """
        probs = logits_to_probs(logits, md)
        return sample_from_probs(probs, md), probs
