"""The verify forward queued before a remote draft's ids exist (Triton kernel + typed wrapper + torch reference).

A target worker whose draft runs in another process gets the draft's ids on the host, a few milliseconds after it
built the step's input. Copying them in then, and only then launching the forward, leaves the target's GPU idle
for the copy, the index write and the launch of a graph of several hundred kernels, which the in-process engine
never pays (its forward is queued behind the draft's kernels): 0.15-0.19 ms a step for an 8B-shaped target on an H200
(`benchmarks/verify_launch.py`). Here the forward is queued while the draft works, behind one small kernel that
waits on the GPU for the ids: the host writes them into pinned memory that the kernel reads directly, and the
forward starts as soon as they land.

Each slot of the pinned buffer carries the step's sequence number in its high 32 bits and the token id (sign
extended, -1 for padding) in the low 32, so the kernel knows a slot is this step's without any ordering between
slots or a separate flag. The kernel gives up after `timeout_ns` of the GPU's global timer (5 s by default) and
records that in the buffer's status word: the host then runs the forward again the ordinary way, so a draft slower
than that costs time, never wrong tokens. (A count of polls would be no clock: how long one poll of host memory
takes depends on the machine and its bus.)

Between `arm` and `open` nothing on the host may wait for the stream (a sync would wait for the ids it has not
written yet) or launch a kernel that has never run in the process: CUDA loads modules lazily, and a first load
while a kernel of the context runs waits for that kernel. A target worker arms, replays a captured graph (loaded
at capture) and only reads the proposal's channel until it opens.

Only for a target whose GPU the draft does not share: a spinning kernel from another process would take the
draft's time slices on a shared GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.triton_compat import HAS_TRITON, interpreting, require_triton, tl, triton

if HAS_TRITON:
    from triton.language.extra.cuda import globaltimer

__all__ = ["IdsGate", "gate_ref", "pack_slots"]

# How long the kernel waits before it gives up: far beyond a draft step, short enough that a proposal that never
# comes (and is not released) does not hold the GPU for long.
DEFAULT_TIMEOUT_NS = 5_000_000_000
_SEQ_MOD = 1 << 31  # sequence numbers stay positive in the high 32 bits of an int64


@triton.jit(do_not_specialize=["n", "seq", "timeout"])
def _gate_kernel(slots_ptr, status_ptr, index_ptr, input_ids_ptr, ids_out_ptr, n, seq, timeout,
                 BLOCK: tl.constexpr, TIMER: tl.constexpr):
    # timeout: ns of the global timer (TIMER), or polls (Triton's interpreter, which has no timer)
    offs = tl.arange(0, BLOCK)
    live = offs < n
    seq64 = seq.to(tl.int64)
    v = tl.load(slots_ptr + offs, mask=live, other=0, volatile=True)
    missing = tl.sum((((v >> 32) != seq64) & live).to(tl.int32))
    waited = timeout.to(tl.int64) * 0  # an int64 tensor from the start: the loop carries it
    if TIMER:
        start = globaltimer()
    while (missing > 0) & (waited < timeout):
        v = tl.load(slots_ptr + offs, mask=live, other=0, volatile=True)
        missing = tl.sum((((v >> 32) != seq64) & live).to(tl.int32))
        if TIMER:
            waited = globaltimer() - start
        else:
            waited += 1
    if missing == 0:
        ids = (v << 32) >> 32  # the low 32 bits, sign extended
        tl.store(ids_out_ptr + offs, ids, mask=live)
        dst = tl.load(index_ptr + offs, mask=live, other=-1)
        tl.store(input_ids_ptr + dst, ids, mask=live & (dst >= 0))
        tl.store(status_ptr, 0)
    else:
        # Timed out: the placeholders stay, and the host sees it (status) and runs the forward again.
        tl.store(status_ptr, 1)


def pack_slots(ids: np.ndarray, seq: int) -> np.ndarray:
    """[n] int64 slots: seq in the high 32 bits, each id (>= -1) in the low 32."""
    return (np.int64(seq) << np.int64(32)) | (ids.astype(np.int64) & np.int64(0xFFFFFFFF))


def gate_ref(slots: torch.Tensor,  # [n] int64; packed as pack_slots does
             seq: int,  # the step's sequence number
             index: torch.Tensor,  # [n] int64; each id's flat position in input_ids, -1: none
             input_ids: torch.Tensor,  # [num_tokens] int64; written at index
             ids_out: torch.Tensor) -> bool:  # [>= n] int64; receives the ids
    """Plain-torch reference of the gate's kernel once it stops polling: if every slot holds `seq`, write the ids
    (sign-extended low 32 bits) like the kernel and return True; else write nothing and return False (the
    kernel's timeout)."""
    n = slots.shape[0]
    if not bool(((slots >> 32) == seq).all()):
        return False
    ids = (slots << 32) >> 32
    ids_out[:n] = ids
    keep = index >= 0
    input_ids.index_copy_(0, index[keep], ids[keep])
    return True


class IdsGate:
    """One gate per target worker: `arm` queues the waiting kernel (before the forward), `open` writes the ids
    from the host, `timed_out` tells after the step's sync whether the kernel gave up. Steps never overlap: the
    sampler's sync ends each one before the next is armed."""

    def __init__(self, capacity: int, device: torch.device, timeout_ns: int = DEFAULT_TIMEOUT_NS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.timeout_ns = capacity, timeout_ns
        # [capacity + 1] int64 pinned: the slots, then the status word the kernel writes (1: timed out). Pinned
        # memory is mapped into the GPU's address space (unified addressing): the kernel reads it directly.
        self._host = torch.zeros(capacity + 1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._slots = self._host.numpy()
        self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)  # [capacity] int64; the ids
        self.seq = 0  # the last armed step's sequence number (1 .. 2^31 - 1, wrapping)
        self.armed: int | None = None  # the slots an armed, unopened kernel waits for

    def arm(self, index: torch.Tensor,  # [n] int64 on the device; each id's flat position in input_ids, -1: none
            input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64; the forward's static input ids
        """Queue the kernel that waits for the next `open`, then writes the ids into input_ids at index and into
        the returned view of `self.ids` ([n] int64). Nothing waits on the host."""
        n = int(index.shape[0])
        if not 0 < n <= self.capacity:
            raise ValueError(f"a gate of {self.capacity} slots cannot take {n} ids")
        if self.armed is not None:
            raise RuntimeError("the gate is still armed: open or release it before arming it again")
        require_triton("IdsGate.arm", index, input_ids, self.ids)
        if interpreting():
            raise RuntimeError("IdsGate cannot run under Triton's interpreter: its kernel would wait for ids that "
                               "only a later call writes")
        self.seq = self.seq % (_SEQ_MOD - 1) + 1
        self._slots[self.capacity] = 0
        _gate_kernel[(1,)](self._host, self._host[self.capacity:], index, input_ids, self.ids, n, self.seq,
                           self.timeout_ns, BLOCK=max(16, triton.next_power_of_2(n)), TIMER=True, num_warps=1)
        self.armed = n
        return self.ids[:n]

    def open(self, ids: np.ndarray) -> None:
        """Hand the armed kernel its ids ([n] int, -1 padding): plain host stores, no CUDA call."""
        if self.armed is None:
            raise RuntimeError("the gate is not armed")
        if ids.shape != (self.armed,):
            raise ValueError(f"the gate was armed for {self.armed} ids, got {ids.shape}")
        self._slots[:self.armed] = pack_slots(ids, self.seq)
        self.armed = None

    def release(self) -> None:
        """Let an armed kernel go with token 0 everywhere (a step abandoned before its ids came): its forward then
        runs on valid ids, and its output is never read."""
        if self.armed is not None:
            self.open(np.zeros(self.armed, dtype=np.int64))

    def timed_out(self) -> bool:
        """Whether the last opened kernel gave up before its ids came; valid once the step's stream has synced."""
        return bool(self._slots[self.capacity])
