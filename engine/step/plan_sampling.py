"""SamplingMetadata for the rows of a step plan, built where the sampling happens (on each worker)."""

from __future__ import annotations

import torch

from engine.sample.metadata import SamplingMetadata
from engine.step.plan import PlannedRequest

_MASK64 = (1 << 63) - 1
TARGET_STREAM, DRAFT_STREAM = 0, 1


def request_generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request at one output position. Seeding from (seed, position) makes
    the request's samples independent of batch composition, of preemption/recompute, and of which
    worker or tensor-parallel rank draws them."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((seed, position, stream)) & _MASK64)
    return g


def sampling_metadata(rows: list[PlannedRequest], stream: int, default_generator: torch.Generator,
                      device: torch.device) -> SamplingMetadata:
    gens = {i: request_generator(r.seed, r.num_output_tokens, stream, device)
            for i, r in enumerate(rows) if r.seed is not None}
    return SamplingMetadata.from_lists([r.temperature for r in rows], [r.top_p for r in rows],
                                       [r.top_k for r in rows], gens, default_generator, device)
