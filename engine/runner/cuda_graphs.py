"""CUDA graphs of a model's forwards: uniform ones per (batch-size bucket, query-length bucket), and mixed ones per
token-count bucket.

Uniform: a step whose requests each feed q <= Q tokens and all want logits (plain decode: Q = 1; verify of k
drafts: Q = k + 1) replays the graph of the smallest captured bucket that holds it, padded: padding requests have
no query tokens, padding tokens have slot -1.

Mixed: a step with a prefill chunk beside decodes (what a server runs whenever a request arrives while others
decode) replays the graph of the smallest token bucket T that holds its tokens, captured for the largest batch
bucket R, up to T query tokens per request and R x L logits rows gathered (L = the longest uniform query, so verify
rows fit too). Every grid of the forward is sized from those host ints (padding requests' attention programs exit
at once), so one graph runs any such batch. Eager, the same step costs the host one launch per kernel: on an 8B
model about 440 launches, 15-20 ms against 7 ms of GPU work, and a served step that admits a request paid them.

Graphs are captured largest first into one memory pool, so the smaller ones reuse the largest one's memory; they
read the runner's input buffers at fixed addresses and the attention metadata is rewritten in place before a
replay. Anything else (a step larger than every bucket, a chunk wanting more than L logits rows) runs eagerly.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

from engine.runner.input_buffers import InputBuffers
from engine.runner.step_input import Chunk, StepInput

logger = logging.getLogger("specserve")


@contextlib.contextmanager
def no_gc_while_capturing() -> Iterator[None]:
    """Collect garbage once, then keep the cyclic collector off until the captures are done.

    The collector runs wherever an allocation happens to trigger it, so it can free another engine's objects (an
    LLM left to the collector: engines hold reference cycles) in the middle of a capture, and freeing CUDA memory
    (a pinned host tensor's free records an event on the stream that used it) is a call a capture in progress
    may forbid. A GPU test's draft-loop capture failed in two runs of three with "operation not permitted when
    stream is capturing", the mark of such a call (the cause is inferred, not traced); with the collector held
    off here the same test passed five runs of five."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphPool:
    """One memory pool shared by every graph of one model runner."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run fn eagerly (compiles kernels, settles allocations), then capture it; returns the graph and
        its static output."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.handle):
            out = fn()
        return graph, out


# A graph's key: (batch, query len) for a uniform graph; (batch, query len, tokens) for a mixed one.
GraphKey = tuple[int, ...]


class ForwardGraphs:
    """Graphs of one model's forwards: input buffers -> logits (of every token for a uniform graph, of the gathered
    rows for a mixed one)."""

    def __init__(self, buffers: InputBuffers, forward: Callable[[StepInput], torch.Tensor],
                 batch_sizes: list[int], query_lens: list[int], pool: GraphPool,
                 gathered: Callable[[StepInput], torch.Tensor] | None = None,
                 mixed_token_sizes: list[int] | None = None,
                 side_output: tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]] | None = None
                 ) -> None:
        """forward: logits of every token (uniform graphs); gathered: logits of the step's logits rows only
        (mixed graphs, none without it). side_output: (read, restore) of a tensor the forward leaves beside its
        logits (an EAGLE-3 head's auxiliary states of the target): read after each capture, it is that graph's
        static tensor; after a replay, restore is given a copy of the replayed graph's (the next replay rewrites
        the pool's memory, and the tensor's reader keeps slices of it across steps)."""
        self.buffers = buffers
        self.forward = forward
        self.gathered = gathered
        self.batch_sizes = sorted(batch_sizes)
        self.query_lens = sorted(set(query_lens))
        self.pool = pool
        fits = [t for t in (mixed_token_sizes or []) if t <= buffers.max_num_tokens]
        self.mixed_token_sizes = sorted(set(fits)) if gathered is not None and self.batch_sizes else []
        self.mixed_num_reqs = self.batch_sizes[-1] if self.batch_sizes else 0
        self.mixed_logits_per_req = max(self.query_lens, default=1)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.side_output = side_output
        self.side: dict[GraphKey, torch.Tensor] = {}  # each graph's static side output
        self.num_replays = 0
        self.num_mixed_replays = 0

    def capture(self) -> None:
        t0 = time.perf_counter()
        r, per_req = self.mixed_num_reqs, self.mixed_logits_per_req
        with no_gc_while_capturing():
            for t in reversed(self.mixed_token_sizes):  # the largest first: the others reuse its memory
                step = self.buffers.load_padding(r, t, t, r * per_req)
                self.graphs[(r, t, t)] = self.pool.capture(lambda step=step: self.gathered(step))  # type: ignore[misc]
                self._keep_side((r, t, t))
            for q in reversed(self.query_lens):
                for b in reversed(self.batch_sizes):
                    step = self.buffers.load_dummy(b, q)
                    self.graphs[(b, q)] = self.pool.capture(lambda step=step: self.forward(step))
                    self._keep_side((b, q))
            torch.cuda.synchronize()
        logger.info("captured %d forward graphs (batch sizes %s, query lens %s, mixed token sizes %s) in %.1f s",
                    len(self.graphs), self.batch_sizes, self.query_lens, self.mixed_token_sizes,
                    time.perf_counter() - t0)

    def _keep_side(self, key: GraphKey) -> None:
        if self.side_output is not None:
            self.side[key] = self.side_output[0]()

    def bucket(self, chunks: list[Chunk]) -> GraphKey | None:
        """The graph that can run these chunks, or None (run eagerly): a uniform one if every chunk wants logits
        of all its tokens and one fits, else a mixed one."""
        if not self.graphs:
            return None
        if all(c.num_logits == len(c.token_ids) for c in chunks):
            max_q = max(len(c.token_ids) for c in chunks)
            qi = bisect.bisect_left(self.query_lens, max_q)
            bi = bisect.bisect_left(self.batch_sizes, len(chunks))
            if qi < len(self.query_lens) and bi < len(self.batch_sizes):
                return self.batch_sizes[bi], self.query_lens[qi]
        if len(chunks) > self.mixed_num_reqs or any(c.num_logits > self.mixed_logits_per_req for c in chunks):
            return None
        ti = bisect.bisect_left(self.mixed_token_sizes, sum(len(c.token_ids) for c in chunks))
        if ti == len(self.mixed_token_sizes):
            return None
        t = self.mixed_token_sizes[ti]
        return self.mixed_num_reqs, t, t

    def load(self, chunks: list[Chunk], key: GraphKey) -> StepInput:
        """Write the chunks into the input buffers, padded to the graph `key`'s shape."""
        if len(key) == 3:
            r, q, t = key
            return self.buffers.load(chunks, num_reqs=r, num_tokens=t, max_query_len=q,
                                     num_logits_padded=r * self.mixed_logits_per_req)
        b, q = key
        return self.buffers.load(chunks, num_reqs=b, num_tokens=b * q, max_query_len=q)

    def replay(self, key: GraphKey, num_rows: int) -> torch.Tensor:
        """Replay the graph `key` on what the buffers hold: logits [num_rows, V] of the step's logits rows (a view
        of the static output, valid until the next replay of any graph of this pool)."""
        graph, out = self.graphs[key]
        graph.replay()
        if self.side_output is not None:
            self.side_output[1](self.side[key].clone())
        self.num_replays += 1
        self.num_mixed_replays += len(key) == 3
        return out[:num_rows]
