"""The ids gate's slot format and its torch reference (CPU): what the kernel reads as "this step's ids" and what
it writes. The kernel itself against this reference, and the verify forward launched ahead through it, are in
tests/gpu/test_ids_gate_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kernels.speculation import ids_gate
from engine.kernels.speculation.ids_gate import IdsGate, gate_ref, pack_slots
from engine.kernels.triton_compat import HAS_TRITON, interpreting


def _case(n: int, num_tokens: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 262_144, (n,), generator=g)
    ids[torch.rand(n, generator=g) < 0.25] = -1  # padding of shorter rows
    index = torch.randperm(num_tokens, generator=g)[:n]
    index[ids < 0] = -1  # padding has no place in the input
    return ids.numpy(), index


@pytest.mark.parametrize("seq", [1, 7, 2**31 - 1])
def test_slots_carry_the_step_and_signed_ids(seq):
    ids, index = _case(37, 100, seq % 5)
    slots = torch.from_numpy(pack_slots(ids, seq))
    assert bool(((slots >> 32) == seq).all())
    input_ids = torch.arange(100) + 1000
    ids_out = torch.full((64,), -7)
    assert gate_ref(slots, seq, index, input_ids, ids_out)
    assert ids_out[:37].tolist() == ids.tolist()  # -1 survives the round trip (sign extension)
    assert (ids_out[37:] == -7).all()
    keep = index >= 0
    assert input_ids[index[keep]].tolist() == torch.from_numpy(ids)[keep].tolist()
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[index[keep]] = False
    assert (input_ids[untouched] == torch.arange(100)[untouched] + 1000).all()


def test_a_slot_of_another_step_writes_nothing():
    ids, index = _case(8, 20, 3)
    slots = torch.from_numpy(pack_slots(ids, 5))
    slots[3] = int(pack_slots(ids[3:4], 4)[0])  # one slot still holds the previous step's value
    input_ids, ids_out = torch.arange(20), torch.full((8,), -7)
    assert not gate_ref(slots, 5, index, input_ids, ids_out)
    assert input_ids.tolist() == list(range(20)) and (ids_out == -7).all()


def test_gate_refuses_bad_use_before_touching_the_device():
    with pytest.raises(ValueError, match="capacity"):
        IdsGate(0, torch.device("cpu"))
    gate = IdsGate(4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not armed"):
        gate.open(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="cannot take 5 ids"):
        gate.arm(torch.zeros(5, dtype=torch.int64), torch.zeros(10, dtype=torch.int64))
    gate.release()  # nothing armed: nothing to do
    assert not gate.timed_out()


@pytest.mark.skipif(not HAS_TRITON or interpreting(), reason="needs triton; already under the interpreter")
def test_gate_kernel_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x", "-k",
                           "kernel_equals", "-p", "no:cacheprovider", "--noconftest"],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and " passed" in proc.stdout, f"{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"


@pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("n,stale", [(1, False), (37, False), (64, False), (9, True)])
def test_gate_kernel_equals_the_reference(n, stale):
    """The kernel on slots already written (the interpreter runs it to its end at once): this step's slots are
    written like the reference; a stale slot makes it give up after `timeout` polls (no timer here), write nothing
    and say so."""
    seq = 11
    ids, index = _case(n, 100, n)
    slots = torch.from_numpy(pack_slots(ids, seq))
    if stale:
        slots[n // 2] = int(pack_slots(ids[:1], seq - 1)[0])
    host = torch.cat([slots, torch.tensor([7])])  # the status word after the slots
    input_ids, ids_out = torch.arange(100) + 5, torch.full((64,), -9)
    ref_in, ref_out = input_ids.clone(), ids_out.clone()
    ready = gate_ref(slots, seq, index, ref_in, ref_out)
    ids_gate._gate_kernel[(1,)](host, host[n:], index, input_ids, ids_out, n, seq, 3, BLOCK=64, TIMER=False)
    assert ready is not stale
    assert int(host[n]) == int(stale)
    assert torch.equal(input_ids, ref_in) and torch.equal(ids_out, ref_out)
