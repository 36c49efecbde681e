"""An EAGLE-3 head's k draft steps on the kernel path: the draft loop (draft_loop.py) with the head's states fed in,
captured as CUDA graphs and replayed.

The first step catches the head up from the target: each request's pending positions (the verify's input token and
its accepted drafts, at most k + 1 rows) pair the tokens after them with the target's auxiliary states, which the
proposer copies into a static buffer (`target_in`, rows packed as the step's tokens are); the step's forward takes
them through `fc` (and the head's input norms), writes the head's KV at those positions and samples column 0 from
each request's last row. Every later step reads, besides the token just drafted, the head's state of the step before
(engine/models/eagle3.py: its pre-norm output, or its final norm's output with norm_output), in a second static
buffer (`hidden_in`, one row a request): each step's forward reads it and writes its own over it, so a replayed graph
carries it to the next replay as the loop's in-place metadata rebuild carries positions and slots. Sampling, the
draft probabilities q (inside the replay, where probabilistic rejection reads them) and the rebuild of every KV-cache
group's metadata are the draft loop's. So a proposal whose catch-ups fit is k graph replays and no host sync.

A longer catch-up (a prompt's states, or the positions of steps the head sat out at k = 0) runs its first step
eagerly in the proposer (engine/speculation/eagle3_proposer.py), which hands the loop each drafting row's first
token and state (`run_later`) for steps 1..k-1.
"""

from __future__ import annotations

import torch

from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, StepInput
from engine.sample.metadata import SamplingMetadata
from engine.speculation.draft_loop import DraftLoop


class Eagle3Loop(DraftLoop):
    """Buffers and graphs of an EAGLE-3 head's k steps for up to max_num_reqs requests."""

    one_token_first = False  # the first step reads the target's states through fc: never the later steps' graph

    def __init__(self, runner: ModelRunner, max_k: int, keep_probs: bool) -> None:
        super().__init__(runner, max_k, keep_probs)
        self.head = runner.model
        cfg = self.head.config
        r = runner.buffers.max_num_reqs
        # A catch-up after a verify: its input token and up to k accepted drafts.
        self.first_query_len = self.max_k + 1
        # [max_num_reqs, hidden_size] in the head's dtype: each row's state of the step before.
        self.hidden_in = torch.zeros(r, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
        # [max_num_reqs * first_query_len, len(aux) * target_hidden] in the head's dtype: the first step's target
        # states, packed as its tokens; padding rows keep earlier proposals' values (finite; slot -1, never read).
        rows = min(r * self.first_query_len, runner.buffers.max_num_tokens)
        self.target_in = torch.zeros(rows, len(cfg.aux_layer_ids) * cfg.target_hidden_size, dtype=runner.dtype,
                                     device=runner.device)

    def fits(self, chunks: list[Chunk]) -> bool:
        """Whether a first step of these catch-ups runs on the loop: rows and tokens within its buffers."""
        return (0 < len(chunks) <= self.buffers.max_num_reqs
                and all(0 < len(c.token_ids) <= self.first_query_len for c in chunks)
                and sum(len(c.token_ids) for c in chunks) <= self.target_in.shape[0])

    def _forward_first(self, step: StepInput) -> torch.Tensor:
        """The head over the catch-up's tokens and the target's states of them (through fc)."""
        return self._head_step(step, self.target_in[:step.num_tokens], from_target=True)

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The head over the step's tokens and the rows' states of the step before."""
        return self._head_step(step, self.hidden_in[:step.num_tokens], from_target=False)

    def _head_step(self, step: StepInput, hidden: torch.Tensor, from_target: bool) -> torch.Tensor:
        """One head forward; keeps each logits row's state for the next step in `hidden_in`. Returns logits over
        the draft vocabulary [b, draft vocab] (`_greedy` and `_target_logits` map them)."""
        out = self.head(step.input_ids, step.positions, step.attn, hidden, from_target)[step.logits_indices]
        self.hidden_in[:out.shape[0]].copy_(self.head.next_state(out))
        return self.head.draft_logits(out)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.greedy_ids(logits)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.to_target(logits)

    def _mixed_key(self, chunks: list[Chunk]) -> None:
        return None  # the runner's mixed graphs run the forward without the head's states

    @torch.inference_mode()
    def run_first(self, chunks: list[Chunk], ks: list[int], states: list[torch.Tensor], md: SamplingMetadata,
                  seeded_gens: dict[int, torch.Generator], default_gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A whole proposal on the loop. chunks: each row's catch-up (`fits`), one logits row each; ks: each row's
        draft count (0: a catch-up only); states: each chunk's target states [len(chunk), len(aux) * target_hidden],
        in order, concatenated straight into the static buffer; md, seeded_gens, default_gen: as DraftLoop.run.
        Returns DraftLoop.run's."""
        if not self.fits(chunks):
            raise ValueError("these catch-ups do not fit the head loop's first step")
        lengths = [len(c.token_ids) for c in chunks]
        if [s.shape[0] for s in states] != lengths:
            raise ValueError(f"target states of {[s.shape[0] for s in states]} tokens for chunks of {lengths}")
        torch.cat(states, out=self.target_in[:sum(lengths)])
        return self.run(chunks, ks, md, seeded_gens, default_gen)

    @torch.inference_mode()
    def run_later(self, chunks: list[Chunk], ks: list[int], state: torch.Tensor, md: SamplingMetadata,
                  seeded_gens: dict[int, torch.Generator], default_gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1..max(ks)-1 of rows whose first step the proposer ran. chunks: each row's first draft at its head
        position (one token, num_logits 1); ks: each row's draft count (> 1); state: [n, hidden_size] the first
        step's states fed forward (Eagle3Head.next_state); md, seeded_gens, default_gen: the rows' sampling
        settings and generators, those of a seeded row already past its first draw (later columns draw fresh
        numbers, never its first draft's again). Returns ids [n, max(ks)] int64 (-1 beyond a row's count) and q
        [n, max(ks), V] (a view of the static buffer, valid until the next proposal) or None when every row is
        greedy; column 0 of both is not written (the proposer holds the first drafts)."""
        n, max_k = len(chunks), max(ks)
        if max_k > self.max_k:
            raise ValueError(f"draft length {max_k} exceeds the head loop's {self.max_k}")
        b, graphed, greedy = self._prepare(ks, md, seeded_gens, default_gen, [0] * n)
        self.hidden_in[:n].copy_(state)
        self.buffers.load(chunks, num_reqs=b, num_tokens=b, max_query_len=1, num_logits_padded=b)
        self.step_idx.fill_(1)
        return self._later_steps(n, max_k, b, graphed, greedy)
