"""Per-step sampling parameters of the batch, as tensors (built once per step by the runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_copy import to_device


@dataclass
class SamplingMetadata:
    """Sampling settings of the requests in one step, one row per request.

    Randomness: a row with an entry in `generators` draws all of its random numbers from that
    generator (the runner seeds it from the request's seed and its output position, so a seeded
    request's samples do not depend on the batch or on preemption). Other rows draw from
    `default_generator` (engine-wide, seeded by `LLM(seed=...)`).
    """

    temperature: torch.Tensor  # [num_reqs] float32; 0.0 = greedy
    top_p: torch.Tensor  # [num_reqs] float32; 1.0 = off
    top_k: torch.Tensor  # [num_reqs] int64; 0 = off
    all_greedy: bool  # every row has temperature 0
    all_random: bool  # no row has temperature 0
    no_top_p: bool  # every row has top_p == 1
    no_top_k: bool  # every row has top_k == 0
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    default_generator: torch.Generator | None = None
    # The temperatures on the host where the metadata was built from host lists: the sampler reads which seeded
    # rows are random from here rather than from the device (a sync that would wait for the step's forward).
    host_temperature: list[float] | None = None  # [num_reqs]

    @property
    def num_reqs(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_lists(cls, temperature: list[float], top_p: list[float], top_k: list[int],
                   generators: dict[int, torch.Generator] | None = None,
                   default_generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu") -> SamplingMetadata:
        t = to_device(temperature, torch.float32, device)
        p = to_device(top_p, torch.float32, device)
        k = to_device(top_k, torch.int64, device)
        return cls(
            temperature=t, top_p=p, top_k=k,
            all_greedy=all(x == 0.0 for x in temperature),
            all_random=all(x > 0.0 for x in temperature),
            no_top_p=all(x >= 1.0 for x in top_p),
            no_top_k=all(x == 0 for x in top_k),
            generators=dict(generators or {}),
            default_generator=default_generator,
            host_temperature=list(temperature),
        )

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The given rows, renumbered 0..len(rows)-1 (generators follow their rows). The flags stay
        those of the superset, which is safe: a subset of an all-greedy batch is all greedy, etc."""
        idx = to_device(rows, torch.int64, self.temperature.device)
        gens = {n: self.generators[i] for n, i in enumerate(rows) if i in self.generators}
        host = [self.host_temperature[i] for i in rows] if self.host_temperature is not None else None
        return SamplingMetadata(self.temperature[idx], self.top_p[idx], self.top_k[idx], self.all_greedy,
                                self.all_random, self.no_top_p, self.no_top_k, gens, self.default_generator, host)
