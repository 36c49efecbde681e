"""How often the interpreter switches threads in the processes on the step path: the model workers and the router.

Each has a thread that runs the steps and gives up the interpreter lock at every wait (for the GPU, for a
compiled-graph channel), and other threads that want it meanwhile: Ray's own in a worker, the event loop that
streams tokens and serves scrapes in the router. When the wait ends, the step's thread asks for the lock back and
may have to wait up to the switch interval for it: Python's own is 5 ms, as long as a whole 8B decode step.
"""

from __future__ import annotations

import os
import sys

DEFAULT_GIL_SWITCH_INTERVAL_S = 0.0002


def set_gil_switch_interval() -> None:
    """Shorten this process's thread switch interval (SPECSERVE_GIL_SWITCH_INTERVAL_S, default 200 us). On 2 H200s,
    with the draft on another GPU, setting it in the model workers took the target's mean `sample` phase from 3.1 to
    0.15 ms and c=1 tokens/s from 229 to 264 at the same TPOT (an A/B in one call); the target alone measured +7.4%
    over the in-process engine in one run with it, against +6.1% to +18.6% before (benchmarks/RESULTS.md)."""
    sys.setswitchinterval(float(os.environ.get("SPECSERVE_GIL_SWITCH_INTERVAL_S", DEFAULT_GIL_SWITCH_INTERVAL_S)))
