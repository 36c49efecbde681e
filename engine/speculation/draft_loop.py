"""The draft's k steps on the kernel path: one step function, captured as a CUDA graph and replayed.

A draft step is forward -> logits -> sample -> write the token (and its probabilities q) at column
`step_idx` of static output buffers -> rebuild the next step's inputs in place. The rebuild is the
attention metadata of EVERY draft KV-cache group: each request moves one position on (seq_len + 1), its new
token's slot comes from its block table at that position (which may be a new block), and the sliding window's
start follows the position inside the attention kernel. Everything lives in device buffers, so the step
index is a device tensor and k replays need no host work between them.

The first step also catches the draft up (the last accepted token and the bonus token: up to 2 tokens per
request; or a prefill chunk, whose forward replays one of the runner's mixed graphs, padded to a token bucket, or
runs eagerly past the largest; or a catch-up past the input buffers, whose leading tokens the runner runs ahead in
forwards that fit, `ModelRunner.fit_chunks`), so it is a separate graph of query length 2; when every request
catches up one token (after a rejection, the target's correction) the later steps' graph of query length 1 runs
it. Requests with fewer drafts than the batch's k, and padding rows, keep running but write nowhere (slot -1) and
read only position 0: their extra tokens are dropped.

Speculation ahead with branches (engine/speculation/ahead/branches.py) asks two more things of a step, both in the step
function so graphs and eager runs agree: each row's most likely token other than the one it drew (`alt`: where a
rejection at that draft would leave the target's token, the guess of a rejection branch; a top-2 of the logits, no
extra forward), and a per-row guess mode for column 0 (`guess`: 0 drawn as usual, 1 the argmax, 2 the runner-up:
the guessed bonus tokens of all-accepted branches). With Saguaro sampling (engine/sample/saguaro.py) the step draws
from q with its likeliest tokens scaled down and keeps that q' as the draft's probabilities (`draw_distribution`).
"""

from __future__ import annotations

import bisect

import torch

from engine.config import graph_batch_sizes
from engine.host_copy import to_device
from engine.kernels.rms_norm import use_fused_kernels
from engine.kernels.speculation.argmax import greedy_tokens
from engine.kernels.speculation.draft_advance import advance_draft_inputs, advance_draft_inputs_ref
from engine.runner.cuda_graphs import GraphPool, no_gc_while_capturing
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, StepInput
from engine.sample.metadata import SamplingMetadata
from engine.sample.processing import logits_to_probs
from engine.sample.saguaro import SaguaroSampling, saguaro_probs
from engine.sample.sampler import exponential_race

FIRST_QUERY_LEN = 2  # last accepted token + bonus token


class DraftLoop:
    """Static buffers and graphs of the draft loop for batches of up to max_num_reqs requests."""

    # A first step of one-token rows may replay the later steps' graph (their forward is the same); not where the
    # first step's forward differs from the later ones' (an EAGLE-3 head's reads the target's states).
    one_token_first = True

    def __init__(self, runner: ModelRunner, max_k: int, keep_probs: bool, alternatives: bool = False,
                 saguaro: SaguaroSampling | None = None) -> None:
        """alternatives: each step also records every row's most likely token other than its draw, and column 0
        may be a row's runner-up (speculation ahead's branches). saguaro: sampled rows draw from q scaled as it says
        (engine/sample/saguaro.py), and `probs` keeps that q'; fixed here, as the graphs capture it."""
        if runner.buffers is None:
            raise ValueError("the draft loop needs the kernel path (attention_backend='triton')")
        self.runner = runner
        self.buffers = runner.buffers
        self.max_k = max(max_k, 1)
        self.keep_probs = keep_probs
        dev, r, v = runner.device, runner.buffers.max_num_reqs, runner.vocab_size
        self.ids = torch.zeros(r, self.max_k, dtype=torch.int64, device=dev)  # [max_num_reqs, max_k] int64
        # [max_num_reqs, max_k, V] float32: q of every draft token, read by probabilistic rejection.
        self.probs = torch.zeros(r, self.max_k, v, dtype=torch.float32, device=dev) if keep_probs else None
        # [max_num_reqs, max_k, V] float32 Exp(1) noise, drawn before the loop (seeded rows from their own
        # generator), so graph replays need no random-number state.
        self.noise = torch.ones(r, self.max_k, v, dtype=torch.float32, device=dev)
        # [2, max_num_reqs] int64: per row its draft count (num_draft) and column-0 guess mode (guess, below),
        # staged in pinned memory and uploaded in one copy, and only when they differ from the last proposal's.
        self._row_settings = torch.zeros(2, r, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self._row_settings_host = torch.zeros(2, r, dtype=torch.int64, pin_memory=pin)
        self._row_settings_np = self._row_settings_host.numpy()
        self._row_settings_key: tuple | None = None  # (batch, ks, guesses) now on the device
        self._row_settings_copied = torch.cuda.Event() if pin else None
        self.num_draft = self._row_settings[0]  # [max_num_reqs] int64
        self.temperature = torch.zeros(r, dtype=torch.float32, device=dev)  # [max_num_reqs] float32
        self.top_p = torch.ones(r, dtype=torch.float32, device=dev)  # [max_num_reqs] float32
        self.top_k = torch.zeros(r, dtype=torch.int64, device=dev)  # [max_num_reqs] int64
        self.step_idx = torch.zeros(1, dtype=torch.int64, device=dev)  # [1] int64; column the step writes
        self.first_query_len = FIRST_QUERY_LEN  # tokens a request the first step's graph holds
        self.alternatives = alternatives
        self.saguaro = saguaro
        # [max_num_reqs, max_k] int64: per row and step, the most likely token other than the one drawn there.
        self.alt = torch.zeros(r, self.max_k, dtype=torch.int64, device=dev) if alternatives else None
        # [max_num_reqs] int64: column 0 is drawn as usual (0), the argmax (1, via noise 1) or the runner-up (2).
        self.guess = self._row_settings[1]
        self._cols = torch.arange(self.max_k, device=dev)  # [max_k] int64: column numbers, to mask past a row's k
        sizes = {g.spec.block_size for g in runner.buffers.groups}
        if len(sizes) != 1:  # the engine gives every KV-cache group its block_size
            raise ValueError(f"the draft loop needs one block size for all KV-cache groups, got {sorted(sizes)}")
        self.block_size = sizes.pop()
        self.batch_sizes: list[int] = []
        self.pool: GraphPool | None = None
        # (batch, greedy) -> graph; each graph's output is self.ids (the work is in-place).
        self.first_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.next_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.num_graph_replays = 0
        self.num_one_token_first_steps = 0  # first steps run by the later step's graph (every row one token)
        self.num_first_graph_steps = 0  # first steps run by the first step's own graph
        self.num_mixed_first_steps = 0  # first steps with a prefill chunk, run by the runner's mixed graph

    # ---- the step functions (run eagerly or captured) -------------------------------------------------
    def _sample_and_advance(self, logits: torch.Tensor, b: int, greedy: bool) -> torch.Tensor:
        """logits: the step's forward's ([b, V]: `_forward`). Writes column step_idx of ids (and probs), then the
        next step's inputs."""
        j = self.step_idx
        if greedy:
            tok = self._greedy(logits)
        else:
            logits = self._target_logits(logits)
            md = SamplingMetadata(self.temperature[:b], self.top_p[:b], self.top_k[:b], all_greedy=False,
                                  all_random=False, no_top_p=False, no_top_k=False, generators={})
            probs = logits_to_probs(logits, md)
            if self.saguaro is not None:
                probs = draw_distribution(probs, self.saguaro, self.temperature[:b], self.guess[:b], j)
            tok = exponential_race(probs, self.noise[:b].index_select(1, j).squeeze(1))
            if self.probs is not None:
                self.probs[:b].index_copy_(1, j, probs.unsqueeze(1))
        if self.alt is not None:
            top2 = logits.topk(2, dim=-1).indices  # [b, 2] int64
            alt = torch.where(top2[:, 0] == tok, top2[:, 1], top2[:, 0])
            self.alt[:b].index_copy_(1, j, alt.unsqueeze(1))
            # A runner-up guess (column 0 only): the argmax drawn there becomes the most likely other token.
            tok = torch.where((self.guess[:b] == 2) & (j == 0), alt, tok)
        bufs = self.buffers
        args = (tok, self.ids, self.step_idx, self.num_draft, bufs.input_ids, bufs.positions, bufs.seq_lens,
                bufs.query_start_loc, bufs.logits_indices, bufs.block_tables, bufs.slot_mappings, self.block_size)
        if use_fused_kernels(tok):
            advance_draft_inputs(*args)
        else:
            advance_draft_inputs_ref(*args)
        return self.ids

    def _forward(self, step: StepInput) -> torch.Tensor:
        """The step's logits [b, V] float32 (an EAGLE-3 head's loop feeds its hidden states too, and returns its
        draft vocabulary's: eagle3_loop.py)."""
        return self.runner.execute(step)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """[b] int64 target ids: each row's argmax of the forward's logits."""
        return greedy_tokens(logits)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The forward's logits over the target's vocabulary [b, V] float32 (what q is a law over)."""
        return logits

    def _forward_first(self, step: StepInput) -> torch.Tensor:
        """The first step's logits [b, V] float32: the later steps' forward (a draft model catches up as it drafts)."""
        return self._forward(step)

    def _first_step(self, b: int, num_tokens: int, query_len: int, greedy: bool) -> torch.Tensor:
        step = self.buffers.view(b, num_tokens, query_len, self.runner.config.max_model_len, b)
        return self._sample_and_advance(self._forward_first(step), b, greedy)

    def _next_step(self, b: int, greedy: bool) -> torch.Tensor:
        step = self.buffers.view(b, b, 1, self.runner.config.max_model_len, b)
        return self._sample_and_advance(self._forward(step), b, greedy)

    # ---- graphs -----------------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture first and next step graphs for every batch bucket, greedy and sampled, largest first."""
        runner = self.runner
        if runner.config.enforce_eager or runner.device.type != "cuda":
            return
        self.batch_sizes = graph_batch_sizes(runner.config)
        self.pool = runner.graph_pool = runner.graph_pool or GraphPool()
        with no_gc_while_capturing():
            for b in reversed(self.batch_sizes):
                for greedy in (True, False):
                    for first in (True, False):
                        q = self.first_query_len if first else 1
                        if b * q > self.buffers.max_num_tokens:
                            continue  # a first step this wide runs eagerly

                        def fn(b: int = b, greedy: bool = greedy, first: bool = first, q: int = q) -> torch.Tensor:
                            # Each run rewrites the inputs, so reload the dummy batch and reset the step index.
                            self.buffers.load_dummy(b, q)
                            self.step_idx.zero_()
                            if first:
                                return self._first_step(b, b * q, q, greedy)
                            return self._next_step(b, greedy)
                        with torch.inference_mode():
                            fn()  # warm-up outside the capture stream: compiles the kernels
                        self.buffers.load_dummy(b, q)
                        graph, _ = self.pool.capture(lambda b=b, greedy=greedy, first=first, q=q: (
                            self._first_step(b, b * q, q, greedy) if first
                            else self._next_step(b, greedy)), warmup=0)
                        (self.first_graphs if first else self.next_graphs)[(b, greedy)] = graph

    def _set_row_settings(self, b: int, ks: list[int], guesses: list[int]) -> None:
        """Rows [:b] of num_draft and guess hold ks and guesses, then 0 for padding rows (no drafts, greedy): one
        copy, skipped when the last proposal left the same (successive proposals mostly share both)."""
        key = (b, tuple(ks), tuple(guesses))
        if key == self._row_settings_key:
            return
        if self._row_settings_copied is not None:
            # SYNC: only until the last upload of these rows has run (long done: a proposal's outputs are read
            # back before its settings change); the pinned rows must not be rewritten before the DMA read them.
            self._row_settings_copied.synchronize()
        rows, n = self._row_settings_np, len(ks)
        rows[0, :n] = ks
        rows[1, :n] = guesses
        rows[:, n:b] = 0
        self._row_settings.copy_(self._row_settings_host, non_blocking=True)
        if self._row_settings_copied is not None:
            self._row_settings_copied.record()
        self._row_settings_key = key

    def _mixed_key(self, chunks: list[Chunk]) -> tuple[int, int, int] | None:
        """The runner's mixed graph for a first step of these chunks (one logits row each), if one holds them. Its
        rows are the largest batch bucket, from the same config as the loop's, so they cover the loop's bucket."""
        graphs = self.runner.graphs
        key = graphs.bucket(chunks) if graphs is not None else None
        return key if key is not None and len(key) == 3 else None  # type: ignore[return-value]

    def _bucket(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, num_reqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    # ---- one proposal -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks: list[Chunk], ks: list[int], md: SamplingMetadata, seeded_gens: dict[int, torch.Generator],
            default_gen: torch.Generator, guess_first: bool = False,
            guesses: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """chunks: one per request with unseen draft tokens (each num_logits 1); ks: its draft count.
        guess_first: column 0 is each row's argmax (noise 1 makes the race an argmax) and a seeded row's own
        draws start at column 1, so its later columns get the numbers a proposal from that generator would.
        guesses: per row instead, 0 (column 0 drawn as usual), 1 (the argmax, as guess_first) or 2 (the runner-up;
        needs alternatives). After the run `alt` holds each row's runner-up tokens (when alternatives).
        Returns ids [num_reqs, max(ks)] int64 (-1 beyond a row's count) and q [num_reqs, max(ks), V] (a view
        of the static buffer, valid until the next proposal) or None when every row is greedy."""
        # A catch-up past the input buffers runs its leading tokens first; the rest, one chunk per row, fits.
        chunks = self.runner.fit_chunks(chunks)
        n = len(chunks)
        max_k = max(ks)
        guesses = guesses if guesses is not None else [1 if guess_first else 0] * n
        if any(g == 2 for g in guesses) and self.alt is None:
            raise ValueError("a runner-up guess needs a draft loop built with alternatives=True")
        if max_k > self.max_k:
            raise ValueError(f"draft length {max_k} exceeds the draft loop's {self.max_k}")
        b, graphed, greedy = self._prepare(ks, md, seeded_gens, default_gen, guesses)
        q = self.first_query_len
        first_graph = graphed and (b, greedy) in self.first_graphs and all(len(c.token_ids) <= q for c in chunks)
        # After a rejection every request catches up one token (the target's correction), not two: the step is then
        # a later step's shape, so the later step's graph runs it: rows of one token, not two padded.
        one_token = first_graph and self.one_token_first and all(len(c.token_ids) == 1 for c in chunks)
        self.step_idx.zero_()
        if one_token:
            self.buffers.load(chunks, num_reqs=b, num_tokens=b, max_query_len=1, num_logits_padded=b)
            self.next_graphs[(b, greedy)].replay()
            self.num_graph_replays += 1
            self.num_one_token_first_steps += 1
        elif first_graph:
            self.buffers.load(chunks, num_reqs=b, num_tokens=b * q, max_query_len=q, num_logits_padded=b)
            self.first_graphs[(b, greedy)].replay()
            self.num_graph_replays += 1
            self.num_first_graph_steps += 1
        else:
            mixed = self._mixed_key(chunks) if graphed else None
            if mixed is not None:
                # A prefill chunk among the rows: the runner's mixed graph runs the forward (launched eagerly, a
                # 0.6B draft's 28 layers cost ~18 ms of host time against ~1 ms on the GPU), then the sampling and
                # the next step's inputs as the eager step does. Rows past the chunks are padding in either
                # layout (no tokens, null block tables), and the advance reads and rewrites rows [:b] only.
                graphs = self.runner.graphs
                graphs.load(chunks, mixed)
                self._sample_and_advance(graphs.replay(mixed, b), b, greedy)
                self.num_mixed_first_steps += 1
            else:
                step = self.buffers.load(chunks, num_reqs=b, num_logits_padded=b)
                self._first_step(b, step.num_tokens, step.attn.common.max_query_len, greedy)
        return self._later_steps(n, max_k, b, graphed, greedy)

    def _prepare(self, ks: list[int], md: SamplingMetadata, seeded_gens: dict[int, torch.Generator],
                 default_gen: torch.Generator, guesses: list[int]) -> tuple[int, bool, bool]:
        """A proposal's rows (ks: each one's draft count) into the buffers: the batch bucket whose graphs run them
        (or the row count where none does), their draft counts, guess modes, sampling settings and noise.
        Returns (rows b the steps run, whether graphed, whether all greedy)."""
        n, max_k = len(ks), max(ks)
        guess_rows = [i for i, g in enumerate(guesses) if g]
        greedy = md.all_greedy
        b = self._bucket(n) if self.next_graphs else None
        graphed = b is not None
        b = b if graphed else n
        dev = self.runner.device
        self._set_row_settings(b, ks, guesses)
        if not greedy:
            self.temperature[:n].copy_(md.temperature)
            self.top_p[:n].copy_(md.top_p)
            self.top_k[:n].copy_(md.top_k)
            self.temperature[n:b] = 0
            self.top_p[n:b] = 1
            self.top_k[n:b] = 0
            noise = self.noise[:n, :max_k]
            noise.exponential_(generator=default_gen)
            for row, gen in seeded_gens.items():
                first = 1 if guesses[row] else 0
                noise[row, first:ks[row]].exponential_(generator=gen)
            noise.clamp_(min=torch.finfo(torch.float32).tiny)
            if len(guess_rows) == n:
                noise[:, 0] = 1.0
            elif guess_rows:
                noise[to_device(guess_rows, torch.int64, dev), 0] = 1.0
        return b, graphed, greedy

    def _later_steps(self, n: int, max_k: int, b: int, graphed: bool, greedy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1..max_k - 1 (step_idx holds 1) from the inputs in the buffers, then the proposal's ids and q
        (see run)."""
        for _ in range(1, max_k):
            if graphed:
                self.next_graphs[(b, greedy)].replay()
                self.num_graph_replays += 1
            else:
                self._next_step(b, greedy)
        ids = self.ids[:n, :max_k].clone()
        ids.masked_fill_(self._cols[None, :max_k] >= self.num_draft[:n, None], -1)
        probs = self.probs[:n, :max_k] if (self.probs is not None and not greedy) else None
        return ids, probs


def draw_distribution(q: torch.Tensor,  # [b, V] float32 processed q of one step
                      saguaro: SaguaroSampling,
                      temperature: torch.Tensor,  # [b] float32; 0: greedy row (q one-hot, left as is)
                      guess: torch.Tensor,  # [b] int64; the loop's per-row column-0 mode (0 drawn, 1 and 2 guessed)
                      step_idx: torch.Tensor,  # [1] int64; the column this step writes
                      ) -> torch.Tensor:
    """[b, V] float32: the distribution each row of a step draws its token from under Saguaro sampling: q' for drawn
    tokens; q itself for a guessed column 0, whose noise of 1 makes the race an argmax that must be q's (the guessed
    bonus token is the draft's argmax, not q''s: scaling can reorder the top)."""
    scaled = saguaro_probs(q, saguaro.top_f, saguaro.factor, greedy=temperature == 0)
    guessed = (guess != 0) & (step_idx == 0)  # [b] bool
    return torch.where(guessed[:, None], q, scaled)
