"""The ids gate on CUDA: its kernel holds the stream until the host writes the ids, then writes what the torch
reference writes; it gives up after its timeout and says so; and a verify forward launched ahead through it gives
the tokens of the ordinary path (greedy: those of the target alone)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.kernels.speculation.ids_gate import IdsGate, gate_ref, pack_slots
from engine.speculation.verifier import Verifier

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=512, max_num_seqs=16,
          cuda_graph_batch_sizes=(1, 2, 4, 8, 16))


def _case(n: int, num_tokens: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150_000, (n,), generator=g)
    ids[torch.rand(n, generator=g) < 0.25] = -1
    index = torch.randperm(num_tokens, generator=g)[:n]
    index[ids < 0] = -1
    return ids.numpy(), index


@pytest.mark.parametrize("n", [1, 4, 37, 64])
def test_gate_holds_the_stream_until_the_ids_come_then_equals_the_reference(n):
    gate = IdsGate(64, torch.device("cuda"))
    # The consumer's kernel is loaded before any gate waits: CUDA loads modules lazily, and a first load while a
    # kernel of this context runs waits for it (here: for the ids the host writes only after the check below).
    torch.arange(4, device="cuda") * 3
    for step in range(3):  # the sequence number moves on: old slots never pass for new ones
        ids, index = _case(n, 300, n + step)
        input_ids = torch.randint(0, 1000, (300,), device="cuda")
        ref_in, ref_out = input_ids.cpu(), gate.ids.cpu()
        out = gate.arm(index.cuda(), input_ids)
        after = input_ids * 3  # queued behind the gate: sees the ids only if the gate wrote them first
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the stream ran on before the ids were written"
        opener = threading.Thread(target=gate.open, args=(ids,))  # as a worker's step thread would
        opener.start()
        opener.join()
        torch.cuda.synchronize()
        assert not gate.timed_out()
        assert gate_ref(torch.from_numpy(pack_slots(ids, gate.seq)), gate.seq, index, ref_in, ref_out)
        assert torch.equal(input_ids.cpu(), ref_in)
        assert torch.equal(out.cpu(), ref_out[:n])
        assert torch.equal(after.cpu(), ref_in * 3)


def test_gate_gives_up_after_its_timeout_and_writes_nothing():
    gate = IdsGate(8, torch.device("cuda"), timeout_ns=20_000_000)
    ids, index = _case(8, 20, 0)
    input_ids = torch.arange(20, device="cuda")
    gate.arm(index.cuda(), input_ids)
    t0 = time.perf_counter()
    torch.cuda.synchronize()  # returns: the kernel stopped polling by itself
    assert gate.timed_out()
    assert 0.015 < time.perf_counter() - t0 < 1.0  # after its 20 ms on the GPU's clock, not a count of polls
    assert input_ids.tolist() == list(range(20))
    gate.release()  # late ids for a kernel that is gone: harmless
    gate.timeout_ns = 5_000_000_000
    gate.arm(index.cuda(), input_ids)
    gate.open(ids)
    torch.cuda.synchronize()
    assert not gate.timed_out()  # the status word is the last step's, not a sticky flag


def test_released_gate_lets_the_stream_go_with_token_zero():
    gate = IdsGate(8, torch.device("cuda"))
    ids, index = _case(8, 20, 1)
    input_ids = torch.full((20,), 5, device="cuda")
    gate.arm(index.cuda(), input_ids)
    gate.release()
    torch.cuda.synchronize()
    assert not gate.timed_out()
    expect = torch.full((20,), 5)
    expect[index[index >= 0]] = 0
    assert torch.equal(input_ids.cpu(), expect)


def _launched_verify(monkeypatch, counter: list[int], delay_s: float, timeout_ns: int | None = None) -> None:
    """The in-process engine's verify, the way a target worker runs it with a remote draft: input built and
    forward launched first, the proposal's ids later, from the host."""
    original_init = Verifier.__init__

    def init(self, runner, seed=0):
        original_init(self, runner, seed)
        assert self.enable_gated_launch()
        if timeout_ns is not None:
            self.gate.timeout_ns = timeout_ns

    def verify(self, plan, proposal):
        if proposal is None:
            return self.run(self.prepare(plan, False), None)
        # The ids to the host first, as the draft's worker sends them: a sync after the gate was armed would wait
        # for the gate, which waits for the ids.
        remote = proposal.to_host([r.num_draft_tokens for r in plan.requests])
        inp = self.prepare(plan, True, gated_launch=True)
        counter[0] += inp.launched is not None
        time.sleep(delay_s)  # the draft's worker is still proposing
        return self.run(inp, remote, prepared_during_draft=True)

    monkeypatch.setattr(Verifier, "__init__", init)
    monkeypatch.setattr(Verifier, "verify", verify)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_launched_ahead_gives_the_ordinary_paths_tokens(tiny_models, tiny_drafts, monkeypatch, temperature):
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    prompts = random_prompts([3, 21, 9, 40, 17], seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature)
    kw = dict(model=target.path, draft_model=draft.path, num_speculative_tokens=4, device="cuda", dtype="float32",
              rejection_sampling="probabilistic", seed=3, adaptive_draft_length=False, **KW)  # the same k's each run
    ordinary = [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    if temperature == 0.0:
        alone = LLM(model=target.path, device="cuda", dtype="float32", **KW).generate(prompts, params)
        assert ordinary == [o.token_ids for o in alone]
    counter = [0]
    _launched_verify(monkeypatch, counter, delay_s=0.002)
    llm = LLM(**kw)
    launched = [o.token_ids for o in llm.generate(prompts, params)]
    assert counter[0] > 10  # decode steps went through the gate
    assert not llm.executor.verifier.gate.timed_out()
    assert launched == ordinary


def test_a_gate_that_gave_up_costs_time_not_tokens(tiny_models, tiny_drafts, monkeypatch):
    """Ids that come after the gate's timeout: every step's forward ran on placeholders, and the verifier, told
    so by the status word, runs it again with the ids. Greedy tokens stay the target's own."""
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    prompts = random_prompts([5, 30], seed=6)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = LLM(model=target.path, device="cuda", dtype="float32", **KW).generate(prompts, params)
    counter = [0]
    _launched_verify(monkeypatch, counter, delay_s=0.01, timeout_ns=1_000_000)
    llm = LLM(model=target.path, draft_model=draft.path, num_speculative_tokens=3, device="cuda", dtype="float32",
              adaptive_draft_length=False, **KW)  # a verify behind the gate every step
    out = llm.generate(prompts, params)
    assert counter[0] > 3
    assert llm.executor.verifier.gate.timed_out()  # the last step's gate gave up too
    assert [o.token_ids for o in out] == [o.token_ids for o in alone]
