"""The target's side of a step: one forward over every planned request (prefill chunks, plain decodes,
and [last token + k drafts] for speculating requests), then sampling or rejection sampling.

A step is two calls: `prepare` builds the forward's input from the plan alone, with placeholders where the drafts
go, and `run` writes the draft ids in on the device and runs it. In process they follow each other (the host
builds the input while the GPU runs the draft); a target worker prepares while the draft's worker proposes, so
that only the ids' small copy waits for the proposal. With `gated_launch` (a remote draft on GPUs of its own) the
prepared forward is even queued on the GPU before the ids exist, behind a kernel that waits for them
(engine/kernels/speculation/ids_gate.py), and `run` only writes them into pinned memory."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import to_device
from engine.kernels.speculation.ids_gate import IdsGate
from engine.kernels.triton_compat import HAS_TRITON, interpreting
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, DeviceTokens, PreparedForward
from engine.sample.logprobs import PromptTokenLogprobs, emitted_logprobs, prompt_token_logprobs
from engine.sample.sampler import Sampler
from engine.speculation.rejection_sampler import rejection_sample
from engine.step.logits_processors import needs_draft_history, needs_processing, process_target_logits
from engine.step.phases import GpuMarks, forward_phases
from engine.step.plan import PlannedRequest, StepPlan, StepResult
from engine.step.plan_sampling import TARGET_STREAM, sampling_metadata
from engine.step.proposal import DraftProposal

logger = logging.getLogger("specserve")


@dataclass
class LaunchedForward:
    """A verify forward queued on the GPU before its draft ids exist, waiting behind the gate's kernel."""

    logits: torch.Tensor  # [num_tokens, V] the graph's static output: valid once the ids came and the stream ran
    draft_ids: torch.Tensor  # [num_reqs, max_k] int64 on the device, written by the gate (-1 padding)
    positions: list[int]  # [num_reqs * max_k] each draft's flat index in the forward's input, -1 for padding
    gate_done: torch.cuda.Event  # recorded after the gate's kernel
    marks: GpuMarks  # around the forward alone, for its GPU time


@dataclass
class VerifyInput:
    """A verify step built from its plan before the draft's ids exist."""

    plan: StepPlan
    counts: list[int]  # [num_reqs] drafts verified per request: the plan's k (0 for all without a draft)
    forward: PreparedForward  # the input on the device; placeholder ids where the drafts go
    # [2, num drafts] int64 on the device, or None without drafts: row 0 the drafts' flat token indices in the
    # forward's input, row 1 their indices in the proposal's flattened [num_reqs, max_k] ids
    draft_index: torch.Tensor | None
    seconds: float  # host time spent building it
    launched: LaunchedForward | None = None  # the forward already queued, waiting for the ids (gated_launch)


class Verifier:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        # The device as tensors report it ("cuda" -> "cuda:0"), for comparing with where a proposal's ids are.
        self._device = torch.empty(0, device=runner.device).device
        self.sampler = Sampler()
        self.generator = torch.Generator(device=runner.device)
        self.generator.manual_seed(seed)
        self.gate: IdsGate | None = None  # set by enable_gated_launch
        # Told of every forward's outcome (plan, drafts verified per request, result) once it is sampled: an EAGLE-3
        # head reads the target's hidden states of the positions that stand (engine/speculation/eagle3_proposer.py).
        self.on_forward: Callable[[StepPlan, list[int], StepResult], None] | None = None
        k = runner.config.num_speculative_tokens
        # Every verify width up to k + 1: a load-adaptive draft length may pick any k per step.
        runner.capture_graphs(list(range(1, k + 2)))
        self.rejection_variants_warmed = 0
        if k and runner.buffers is not None:
            from engine.kernels.speculation import rejection as rejection_kernel

            self.rejection_variants_warmed = rejection_kernel.warm_up(runner.vocab_size, runner.device)

    def enable_gated_launch(self) -> bool:
        """Let `prepare(..., gated_launch=True)` queue graph-replayed forwards before a remote draft's ids come.
        Only where forwards replay CUDA graphs (the gate's kernel is Triton; the interpreter would wait forever);
        only for a target whose GPU no draft shares. Returns whether it is on."""
        if self.runner.graphs is None or not HAS_TRITON or interpreting():
            return False
        if self.gate is None:
            cfg = self.runner.config
            self.gate = IdsGate(cfg.max_num_seqs * max(1, cfg.num_speculative_tokens), self.runner.device)
        return True

    def verify(self, plan: StepPlan, proposal: DraftProposal | None) -> StepResult:
        return self.run(self.prepare(plan, proposal is not None), proposal)

    @torch.inference_mode()
    def prepare(self, plan: StepPlan, with_drafts: bool, gated_launch: bool = False) -> VerifyInput:
        """The step's input with a placeholder for each of the plan's drafts (with_drafts: a proposal will come;
        its counts are the plan's). gated_launch: also queue the forward behind the gate (enable_gated_launch)
        when it replays a graph; `run` then hands the gate the ids."""
        t0 = time.perf_counter()
        if self.gate is not None:
            # A step whose proposal never came (the draft failed) left its forward waiting: let it go first.
            self.gate.release()
        reqs = plan.requests
        counts = [r.num_draft_tokens for r in reqs] if with_drafts else [0] * len(reqs)
        chunks = [Chunk(r.token_ids + [0] * k if k else r.token_ids, r.start_pos, _num_logits(r, k), r.block_tables)
                  for r, k in zip(reqs, counts)]
        forward = self.runner.prepare_forward(chunks)
        if not any(counts):
            return VerifyInput(plan, counts, forward, None, time.perf_counter() - t0)
        positions = _draft_positions(plan, counts)
        if gated_launch and self.gate is not None and forward.graph_key is not None:
            launched = self._launch(positions, len(reqs), max(counts), forward)
            return VerifyInput(plan, counts, forward, None, time.perf_counter() - t0, launched)
        draft_index = self._draft_index(positions)
        return VerifyInput(plan, counts, forward, draft_index, time.perf_counter() - t0)

    def _draft_index(self, positions: list[int]) -> torch.Tensor:
        """VerifyInput.draft_index from _draft_positions: the drafts' input indices over their proposal indices."""
        src = [i for i, p in enumerate(positions) if p >= 0]
        return to_device([[positions[i] for i in src], src], torch.int64, self.runner.device)

    @torch.inference_mode()
    def run(self, inp: VerifyInput, proposal: DraftProposal | None, prepared_during_draft: bool = False) -> StepResult:
        """Write the proposal's ids into the prepared input, run the forward and sample. prepared_during_draft: the
        input was built while the draft proposed, so its time is not the step's (not booked as `prepare`)."""
        t_in = time.perf_counter()
        if inp.launched is not None:
            return self._run_launched(inp, proposal, t_in)
        counts = inp.counts
        dev = self.runner.device
        draft_ids = None  # [num_reqs, max_k] int64 on the device
        device_tokens = None
        if proposal is not None and inp.draft_index is not None:
            max_k = max(counts)
            if self.ids_on_device(proposal):
                # A draft in this process: its ids stay on the device and the forward is queued behind the
                # draft's kernels; nothing waits for the draft.
                draft_ids = proposal.draft_token_ids
            else:
                # A remote draft's ids arrive on the host: one small copy, queued without a sync.
                rows = proposal.host_rows(counts)
                if [len(row) for row in rows] != counts:
                    raise ValueError(f"the plan asks for {counts} drafts, the proposal has {[len(r) for r in rows]}")
                draft_ids = to_device([row + [-1] * (max_k - len(row)) for row in rows], torch.int64, dev)
            if draft_ids.shape[1] != max_k:
                raise ValueError(f"the plan asks for {max_k} drafts per request, the proposal has "
                                 f"{draft_ids.shape[1]}")
            index = inp.draft_index
            device_tokens = DeviceTokens(index[0], draft_ids.reshape(-1).index_select(0, index[1]))
        t0 = time.perf_counter()
        logits, marks = self._forward(inp.forward, device_tokens)  # [sum of num_logits, V]
        return self._finish(inp, proposal, draft_ids, logits, marks, t_in, t0, prepared_during_draft)

    def _forward(self, forward: PreparedForward, device_tokens: DeviceTokens | None
                 ) -> tuple[torch.Tensor, GpuMarks | None]:
        """Queue the forward: logits [sum of num_logits, V], and CUDA events around it (None off CUDA)."""
        # The forward only queues kernels; the host waits for them at the sampler's sync. CUDA events time the
        # forward on the GPU without a sync of their own, so verify is not booked as sample.
        marks = GpuMarks.start(self.runner.device)
        logits = self.runner.run_forward(forward, device_tokens)
        if marks is not None:
            marks.mark()
        return logits, marks

    def _finish(self, inp: VerifyInput, proposal: DraftProposal | None, draft_ids: torch.Tensor | None,
                logits: torch.Tensor, marks: GpuMarks | None, t_in: float, t0: float,
                prepared_during_draft: bool) -> StepResult:
        """Sample the queued forward's logits; t0: when the forward could start on the GPU."""
        t1 = time.perf_counter()
        logits, prompt_logprobs = _split_prompt_rows(inp.plan, inp.counts, logits)
        result = self._sample(inp.plan, proposal, draft_ids, inp.counts, logits)
        result.prompt_logprobs = prompt_logprobs
        # prepare: the host's work before the forward on the step's path (the input, and the draft ids into it).
        prepare = (0.0 if prepared_during_draft else inp.seconds) + t0 - t_in
        result.phase_seconds = forward_phases(prepare, t0, t1, time.perf_counter(), marks)
        result.step_id = inp.plan.step_id
        result.num_draft_tokens = list(inp.counts)
        if self.on_forward is not None:
            self.on_forward(inp.plan, inp.counts, result)
        return result

    def _launch(self, positions: list[int], num_reqs: int, max_k: int, forward: PreparedForward) -> LaunchedForward:
        """Queue the gate's kernel, then the forward behind it (graph replays only: nothing waits on the host)."""
        assert self.gate is not None and forward.graph_key is not None
        index = to_device(positions, torch.int64, self.runner.device)
        draft_ids = self.gate.arm(index, forward.step.input_ids).view(num_reqs, max_k)
        gate_done = torch.cuda.Event()
        gate_done.record()
        logits, marks = self._forward(forward, None)
        assert marks is not None
        return LaunchedForward(logits, draft_ids, positions, gate_done, marks)

    def _run_launched(self, inp: VerifyInput, proposal: DraftProposal | None, t_in: float) -> StepResult:
        """Hand the waiting forward its ids (host stores into pinned memory), then sample as `run` does."""
        launched, counts = inp.launched, inp.counts
        assert launched is not None and self.gate is not None
        try:
            if proposal is None:
                raise ValueError("this step's forward was launched for drafts, but no proposal came")
            rows = proposal.host_rows(counts)
            if [len(row) for row in rows] != counts:
                raise ValueError(f"the plan asks for {counts} drafts, the proposal has {[len(r) for r in rows]}")
        except Exception:
            self.gate.release()  # the forward must not wait for ids that will never come
            raise
        max_k = max(counts)
        flat = np.full((len(rows), max_k), -1, dtype=np.int64)
        for i, row in enumerate(rows):
            flat[i, :len(row)] = row
        self.gate.open(flat.reshape(-1))
        t0 = time.perf_counter()
        # SYNC: waits for the gate's kernel alone, which ends microseconds after the ids were written (the
        # forward runs on meanwhile): a gate that gave up must not let its forward's logits be sampled.
        launched.gate_done.synchronize()
        if not self.gate.timed_out():
            return self._finish(inp, proposal, launched.draft_ids, launched.logits, launched.marks, t_in, t0,
                                True)
        logger.warning("the verify forward's gate gave up before the draft's ids came; running it again")
        # The ordinary path on the same prepared input: the ids copied in, the forward replayed.
        ordinary = dataclasses.replace(inp, draft_index=self._draft_index(launched.positions), launched=None)
        return self.run(ordinary, proposal, prepared_during_draft=True)

    def ids_on_device(self, proposal: DraftProposal) -> bool:
        """Whether the proposal's ids are on this model's device (a draft in the same process), so the verify
        input takes them there; otherwise (a remote draft's host lists) they are copied in."""
        ids = proposal.draft_token_ids
        return isinstance(ids, torch.Tensor) and ids.device == self._device

    def _sample(self, plan: StepPlan, proposal: DraftProposal | None, draft_ids: torch.Tensor | None,
                counts: list[int], logits: torch.Tensor) -> StepResult:
        """logits: [sum of num_logits, V]; draft_ids: [num_reqs, >= max k] int64 on the device, or None."""
        dev = self.runner.device
        reqs = plan.requests
        rows = [i for i, r in enumerate(reqs) if r.sample]
        sampled: list[list[int] | None] = [None] * len(reqs)
        accepted = [0] * len(reqs)
        if not rows:
            return StepResult(sampled, accepted)
        md = sampling_metadata([reqs[i] for i in rows], TARGET_STREAM, self.generator, dev)
        if plan.rejection_sampling is None or draft_ids is None or not any(counts[i] for i in rows):
            # No drafts this step (no draft model, or a load-adaptive k of 0): plain sampling, so that
            # speculation switched off costs what no speculation costs.
            scores = logits
            if needs_processing([reqs[i] for i in rows]):  # penalties, logit_bias, masks: those requests only
                scores = process_target_logits(logits[:, None], [reqs[i] for i in rows], None)[:, 0]
            # SYNC: new tokens go to the host to be appended, detokenized and checked for stops.
            for i, t in zip(rows, self.sampler(scores, md).tolist()):
                sampled[i] = [t]
            return self._with_logprobs(StepResult(sampled, accepted), reqs, counts, logits)
        widths = [1 + counts[i] for i in rows]
        max_k = max(widths) - 1
        all_rows = len(rows) == len(reqs)
        row_index = None if all_rows else to_device(rows, torch.int64, dev)
        if all_rows and min(widths) == max_k + 1:
            # Every request verifies the same number of drafts (always so at batch 1): the logits already
            # have the padded layout.
            target_logits = logits.view(len(rows), max_k + 1, logits.shape[-1])
        else:
            # Verify logits padded to [num_rows, max_k + 1, V]; padding rows are never read.
            target_logits = logits.new_zeros(len(rows), max_k + 1, logits.shape[-1])
            row_of = [n for n, w in enumerate(widths) for _ in range(w)]
            where = to_device([row_of, [j for w in widths for j in range(w)]], torch.int64, dev)
            target_logits[where[0], where[1]] = logits
        row_ids = (draft_ids if all_rows else draft_ids.index_select(0, row_index))[:, :max_k]
        q = None
        if proposal is not None and proposal.draft_probs is not None and max_k:
            q = (proposal.draft_probs if all_rows else proposal.draft_probs.index_select(0, row_index))[:, :max_k]
        row_reqs = [reqs[i] for i in rows]
        if needs_processing(row_reqs):
            # The target's p at position j follows the history output + drafts[:j] (engine/step/logits_processors.py).
            drafts = None
            if needs_draft_history(row_reqs):
                # SYNC: the drafts go to the host for the penalties' histories; only in steps with such requests.
                drafts = [row[:w - 1] for row, w in zip(row_ids.tolist(), widths)]
            else:
                drafts = [[0] * (w - 1) for w in widths]  # only the number of positions is read
            target_logits = process_target_logits(target_logits, row_reqs, drafts)
        num_drafts = to_device([w - 1 for w in widths], torch.int64, dev)
        out = rejection_sample(row_ids, num_drafts, q, target_logits, md, plan.rejection_sampling,
                               plan.synthetic_acceptance_rate)
        # SYNC: accepted tokens go to the host to be appended, detokenized and checked for stops (one copy).
        packed = torch.cat([out.num_accepted[:, None], out.output_token_ids], dim=1).tolist()
        for row, i in zip(packed, rows):
            sampled[i] = row[1:row[0] + 2]
            accepted[i] = row[0]
        return self._with_logprobs(StepResult(sampled, accepted), reqs, counts, logits)

    @staticmethod
    def _with_logprobs(result: StepResult, reqs: list[PlannedRequest], counts: list[int],
                       logits: torch.Tensor) -> StepResult:
        """Add the logprobs of the emitted tokens for the requests that asked (nothing to do, and no cost, for a
        step where none did). logits: [sum of num_logits, V], 1 + k rows per sampling request."""
        want = [i for i, r in enumerate(reqs) if r.logprobs is not None and result.sampled[i] is not None]
        if not want:
            return result
        starts, offset = {}, 0
        for i, r in enumerate(reqs):
            if r.sample:
                starts[i] = offset
                offset += 1 + counts[i]
        tokens = [result.sampled[i] or [] for i in want]
        rows = [[starts[i] + j for j in range(len(t))] for i, t in zip(want, tokens)]
        per_req = emitted_logprobs(logits, rows, tokens, [reqs[i].logprobs or 0 for i in want])
        result.logprobs = [None] * len(reqs)
        for i, lp in zip(want, per_req):
            result.logprobs[i] = lp
        return result


def _num_logits(r: PlannedRequest, k: int) -> int:
    """Logit rows of a request's chunk: every position's while it wants its prompt's logprobs (prefill chunks have
    no drafts), else 1 + k where it samples."""
    if r.prompt_targets and not k:
        return len(r.token_ids or ())
    return 1 + k if r.sample else 0


def _split_prompt_rows(plan: StepPlan, counts: list[int], logits: torch.Tensor
                       ) -> tuple[torch.Tensor, list[list[PromptTokenLogprobs] | None] | None]:
    """The sampling rows of `logits` (1 + k per sampling request, in order, as `_sample` reads them) and, per
    request, the logprobs of its prompt_targets. A step without prompt targets returns its logits as they are."""
    reqs = plan.requests
    if not any(r.prompt_targets and not k for r, k in zip(reqs, counts)):
        return logits, None
    keep: list[int] = []
    rows: list[list[int]] = []
    offset = 0
    for r, k in zip(reqs, counts):
        n = _num_logits(r, k)
        rows.append(list(range(offset, offset + len(r.prompt_targets))) if r.prompt_targets and not k else [])
        if r.sample:
            keep.extend(range(offset + n - 1 - k, offset + n))
        offset += n
    want = [i for i, rr in enumerate(rows) if rr]
    per_req = prompt_token_logprobs(logits, [rows[i] for i in want], [reqs[i].prompt_targets or [] for i in want],
                                    [reqs[i].prompt_logprobs or 0 for i in want])
    out: list[list[PromptTokenLogprobs] | None] = [None] * len(reqs)
    for i, lp in zip(want, per_req):
        out[i] = lp
    return logits.index_select(0, to_device(keep, torch.int64, logits.device)), out


def _draft_positions(plan: StepPlan, counts: list[int]) -> list[int]:
    """[num_reqs * max_k] each draft's flat index in the forward's input (its request's placeholders follow the
    request's tokens), -1 where a request has fewer than max_k drafts."""
    max_k = max(counts)
    positions: list[int] = []
    offset = 0
    for r, k in zip(plan.requests, counts):
        start = offset + len(r.token_ids)
        positions.extend(list(range(start, start + k)) + [-1] * (max_k - k))
        offset = start + k
    return positions
