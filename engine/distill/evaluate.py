"""Acceptance of a draft with its target, measured through the engine exactly as served."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.llm import LLM
from engine.request import SamplingParams, SpecStats


@dataclass
class Acceptance:
    temperature: float
    stats: SpecStats
    num_tokens: int  # tokens generated

    @property
    def per_position(self) -> list[float]:
        """Fraction of verify steps whose draft token at position i was accepted (vLLM's per-position rate)."""
        n = self.stats.num_drafts
        return [c / n if n else 0.0 for c in self.stats.accepted_per_position]

    def as_dict(self) -> dict[str, object]:
        return {"temperature": self.temperature, "acceptance_rate": self.stats.acceptance_rate,
                "acceptance_length": self.stats.acceptance_length, "per_position": self.per_position,
                "num_drafts": self.stats.num_drafts, "num_draft_tokens": self.stats.num_draft_tokens,
                "num_accepted_tokens": self.stats.num_accepted_tokens, "num_tokens": self.num_tokens}


def measure_acceptance(llm: LLM, prompts: Sequence[list[int]], temperature: float, max_tokens: int,
                       seed: int = 0) -> Acceptance:
    """Generate for every prompt (batched) and sum the speculation statistics. Sampled rows get one seed each,
    so a figure is reproducible whatever the batching."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
    outs = llm.generate(list(prompts), params)
    return Acceptance(temperature, llm.spec_stats(outs), sum(len(o.token_ids) for o in outs))


def format_acceptance(results: Sequence[Acceptance], k: int) -> str:
    """A small table: one row per temperature."""
    head = f"{'T':>5} {'accept rate':>11} {'accept len':>10}  " + " ".join(f"{'pos' + str(i):>5}" for i in range(k))
    rows = [head]
    for r in results:
        pos = (r.per_position + [0.0] * k)[:k]
        rows.append(f"{r.temperature:>5.2f} {r.stats.acceptance_rate:>11.3f} {r.stats.acceptance_length:>10.3f}  "
                    + " ".join(f"{p:>5.3f}" for p in pos))
    return "\n".join(rows)
