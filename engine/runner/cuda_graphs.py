"""CUDA graphs of a model's decode and verify forwards, one per (batch-size bucket, query-length bucket).

A step whose requests each feed q <= Q tokens and all want logits (plain decode: Q = 1; verify of k drafts:
Q = k + 1) replays the graph of the smallest captured bucket that holds it, padded: padding requests have
no query tokens, padding tokens have slot -1. Graphs are captured largest first into one memory pool, so
the smaller ones reuse the largest one's memory; they read the runner's input buffers at fixed addresses
and the attention metadata is rewritten in place before a replay. Anything else runs eagerly.
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


class ForwardGraphs:
    """Decode/verify graphs of one model: input buffers -> logits of every token."""

    def __init__(self, buffers: InputBuffers, forward: Callable[[StepInput], torch.Tensor],
                 batch_sizes: list[int], query_lens: list[int], pool: GraphPool) -> None:
        self.buffers = buffers
        self.forward = forward
        self.batch_sizes = sorted(batch_sizes)
        self.query_lens = sorted(set(query_lens))
        self.pool = pool
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def capture(self) -> None:
        t0 = time.perf_counter()
        with no_gc_while_capturing():
            for q in reversed(self.query_lens):
                for b in reversed(self.batch_sizes):
                    step = self.buffers.load_dummy(b, q)
                    self.graphs[(b, q)] = self.pool.capture(lambda step=step: self.forward(step))
            torch.cuda.synchronize()
        logger.info("captured %d forward graphs (batch sizes %s, query lens %s) in %.1f s", len(self.graphs),
                    self.batch_sizes, self.query_lens, time.perf_counter() - t0)

    def bucket(self, chunks: list[Chunk]) -> tuple[int, int] | None:
        """The (batch, query len) graph that can run these chunks, or None (run eagerly)."""
        if not self.graphs or any(c.num_logits != len(c.token_ids) for c in chunks):
            return None
        max_q = max(len(c.token_ids) for c in chunks)
        qi = bisect.bisect_left(self.query_lens, max_q)
        bi = bisect.bisect_left(self.batch_sizes, len(chunks))
        if qi == len(self.query_lens) or bi == len(self.batch_sizes):
            return None
        return self.batch_sizes[bi], self.query_lens[qi]

    def load(self, chunks: list[Chunk], key: tuple[int, int]) -> StepInput:
        """Write the chunks into the input buffers, padded to the graph `key`'s shape."""
        b, q = key
        return self.buffers.load(chunks, num_reqs=b, num_tokens=b * q, max_query_len=q)

    def replay(self, key: tuple[int, int], num_tokens: int) -> torch.Tensor:
        """Replay the graph `key` on what the buffers hold: logits [num_tokens, V] of the real tokens (a view of
        the static output, valid until the next replay of any graph of this pool)."""
        graph, out = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return out[:num_tokens]
