"""The draft proposer: k draft tokens per decoding request, from the draft model's own KV cache.

Step 0 catches the draft up to the target's frontier for every planned request (the tokens it has not
seen: a prefill chunk, or the last accepted token and the bonus token) and samples the first draft
token of each decoding request. Steps 1..k-1 feed one draft token each. Between steps the attention
metadata of EVERY draft KV-cache group is rebuilt: positions advance, a step may cross a block
boundary (new slot), and a sliding window's start moves.
"""

from __future__ import annotations

import torch

from engine.host_copy import to_device
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.saguaro import SaguaroSampling, sample_saguaro
from engine.sample.sampler import Sampler
from engine.speculation.draft_loop import DraftLoop
from engine.step.logits_processors import needs_processing, process_target_logits
from engine.step.plan import StepPlan
from engine.step.plan_sampling import DRAFT_STREAM, request_generator, sampling_metadata
from engine.step.proposal import DraftProposal, empty_proposal


class DraftProposer:
    def __init__(self, runner: ModelRunner, keep_probs: bool, seed: int = 0, ahead: bool = False,
                 saguaro: SaguaroSampling | None = None) -> None:
        """ahead: the proposer also drafts windows ahead (a guessed token, then k drafts): its loop is sized for
        k + 1 steps. With more than one branch (EngineConfig.speculation_ahead_branches) every proposal also records
        each draft's runner-up token (`DraftProposal.alt_token_ids`), the guesses of the rejection branches.
        saguaro: draw every sampled draft from q with its likeliest tokens scaled down (engine/sample/saguaro.py);
        None: off (a draft that drafts ahead is given EngineConfig.speculation_ahead_saguaro's: DraftSide)."""
        self.runner = runner
        self.sampler = Sampler()
        self.keep_probs = keep_probs  # only probabilistic rejection reads q
        self.alternatives = ahead and runner.config.speculation_ahead_branches > 1
        # Fixed before the loop captures its graphs, which bake it in.
        self.saguaro = saguaro
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed + 1)
        # Kernel path: the k steps run from static buffers, as CUDA graphs where captured.
        self.loop: DraftLoop | None = None
        if runner.buffers is not None:
            # Mixed graphs first (a step's first draft forward with a prefill chunk replays one; the loop's own
            # graphs cover catch-ups of at most two tokens), then the loop's graphs, in the same memory pool.
            runner.capture_graphs([])
            self.loop = DraftLoop(runner, runner.config.num_speculative_tokens + (1 if ahead else 0), keep_probs,
                                  alternatives=self.alternatives, saguaro=self.saguaro)
            self.loop.capture()

    @torch.inference_mode()
    def propose(self, plan: StepPlan, guess_first: bool = False, guesses: list[int] | None = None) -> DraftProposal:
        """guess_first: the first token of each request is the draft's argmax (a guessed bonus token, for
        speculation ahead: engine/speculation/ahead/proposer.py), drawing no random numbers; the rest are sampled as
        a proposal's, a seeded request's from the generator of its plan's output position. guesses: per request
        instead, 0 (the first token drawn as usual), 1 (the argmax) or 2 (the most likely token but the argmax)."""
        guesses = guesses if guesses is not None else [1 if guess_first else 0] * len(plan.requests)
        if any(g == 2 for g in guesses) and not self.alternatives:
            raise ValueError("a runner-up guess needs a proposer that records alternatives")
        if self.loop is not None and not _has_grammar(plan):
            return self._propose_loop(plan, guesses)
        dev = self.runner.device
        reqs = plan.requests
        ks = [r.num_draft_tokens for r in reqs]
        max_k = max(ks, default=0)
        ids, probs = empty_proposal(len(reqs), max_k, self.runner.vocab_size, self.keep_probs, dev)
        alt = torch.zeros(len(reqs), max_k, dtype=torch.int64, device=dev) if self.alternatives else None
        # Step 0: catch-up (and prefill chunks), logits only where a first draft token is sampled.
        chunks = [Chunk(r.draft_token_ids, r.draft_start_pos, 1 if r.num_draft_tokens else 0, r.draft_block_tables)
                  for r in reqs]
        rows = [i for i, k in enumerate(ks) if k > 0]
        md = sampling_metadata(reqs, DRAFT_STREAM, self.generator, dev)
        last: list[int] = []
        process = needs_processing(reqs)
        so_far: list[list[int]] = [[] for _ in reqs]  # each request's drafts of this step (the processors' history)
        for j in range(max_k):
            if j > 0:
                rows = [i for i in rows if ks[i] > j]
                chunks = [Chunk([last[i]], reqs[i].draft_start_pos + len(reqs[i].draft_token_ids) + j - 1, 1,
                                reqs[i].draft_block_tables) for i in rows]
            # Metadata for every draft KV-cache group is rebuilt from this step's positions.
            logits = self.runner.forward_chunks([c for c in chunks if c.token_ids])
            if process:
                # The target's penalties, biases and masks on the draft's proposal too: not needed for exactness
                # (rejection sampling corrects any q), but a draft that proposes banned or penalised tokens is
                # rejected where it need not be. q stays the distribution the drafts are sampled from.
                logits = process_target_logits(logits[:, None], [reqs[i] for i in rows], [so_far[i] for i in rows],
                                               start=j)[:, 0]
            row_idx = to_device(rows, torch.int64, dev)
            guessed = [n for n, i in enumerate(rows) if guesses[i]] if j == 0 else []
            if len(guessed) == len(rows):  # every row guesses (no random numbers drawn)
                tok, p = logits.argmax(dim=-1), None
            elif guessed:  # some rows guess, the others draw (only theirs: a guess draws no random numbers)
                drawn = [n for n in range(len(rows)) if not guesses[rows[n]]]
                tok = logits.argmax(dim=-1)
                d_idx = to_device(drawn, torch.int64, dev)
                d_tok, d_p = self._draw(logits[d_idx], md.select([rows[n] for n in drawn]))
                tok[d_idx] = d_tok
                p = None
                if probs is not None:
                    probs[row_idx[d_idx], j] = d_p
            else:
                tok, p = self._draw(logits, md.select(rows))
            if alt is not None:
                top2 = logits.topk(2, dim=-1).indices  # [rows, 2] int64
                other = torch.where(top2[:, 0] == tok, top2[:, 1], top2[:, 0])
                alt[row_idx, j] = other
                if j == 0:  # a runner-up guess takes the most likely token but the argmax
                    second = to_device([guesses[i] == 2 for i in rows], torch.bool, dev)
                    tok = torch.where(second, other, tok)
            ids[row_idx, j] = tok
            if probs is not None and p is not None:
                probs[row_idx, j] = p
            # SYNC: the next draft step's input ids are built on the host.
            last = ids[:, j].tolist()
            for i in rows:
                so_far[i].append(last[i])
        if max_k == 0 and any(c.token_ids for c in chunks):
            # Only catch-up work (prefill chunks, k = 0 decodes): keep the draft's KV in step.
            self.runner.forward_chunks([c for c in chunks if c.token_ids])
        return DraftProposal(ids, probs, alt)

    def eager(self, plan: StepPlan) -> bool:
        """Whether `propose` drafts this plan on the eager path, which applies the requests' logits processing and
        draws a seeded request's random numbers one draft at a time, rather than on the draft loop, which does
        neither (it draws each seeded row's numbers up front, [k, V] at once)."""
        return self.loop is None or _has_grammar(plan)

    def _draw(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, V] -> (drafts [rows] int64, the q [rows, V] float32 they were drawn from)."""
        if self.saguaro is None:
            return self.sampler.sample_with_probs(logits, md)
        return sample_saguaro(logits_to_probs(logits, md), md, self.saguaro.top_f, self.saguaro.factor)

    def _propose_loop(self, plan: StepPlan, guesses: list[int]) -> DraftProposal:
        """The same proposal from the draft loop's buffers and graphs. Its random numbers are drawn up front
        (the eager torch path draws them step by step), so sampled drafts differ between the two paths;
        both draw from the same distributions, and greedy drafts are identical."""
        dev = self.runner.device
        reqs = plan.requests
        ks = [r.num_draft_tokens for r in reqs]
        max_k = max(ks, default=0)
        rows = [i for i, r in enumerate(reqs) if r.draft_token_ids]
        if any(k > 0 and not reqs[i].draft_token_ids for i, k in enumerate(ks)):
            raise RuntimeError("a speculating request has no unseen token for the draft")
        ids = torch.full((len(reqs), max_k), -1, dtype=torch.int64, device=dev)
        probs = None
        alt = None
        if rows:
            chunks = [Chunk(reqs[i].draft_token_ids, reqs[i].draft_start_pos, 1, reqs[i].draft_block_tables)
                      for i in rows]
            sub = [reqs[i] for i in rows]
            md = sampling_metadata(sub, DRAFT_STREAM, self.generator, dev)
            gens = {n: request_generator(r.seed, r.num_output_tokens, DRAFT_STREAM, dev)
                    for n, r in enumerate(sub) if r.seed is not None and r.temperature > 0}
            loop_ids, loop_probs = self.loop.run(chunks, [ks[i] for i in rows], md, gens, self.generator,
                                                 guesses=[guesses[i] for i in rows])
            # Cloned: the next run overwrites the loop's buffer.
            loop_alt = self.loop.alt[:len(rows), :max_k].clone() if self.loop.alt is not None and max_k else None
            if max_k and len(rows) == len(reqs):
                ids = loop_ids  # every request drafts (the usual case): no scatter
                alt = loop_alt
                if loop_probs is not None and self.keep_probs:
                    probs = loop_probs
            elif max_k:
                row_idx = to_device(rows, torch.int64, dev)
                ids[row_idx] = loop_ids
                if loop_alt is not None:
                    alt = torch.zeros(len(reqs), max_k, dtype=torch.int64, device=dev)
                    alt[row_idx] = loop_alt
                if loop_probs is not None and self.keep_probs:
                    probs = torch.zeros(len(reqs), max_k, loop_probs.shape[-1], device=dev)
                    probs[row_idx] = loop_probs
        return DraftProposal(ids, probs, alt)


def _has_grammar(plan: StepPlan) -> bool:
    """Whether a request of the plan constrains its output with a grammar. Such a step drafts on the eager path,
    whose steps mask each draft position under the grammar (the draft loop's graphs do not mask): still exact
    either way, rejection sampling reads the q the drafts came from, but an unconstrained draft is mostly rejected."""
    return any(r.logits_params is not None and r.logits_params.grammar is not None for r in plan.requests)
