"""Load-adaptive speculation: the draft length (k) of a step, chosen from the step's batch size.

Speculation trades extra compute for fewer sequential steps. At batch 1 a GPU step is bound by reading the
weights, so verifying k drafts costs little more than decoding one token; as the batch grows the step becomes
compute-bound, the k + 1 verify positions of every request cost real time, and rejected drafts are pure
waste, until speculation is slower than plain decoding (vLLM reports 1.4-1.8x slowdowns at high load with a
draft model). The schedule says how far to speculate at each load:

    schedule = [(4, 4), (16, 2)]   # batches 1-4: k=4; 5-16: k=2; larger: k=2 (the last pair's k)
    disable_above_batch_size = 32  # batches above 32: no speculation at all (k=0, the draft does not run)

Written on the command line and in config files as "4:4,16:2". The batch size of a step is the number of
requests that want to run (running + waiting, at most max_num_seqs): the load, not what a shrinking KV cache
happens to admit. Tune the pairs per device and model pair with benchmarks/serve_sweep.py, which measures
throughput with and without speculation at each concurrency and prints the schedule that picks the faster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Schedule = list[tuple[int, int]]


def draft_length_for(batch_size: int, num_speculative_tokens: int, schedule: Schedule | None,
                     disable_above_batch_size: int | None) -> int:
    """k for a step of `batch_size` requests: 0 above the threshold, else the schedule's k (at most
    num_speculative_tokens); without a schedule, num_speculative_tokens."""
    if disable_above_batch_size is not None and batch_size > disable_above_batch_size:
        return 0
    if not schedule:
        return num_speculative_tokens
    for max_batch, k in schedule:
        if batch_size <= max_batch:
            return min(k, num_speculative_tokens)
    return min(schedule[-1][1], num_speculative_tokens)


def parse_schedule(value: str | Iterable | Mapping | None) -> Schedule | None:
    """A schedule from "4:4,16:2", [[4, 4], [16, 2]], {4: 4, 16: 2} or None/"none"/"" (no schedule).

    Only the form is checked here; `validate_schedule` checks the values against k.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        pairs: list = []
        for part in text.split(","):
            batch, sep, k = part.strip().partition(":")
            if not sep:
                raise ValueError(f"draft_length_schedule: {part.strip()!r} is not MAX_BATCH:K; write the schedule "
                                 "as comma-separated pairs, e.g. '4:4,16:2'")
            pairs.append((batch, k))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = [tuple(p) if isinstance(p, (list, tuple)) else p for p in value]
    out: Schedule = []
    for p in pairs:
        if not isinstance(p, tuple) or len(p) != 2:
            raise ValueError(f"draft_length_schedule: {p!r} is not a (max_batch_size, k) pair; e.g. '4:4,16:2' "
                             "or [[4, 4], [16, 2]]")
        try:
            out.append((_as_int(p[0]), _as_int(p[1])))
        except ValueError:
            raise ValueError(f"draft_length_schedule: {p!r} must hold two integers (max_batch_size, k)") from None
    return out


def _as_int(x: object) -> int:
    if isinstance(x, bool):
        raise ValueError(x)
    if isinstance(x, float) and not x.is_integer():
        raise ValueError(x)
    return int(str(x).strip()) if isinstance(x, str) else int(x)  # type: ignore[call-overload]


def validate_schedule(schedule: Schedule | None, disable_above_batch_size: int | None,
                      num_speculative_tokens: int) -> None:
    """Raise ValueError for a schedule or threshold the scheduler cannot follow."""
    d = disable_above_batch_size
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
        raise ValueError(f"spec_disable_above_batch_size must be an integer >= 0 (0: never speculate) or None "
                         f"(never disable), got {d!r}")
    if schedule is None:
        return
    if not isinstance(schedule, list) or not schedule:
        raise ValueError("draft_length_schedule must be a non-empty list of (max_batch_size, k) pairs or None; "
                         "use parse_schedule() for the '4:4,16:2' form")
    last = 0
    for pair in schedule:
        batch, k = pair
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"draft_length_schedule: max_batch_size must be an integer >= 1, got {batch!r}")
        if batch <= last:
            raise ValueError(f"draft_length_schedule: batch sizes must increase, got {format_schedule(schedule)!r}")
        if not isinstance(k, int) or not 0 <= k <= num_speculative_tokens:
            raise ValueError(f"draft_length_schedule: k must be an integer in [0, num_speculative_tokens="
                             f"{num_speculative_tokens}], got {k!r} for batches up to {batch}")
        last = batch


def format_schedule(schedule: Schedule | None) -> str:
    """The "4:4,16:2" form ("none" without a schedule)."""
    return ",".join(f"{b}:{k}" for b, k in schedule) if schedule else "none"
