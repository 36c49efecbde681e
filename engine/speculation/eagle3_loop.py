"""An EAGLE-3 head's later draft steps on the kernel path: the draft loop (draft_loop.py) with the head's own state
fed from step to step, captured as CUDA graphs and replayed.

A head step after the first reads, besides the token just drafted, the head's own pre-norm output of the step before
(engine/models/eagle3.py). That state lives in a static buffer (`hidden_in`, one row a request): each step's forward
reads it and writes its own output over it, in the step function, so a replayed graph carries it to the next replay
as the loop's in-place metadata rebuild carries positions and slots. Sampling, the draft probabilities q (inside the
replay, where probabilistic rejection reads them) and the rebuild of every KV-cache group's metadata are the draft
loop's.

The first step stays with the proposer (engine/speculation/eagle3_proposer.py), eagerly: it re-runs each request's
pending target states through the head (any number of rows a request, through `fc`) and draws column 0. It hands
the loop each drafting row's first token and pre-norm state (`run_later`), and the loop runs steps 1..k-1.
"""

from __future__ import annotations

import torch

from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, StepInput
from engine.sample.metadata import SamplingMetadata
from engine.speculation.draft_loop import DraftLoop


class Eagle3Loop(DraftLoop):
    """Buffers and graphs of an EAGLE-3 head's steps 1..k-1 for up to max_num_reqs requests."""

    captures_first = False  # the first step (the catch-up from the target's states) runs eagerly in the proposer

    def __init__(self, runner: ModelRunner, max_k: int, keep_probs: bool) -> None:
        super().__init__(runner, max_k, keep_probs)
        self.head = runner.model
        # [max_num_reqs, hidden_size] in the head's dtype: each row's pre-norm state of the step before.
        self.hidden_in = torch.zeros(runner.buffers.max_num_reqs, self.head.config.hidden_size,
                                     dtype=runner.dtype, device=runner.device)

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The head over the step's tokens and the rows' states of the step before; keeps this step's states for
        the next. Logits [b, target vocab] float32 (-inf off the draft vocabulary)."""
        prenorm = self.head(step.input_ids, step.positions, step.attn, self.hidden_in[:step.num_tokens],
                            False)[step.logits_indices]
        self.hidden_in[:prenorm.shape[0]].copy_(prenorm)
        return self.head.compute_logits(prenorm)

    @torch.inference_mode()
    def run_later(self, chunks: list[Chunk], ks: list[int], prenorm: torch.Tensor, md: SamplingMetadata,
                  seeded_gens: dict[int, torch.Generator], default_gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1..max(ks)-1 of rows whose first step the proposer ran. chunks: each row's first draft at its head
        position (one token, num_logits 1); ks: each row's draft count (> 1); prenorm: [n, hidden_size] the first
        step's pre-norm states; md, seeded_gens, default_gen: the rows' sampling settings and generators, those of
        a seeded row already past its first draw (later columns draw fresh numbers, never its first draft's
        again). Returns ids [n, max(ks)] int64 (-1 beyond a row's count) and q [n, max(ks), V] (a view of the
        static buffer, valid until the next proposal) or None when every row is greedy; column 0 of both is not
        written (the proposer holds the first drafts)."""
        n, max_k = len(chunks), max(ks)
        if max_k > self.max_k:
            raise ValueError(f"draft length {max_k} exceeds the head loop's {self.max_k}")
        b, graphed, greedy = self._prepare(ks, md, seeded_gens, default_gen, [0] * n)
        self.hidden_in[:n].copy_(prenorm)
        self.buffers.load(chunks, num_reqs=b, num_tokens=b, max_query_len=1, num_logits_padded=b)
        self.step_idx.fill_(1)
        return self._later_steps(n, max_k, b, graphed, greedy)
