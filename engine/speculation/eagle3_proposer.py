"""The EAGLE-3 proposer: k draft tokens per request from a one-layer head over the target's hidden states.

The head (engine/models/eagle3.py) pairs, at head position p, the token at p + 1 with the target's auxiliary states
of position p. So it can only run a position once the target has: after every target forward (a prefill chunk or a
verify) the verifier hands this proposer the auxiliary states of the positions that stand (`absorb_target`: a chunk's
every position, a verify's input token and accepted drafts, not the rejected ones) and the tokens now known after them
(the chunk's, the accepted drafts and the bonus token). They wait per request until the next proposal, which first
re-runs them through the head (a catch-up: its KV at those positions written from the target's states, over whatever
its own drafting had left there) and samples the first draft from the last one; each later draft step feeds the token
just drafted with the head's own pre-norm state of the step before. A request's pending states survive steps in which
the proposer does not run (no speculation that step; the catch-up after many such steps may hold more rows than the
runner's input buffers: its leading rows then run ahead in forwards that fit, `ModelRunner.cut_to_fit`, each with
its target states), and are dropped when the request finishes or is preempted. A
request that speculates before the target has run its last token (a one-token prompt's first step) has no state to
draft from: its drafts that step are drawn blind (`_draft_blind`).

The head's KV lives in the draft's blocks (a KV-cache group of the drafter, allocated by the scheduler as a draft
model's): head position p <= the draft model's position p + 1, so a draft model's allocation covers it. Where the
target skipped positions (a prefix-cache hit) the head keeps what its cached blocks hold there and starts from the
target's first computed position: drafts may be worse there, never wrong (the verify decides).

On the kernel path a proposal runs on the head's loop (engine/speculation/eagle3_loop.py: the draft loop's buffers,
in-place metadata rebuild and CUDA graphs, the target's states and the head's own carried from step to step), beside
a target whose CUDA graphs keep the auxiliary states as a side output (`keep_target_states`): its first step too
where every request's catch-up is a verify's (at most k + 1 positions), else that step runs eagerly here and the
loop runs the later ones. Grammar masks and logits
processing are not applied to the head's drafts: rejection sampling reads the q each draft was drawn from, so the
output is exact either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.host_copy import to_device
from engine.models.layers import VocabParallelEmbedding
from engine.models.loader import checkpoint_tensor
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler
from engine.speculation.eagle3_loop import Eagle3Loop
from engine.step.plan import StepPlan, StepResult
from engine.step.plan_sampling import DRAFT_STREAM, sampling_metadata
from engine.step.proposal import DraftProposal, empty_proposal


@dataclass
class _Pending:
    """A request's target states the head has not consumed yet."""

    next_pos: int  # the head position of hidden[0]: the next pair (token at next_pos + 1, state at next_pos)
    # [m, len(aux) * target_hidden] on the device, rows for positions next_pos.. (pieces, concatenated when used)
    hidden: list[torch.Tensor] = field(default_factory=list)
    num_hidden: int = 0
    tokens: list[int] = field(default_factory=list)  # tokens at positions next_pos + 1, ...

    @property
    def hidden_end(self) -> int:
        return self.next_pos + self.num_hidden


class Eagle3Proposer:
    """Behind the draft proposer's interface (`propose(plan) -> DraftProposal`), over the head's runner; the target's
    runner keeps the auxiliary states of every forward for it. `target` None: the head runs on workers of its own
    (served, draft_placement separate), where each target forward's states come with its result
    (StepResult.target_states, `ship_target_states`) and the embedding is read from the target's checkpoint at
    `target_path` where the head has none of its own."""

    def __init__(self, runner: ModelRunner, target: ModelRunner | None, keep_probs: bool, seed: int = 0,
                 target_path: str | None = None) -> None:
        from engine.models.eagle3 import Eagle3Head

        head = runner.model
        if not isinstance(head, Eagle3Head):
            raise TypeError(f"an EAGLE-3 proposer needs an EAGLE-3 head, got {type(head).__name__}")
        if target is not None and tuple(target.model.model.aux_layer_ids) != tuple(runner.model_config.aux_layer_ids):
            raise RuntimeError("the target keeps no auxiliary states for this head: call keep_target_states before "
                               "the target's graphs are captured")
        self.runner = runner
        self.target = target
        self.head = head
        self.keep_probs = keep_probs
        self.sampler = Sampler()
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed + 1)
        if target is not None:
            head.share_embedding(target.model.model.embed_tokens)
        elif head.embed_tokens is None:
            if target_path is None:
                raise ValueError("a head without an embedding of its own, away from its target, needs the target's "
                                 "checkpoint (target_path) to read the embedding from")
            head.share_embedding(_target_embedding(runner, target_path))
        runner.warm_up_attention()  # now that the head can embed (its runner skipped it at start-up)
        # Kernel path: steps 1..k-1 on the head's loop (CUDA graphs where captured); the first step stays eager.
        self.loop: Eagle3Loop | None = None
        if runner.buffers is not None:
            self.loop = Eagle3Loop(runner, runner.config.num_speculative_tokens, keep_probs)
            self.loop.capture()
        self.pending: dict[str, _Pending] = {}

    @staticmethod
    def keep_target_states(target: ModelRunner, aux_layer_ids: tuple[int, ...]) -> None:
        """Have every target forward keep the states entering a head's auxiliary layers: the target's CUDA graphs,
        captured after this, keep them as a side output (engine/runner/cuda_graphs.py)."""
        if target.graphs is not None:
            raise RuntimeError("the target's graphs are already captured without the head's auxiliary states")
        target.model.model.aux_layer_ids = tuple(aux_layer_ids)

    @staticmethod
    def ship_target_states(target: ModelRunner, aux_layer_ids: tuple[int, ...]) -> Callable[
            [StepPlan, list[int], StepResult], None]:
        """For a head on workers of its own: have every target forward keep the states entering `aux_layer_ids`
        (before the target's graphs are captured) and return the verifier's `on_forward` hook that puts them on the
        host, in the result (StepResult.target_states: every token of the forward, as `absorb_target` reads them)."""
        Eagle3Proposer.keep_target_states(target, aux_layer_ids)

        def ship(plan: StepPlan, counts: list[int], result: StepResult) -> None:
            aux = target.model.model.aux_hidden
            if aux is None:
                raise RuntimeError("the target kept no auxiliary states in its forward")
            rows = aux[:sum(len(r.token_ids or ()) + k for r, k in zip(plan.requests, counts))]
            # SYNC: after the step's sampling sync; a host copy either way (the buffer is the next forward's).
            result.target_states = rows.cpu() if rows.is_cuda else rows.clone()

        return ship

    # ---- after every target forward --------------------------------------------------------------------
    def absorb_target(self, plan: StepPlan, counts: list[int], result: StepResult) -> None:
        """Keep the auxiliary states of the positions that stand after the target's forward of `plan` (counts: the
        drafts it verified per request), and the tokens known after them. The states: the target's of this process,
        or those the result brought (StepResult.target_states: a head on workers of its own)."""
        self._forget(plan)
        if self.target is not None:
            aux = self.target.model.model.aux_hidden
        elif result.target_states is not None:
            aux = result.target_states.to(self.runner.device, self.runner.dtype, non_blocking=True)
        else:
            aux = None
        if aux is None:
            raise RuntimeError("the target kept no auxiliary states in its forward")
        offset = 0
        for r, k, sampled, accepted in zip(plan.requests, counts, result.sampled, result.num_accepted):
            n = len(r.token_ids or ())
            rows, tokens = n, list(r.token_ids or ())
            if sampled is not None:
                rows = n + accepted  # the input tokens and the accepted drafts: the bonus token has no state yet
                tokens += sampled
            self._append(r.request_id, r.start_pos, aux[offset:offset + rows], tokens)
            offset += n + k
        if offset > aux.shape[0]:
            raise RuntimeError(f"the target's forward kept {aux.shape[0]} states for a plan of {offset} tokens")

    def _append(self, rid: str, start: int, hidden: torch.Tensor, tokens: list[int]) -> None:
        st = self.pending.get(rid)
        if st is None or start != st.hidden_end:
            # A new request, one recomputed from an earlier position, or one whose target skipped positions (a
            # prefix-cache hit): the head starts over from the target's first position here.
            st = self.pending[rid] = _Pending(start)
        if hidden.shape[0]:
            st.hidden.append(hidden)
            st.num_hidden += hidden.shape[0]
        for j, t in enumerate(tokens):
            pos = start + j
            if pos == st.next_pos + 1 + len(st.tokens):
                st.tokens.append(int(t))

    def _forget(self, plan: StepPlan) -> None:
        if plan.finished_ids:
            live = {r.request_id for r in plan.requests}
            for rid in plan.finished_ids:
                if rid not in live:
                    self.pending.pop(rid, None)

    # ---- a proposal ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, plan: StepPlan, guess_first: bool = False, guesses: list[int] | None = None) -> DraftProposal:
        if guess_first or (guesses is not None and any(guesses)):
            raise ValueError("an EAGLE-3 head drafts after the verify; it cannot guess windows ahead")
        self._forget(plan)
        dev = self.runner.device
        reqs = plan.requests
        ks = [r.num_draft_tokens for r in reqs]
        max_k = max(ks, default=0)
        # Step 0: every request's pending pairs through the head, from the target's states.
        chunks, states, drafting, last_pos, blind, owners = [], [], [], [], [], []
        for i, r in enumerate(reqs):
            chunk = self._catch_up(r.request_id, r.draft_block_tables, want_logits=ks[i] > 0)
            if chunk is None:
                if ks[i]:
                    blind.append(i)
                continue
            c, hidden = chunk
            chunks.append(c)
            owners.append(i)
            states.append(hidden)
            if ks[i]:
                drafting.append(i)
                last_pos.append(c.start_pos + len(c.token_ids) - 1)
        if not blind and max_k > 0 and self.loop is not None:
            # Every logits row a request: rows without drafts (k = 0) sample a token no one reads.
            full = [Chunk(c.token_ids, c.start_pos, 1, c.block_tables) for c in chunks]
            if self.loop.fits(full):
                return self._propose_on_loop(reqs, ks, owners, full, states)
        ids, probs = empty_proposal(len(reqs), max_k, self.runner.vocab_size, self.keep_probs, dev)
        if blind:
            self._draft_blind(plan, blind, ids, probs)
        if not chunks:
            return DraftProposal(ids, probs)
        logits, prenorm = self._forward(chunks, torch.cat(states), from_target=True)
        if not drafting:
            return DraftProposal(ids, probs)
        md = sampling_metadata([reqs[i] for i in drafting], DRAFT_STREAM, self.generator, dev)
        rows = list(range(len(drafting)))  # the drafting requests (indices into `drafting`) this step feeds
        tok = self._draw(logits, md, rows, len(drafting), ids, probs, drafting, 0)
        state = self.head.next_state(prenorm)
        if self.loop is not None and max_k > 1:
            self._later_on_loop(reqs, ks, drafting, last_pos, tok, state, md, ids, probs)
            return DraftProposal(ids, probs)
        for j in range(1, max_k):
            keep = [m for m, n in enumerate(rows) if ks[drafting[n]] > j]
            if not keep:
                break
            index = to_device(keep, torch.int64, dev)
            tok, state = tok.index_select(0, index), state.index_select(0, index)
            rows = [rows[m] for m in keep]
            # SYNC: the next step's input ids are built on the host (one small copy a step).
            prev = tok.tolist()
            chunks = [Chunk([prev[m]], last_pos[n] + j, 1, reqs[drafting[n]].draft_block_tables)
                      for m, n in enumerate(rows)]
            logits, prenorm = self._forward(chunks, state, from_target=False)
            state = self.head.next_state(prenorm)
            tok = self._draw(logits, md, rows, len(drafting), ids, probs, drafting, j)
        return DraftProposal(ids, probs)

    def _propose_on_loop(self, reqs: list, ks: list[int], rows: list[int], chunks: list[Chunk],
                         states: list[torch.Tensor]) -> DraftProposal:
        """The whole proposal on the head's loop. rows: the requests (indices into reqs) with a catch-up, every one
        that drafts among them; chunks: their catch-ups, one logits row each; states: their target states, in order.
        Returns the proposal: the loop's drafts (and q) at the rows, -1 elsewhere."""
        sub = [reqs[i] for i in rows]
        md = sampling_metadata(sub, DRAFT_STREAM, self.generator, self.runner.device)
        seeded = {n: g for n, g in md.generators.items() if sub[n].temperature > 0}
        loop_ids, loop_probs = self.loop.run_first(chunks, [ks[i] for i in rows], states, md, seeded, self.generator)
        if len(rows) == len(reqs):  # every request catches up (the usual case): no scatter
            return DraftProposal(loop_ids, loop_probs if self.keep_probs else None)
        ids, probs = empty_proposal(len(reqs), loop_ids.shape[1], self.runner.vocab_size,
                                    self.keep_probs and loop_probs is not None, self.runner.device)
        dest = to_device(rows, torch.int64, self.runner.device)
        ids[dest] = loop_ids
        if probs is not None:
            probs[dest] = loop_probs
        return DraftProposal(ids, probs)

    def _later_on_loop(self, reqs: list, ks: list[int], drafting: list[int], last_pos: list[int], tok: torch.Tensor,
                       state: torch.Tensor, md: SamplingMetadata, ids: torch.Tensor, probs: torch.Tensor | None
                       ) -> None:
        """Drafts 1..k-1 of the drafting rows with more than one, on the head's loop (eagle3_loop.py), into the
        proposal's ids and probs. tok, state: the first step's drafts and the states it feeds forward, of every
        drafting row; md: their sampling settings, whose seeded generators are past the first draw."""
        later = [m for m, i in enumerate(drafting) if ks[i] > 1]
        if not later:
            return
        dev = self.runner.device
        index = to_device(later, torch.int64, dev)
        # SYNC: the second step's input ids are built on the host (once a proposal; the loop's steps need none).
        prev = tok.index_select(0, index).tolist()
        chunks = [Chunk([prev[n]], last_pos[m] + 1, 1, reqs[drafting[m]].draft_block_tables)
                  for n, m in enumerate(later)]
        sub = md.select(later)
        seeded = {n: g for n, g in sub.generators.items() if reqs[drafting[later[n]]].temperature > 0}
        loop_ids, loop_probs = self.loop.run_later(chunks, [ks[drafting[m]] for m in later],
                                                   state.index_select(0, index), sub, seeded, self.generator)
        dest = to_device([drafting[m] for m in later], torch.int64, dev)
        width = loop_ids.shape[1]
        ids[dest, 1:width] = loop_ids[:, 1:]
        if probs is not None and loop_probs is not None:
            probs[dest, 1:width] = loop_probs[:, 1:]

    def _draft_blind(self, plan: StepPlan, rows: list[int], ids: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Drafts for requests whose last token the target has not run yet (a one-token prompt speculates in its
        first step), where the head has no state to draft from: drawn from the uniform law over the draft
        vocabulary (a greedy row takes its first id), q recorded as that law. Exact like any proposal (the verify
        decides); their acceptance is low, once per such request."""
        dev = self.runner.device
        reqs = [plan.requests[i] for i in rows]
        md = sampling_metadata(reqs, DRAFT_STREAM, self.generator, dev)
        logits = torch.zeros(len(rows), self.head.config.draft_vocab_size, device=dev)  # over the draft vocabulary
        ks = [r.num_draft_tokens for r in reqs]
        for j in range(max(ks)):
            live = [n for n, k in enumerate(ks) if k > j]
            self._draw(logits[:len(live)], md, live, len(rows), ids, probs, rows, j)

    def _draw(self, logits: torch.Tensor, md: SamplingMetadata, rows: list[int], num_drafting: int, ids: torch.Tensor,
              probs: torch.Tensor | None, drafting: list[int], j: int) -> torch.Tensor:
        """Sample column j's drafts of `rows` (indices into `drafting`) from logits over the draft vocabulary
        [len(rows), draft vocab]; write them (and q where kept) into the proposal's buffers. Returns the drafts
        [len(rows)] int64 (target ids)."""
        row_md = md if len(rows) == num_drafting else md.select(rows)
        dest = to_device([drafting[n] for n in rows], torch.int64, self.runner.device)
        if row_md.all_greedy and probs is None:
            tok = self.head.greedy_ids(logits)  # as the loop's greedy steps take it
        else:
            tok, p = self.sampler.sample_with_probs(self.head.to_target(logits), row_md)
            if probs is not None:
                probs[dest, j] = p
        ids[dest, j] = tok
        return tok

    def _catch_up(self, rid: str, block_tables: list[list[int]], want_logits: bool
                  ) -> tuple[Chunk, torch.Tensor] | None:
        """The request's pending pairs as a chunk of the head's forward and their target states [m, F]; consumed.
        None where none is pending or the draft's blocks do not reach them yet."""
        st = self.pending.get(rid)
        if st is None or not block_tables:
            return None
        m = min(st.num_hidden, len(st.tokens))
        if m == 0:
            return None
        block_size = self.runner.kv_groups[0].spec.block_size
        if len(block_tables[0]) * block_size < st.next_pos + m:
            return None
        hidden = torch.cat(st.hidden) if len(st.hidden) > 1 else st.hidden[0]
        chunk = Chunk(st.tokens[:m], st.next_pos, 1 if want_logits else 0, block_tables)
        rest = hidden[m:]
        st.hidden = [rest] if rest.shape[0] else []
        st.num_hidden -= m
        st.tokens = st.tokens[m:]
        st.next_pos += m
        return chunk, hidden[:m]

    def _forward(self, chunks: list[Chunk], hidden: torch.Tensor, from_target: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `chunks` (hidden: their rows' states, in order) -> (logits [rows wanting logits, draft
        vocab] over the draft vocabulary, the head's pre-norm states of those rows [rows, hidden_size])."""
        if from_target:  # a catch-up past the input buffers (pending pairs of steps at k = 0): its leading rows first
            cut = self.runner.cut_to_fit(chunks)
            if cut is not None:
                for piece, rows in cut.pieces:
                    self._forward(piece, hidden[to_device(rows, torch.int64, hidden.device)], from_target)
                chunks, hidden = cut.rest, hidden[to_device(cut.rest_rows, torch.int64, hidden.device)]
        step = self.runner.prepare_forward(chunks).step
        if step.num_tokens != hidden.shape[0]:
            raise RuntimeError(f"{hidden.shape[0]} hidden states for a head forward of {step.num_tokens} tokens")
        prenorm = self.head(step.input_ids, step.positions, step.attn, hidden.to(self.runner.dtype),
                            from_target)[step.logits_indices]
        return self.head.draft_logits(prenorm), prenorm

    def eager(self, plan: StepPlan) -> bool:
        """Whether proposals draw a seeded request's random numbers draft by draft (DraftProposer.eager's
        question): off the kernel path; on it the head's loop draws each row's later columns up front."""
        return self.loop is None


def _target_embedding(runner: ModelRunner, target_path: str) -> VocabParallelEmbedding:
    """The target's embedding table for a head on workers of its own, read from the target's checkpoint (random,
    as the target's, under load_format "dummy"), sharded as the head's runner is."""
    cfg = runner.model_config
    with torch.device(runner.device):
        emb = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size).to(runner.dtype)
    if runner.config.load_format == "dummy":
        gen = torch.Generator(device="cpu").manual_seed(0)
        weight = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * cfg.hidden_size ** -0.5
    else:
        weight = checkpoint_tensor(Path(target_path), "model.embed_tokens.weight")
    emb.weight_loader(emb.weight, weight.to(runner.dtype))
    return emb
