"""A grid barrier on the device for persistent kernels (engine/kernels/persistent/decoder.py), and a timer stamp.

Programs of one launch meet at a counter in global memory that the wrapper zeroes before the launch: `arrive` adds 1
with release semantics once every thread of the program has issued its stores; `wait` spins on acquiring reads
until the count reaches the barrier's target (arrivals so far x programs). A wait that spins past its limit sets
the error flag and goes on rather than hang the GPU: a launch whose programs are not all resident at once (more
programs than SMs, or SMs held by other work for that long) then reports it instead of deadlocking. Between
`arrive` and `wait` a program may read what no program of the launch writes (a layer's weights): those reads
overlap the wait. Neither runs under Triton's interpreter, which executes programs one after another (the caller
launches each stage on its own there, GRID_SYNC off).
"""

from __future__ import annotations

from engine.kernels.triton_compat import tl, triton


@triton.jit
def arrive(bar_ptr, GRID_SYNC: tl.constexpr):
    """This program's arrival (release: its stores are visible to whoever sees the new count)."""
    if GRID_SYNC:
        tl.debug_barrier()  # every thread of this program has issued its stores
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def load_acquire(ptr):
    """One acquiring read of the counter (gpu scope): later reads see what the arriving programs stored."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def wait(bar_ptr, err_ptr, target, GRID_SYNC: tl.constexpr):
    """Until `target` arrivals are counted (then every arrived program's stores are visible here)."""
    if GRID_SYNC:
        # Spin on plain acquiring reads: read-modify-writes from every waiting program would queue at the counter's
        # L2 slice ahead of the arrivals they wait for. 2^22 reads: about a second, far past any stage.
        seen = load_acquire(bar_ptr)
        spins = 0
        while (seen < target) & (spins < 4194304):
            seen = load_acquire(bar_ptr)
            spins += 1
        if seen < target:
            tl.atomic_max(err_ptr, 1)
        tl.debug_barrier()


@triton.jit
def stamp(times_ptr, idx, pid, TIMING: tl.constexpr):
    """With TIMING, program 0 records the GPU's global timer (ns) at slot idx (benchmarks read where time goes)."""
    if TIMING:
        if pid == 0:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
            tl.store(times_ptr + idx, t)
