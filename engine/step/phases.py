"""A step's phases: every name its timing goes under, and how each is measured.

`StepResult.phase_seconds` maps phase names to seconds. The model sides book theirs (the in-process step, the
worker ranks, the draft-less pipeline), the Ray executor adds its transport, and EngineCore adds the scheduler's
two; the whole dict becomes `engine.last_step.phase_seconds` and the router's
`specserve_step_duration_seconds{phase}`. Every side books through the functions below, so what a name means is
written here once:

  schedule       EngineCore: building the step's plan (host wall time).
  propose        the draft's proposal. In one process on CUDA: the draft's GPU time (CUDA events around it; the
                 verify is queued behind it, so the host never waits for it); elsewhere its host wall time; 0 in a
                 step that drafts nothing. On a draft worker: its whole `draft_step`, the ids' copy to the host
                 included.
  handoff        served: the proposal's trip from draft rank 0 to a target rank (serialization and channel); only
                 where both run on one host, whose monotonic clock both read.
  prepare        the host's work on the step's path before the verify forward: building its input (not booked when
                 it was built while the draft proposed) and writing the draft ids into it.
  verify         the target's forward: its GPU time on CUDA (events, read once sampling has synced, never with a sync
                 of their own), host wall time elsewhere.
  sample         sampling or rejection sampling and the tokens' copy to the host; in one process on CUDA also the
                 part of the step's wall time no other phase covers (a wait for the draft's GPU work).
  speculation_ahead
                 in one process with speculation ahead: drafting the next window, after the verify.
  between        a worker running whole steps (a colocated draft's `spec_step`): from its last result, or this
                 plan's sending if later, to this step's start: the result's write and the plan's read through the
                 graph's channels, the worker's share of dispatch. Only where router and worker share a host.
  dispatch       the Ray executor: what the step cost beyond the phases above (plan out, result back, channels or
                 RPCs); a step submitted while the one before ran is timed from that one's result.
  commit         EngineCore: committing the result (detokenizing, stops).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch

SCHEDULE = "schedule"
PROPOSE = "propose"
HANDOFF = "handoff"
PREPARE = "prepare"
VERIFY = "verify"
SAMPLE = "sample"
SPECULATION_AHEAD = "speculation_ahead"
BETWEEN = "between"
DISPATCH = "dispatch"
COMMIT = "commit"

# The host a worker runs on: a proposal's handoff is timed only between two processes of one host.
HOST = socket.gethostname()


@dataclass
class StepStats:
    """What the last step did, for metrics."""

    num_scheduled: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    draft_length: int = 0  # the step's k (load-adaptive schedule); 0: no speculation this step
    # propose, prepare, verify, sample (the models' work and its input), handoff and dispatch (the executor's
    # transport), and the engine's own bookkeeping around them: schedule (scheduling and building the plan) and
    # commit (applying the tokens).
    phase_seconds: dict[str, float] = field(default_factory=dict)


class GpuMarks:
    """CUDA events recorded in order on the current stream, for GPU time between them. Reading them never syncs:
    callers read them once their last event has completed (`done`), after a sync the step makes anyway."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []
        self.mark()

    @staticmethod
    def start(device: torch.device) -> GpuMarks | None:
        """Marks from now on, on CUDA; None elsewhere (phases are then host wall times)."""
        return GpuMarks() if device.type == "cuda" else None

    def mark(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def done(self) -> bool:
        """Whether the last mark has run (no sync)."""
        return self.events[-1].query()

    def seconds(self, first: int = 0, last: int = -1) -> float:
        """GPU time between two marks; only once they have run."""
        return self.events[first].elapsed_time(self.events[last]) / 1e3


def forward_phases(prepare: float, forward_at: float, queued_at: float, sampled_at: float,
                   marks: GpuMarks | None) -> dict[str, float]:
    """A verify's phases. prepare: its host work before the forward; forward_at: when the forward could start on
    the device; queued_at: when the host had queued it (on CPU: run it); sampled_at: when its tokens reached the
    host (the sampler's sync); marks: around the forward alone. A step that sampled nothing did not sync, so its
    marks may not have run: it keeps the host's figure rather than add a sync."""
    verify = marks.seconds() if marks is not None and marks.done() else queued_at - forward_at
    return {PREPARE: prepare, VERIFY: verify, SAMPLE: max(0.0, sampled_at - forward_at - verify)}


def queued_forward_phases(prepare: float, wait: float, marks: GpuMarks | None) -> dict[str, float]:
    """A pipelined draft-less step's phases (engine/decode_pipeline.py). prepare: host time to build and queue it;
    wait: the host's wait for its tokens; marks: forward start, forward end, sampling end (read after that wait)."""
    if marks is None:
        return {PREPARE: prepare, VERIFY: 0.0, SAMPLE: wait}
    return {PREPARE: prepare, VERIFY: marks.seconds(0, 1), SAMPLE: marks.seconds(1, 2)}


def book_no_proposal(phases: dict[str, float]) -> None:
    """A step in one process that drafted nothing."""
    phases[PROPOSE] = 0.0


def book_local_proposal(phases: dict[str, float], marks: GpuMarks | None, host_seconds: float, wall: float) -> None:
    """The draft's proposal in the target's process. marks: around the draft's GPU work (CUDA); host_seconds: the
    host's time in it; wall: the whole step's. The verifier's sample phase waited for the draft's kernels too: on
    CUDA that wait is booked as propose, and sample keeps what the step's wall time leaves."""
    if marks is not None and marks.done():
        draft_gpu = marks.seconds()
        phases[PROPOSE] = draft_gpu
        phases[SAMPLE] = max(0.0, wall - draft_gpu - phases[PREPARE] - phases[VERIFY])
    else:
        phases[PROPOSE] = host_seconds


def book_speculation_ahead(phases: dict[str, float], seconds: float) -> None:
    phases[SPECULATION_AHEAD] = seconds


def book_remote_proposal(phases: dict[str, float], seconds: float, sent_at: float, host: str,
                         received_at: float) -> None:
    """A draft worker's proposal, read on a target worker. seconds: the draft's own time; sent_at / host: when and
    where it left (perf_counter, the host's monotonic clock); received_at: when the target's step began."""
    phases[PROPOSE] = seconds
    if host == HOST:
        phases[HANDOFF] = max(0.0, received_at - sent_at)


def book_dispatch(phases: dict[str, float], wall: float) -> None:
    """The executor's share of a step whose wall time (from its submit, or the step before's result) was `wall`."""
    phases[DISPATCH] = max(0.0, wall - sum(phases.values()))


def book_between(phases: dict[str, float], started: float, last_returned: float, sent_at: float,
                 sent_host: str) -> None:
    """A worker's time between two whole steps. started: this step's start; last_returned: when its last step
    returned (0.0: none yet); sent_at / sent_host: the plan's sending (StepPlan). Where the router waited before
    sending, the wait is its own (dispatch), not the worker's."""
    if sent_host == HOST and sent_at > 0.0:
        phases[BETWEEN] = max(0.0, started - max(last_returned, sent_at))
