"""A target alone with its steps queued one ahead (engine/decode_pipeline.py), in process: each step goes on the
device, its open inputs filled there from the step before, before that step's tokens are read back. A draft model
pair's steps without speculation (k = 0) queue the same way.

The pipeline must not change a single token: greedy outputs equal the target alone run step by step (which equals
HF's, through the target_greedy fixture), and sampled outputs are identical token for token, seeded or not, since
every step samples with the same settings from the same generators in the same order. Requests that need their
tokens on the host within the step (logprobs, penalties) run beside queued ones in the same batches.
"""

from __future__ import annotations

import pytest
from conftest import random_prompts, start_requests
from spec_support import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS

from engine import LLM, SamplingParams
from engine.decode_pipeline import DecodePipeline, _pending_slots
from engine.step.plan import PlannedRequest, StepPlan
from engine.step.request_table import PENDING_TOKEN

pytestmark = pytest.mark.usefixtures("one_thread")

PIPELINED = dict(ENGINE_KW, async_scheduling=True)


def _pipeline(llm: LLM) -> DecodePipeline:
    pipeline = llm.engine.executor.pipeline
    assert isinstance(pipeline, DecodePipeline)
    return pipeline


def assert_kv_released(llm: LLM) -> None:
    assert llm.engine.draft_kv is None
    used = llm.engine.target_kv.num_used_blocks()
    assert all(n == 0 for n in used), f"blocks still held after generate: {used}"


def _count_steps(llm: LLM) -> list[int]:
    """Count the plans the executor is handed (a list, appended to)."""
    submitted: list[int] = []
    ex = llm.engine.executor
    submit = ex.submit

    def counting(plan: StepPlan):
        submitted.append(plan.step_id)
        return submit(plan)

    ex.submit = counting
    return submitted


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_pipelined_greedy_equals_the_target_step_by_step(tiny_models, target_greedy, family):
    llm = LLM(tiny_models[family].path, **PIPELINED)
    steps = _count_steps(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(family)
    # Really pipelined: most steps were queued while the step before had not been read back.
    assert _pipeline(llm).num_queued_ahead > len(steps) // 2, (_pipeline(llm).num_queued_ahead, len(steps))
    assert _pipeline(llm).pending is None  # the last step was collected
    assert_kv_released(llm)
    assert not llm.engine.executor.table.requests.keys() - set(llm.engine._finished_ids)


def test_pipelined_sampling_logprobs_penalties_and_stops_equal_step_by_step(tiny_models):
    """Batches mixing what may stay queued (greedy, sampled, seeded, stop tokens, max_tokens) with what runs to the
    end at once (logprobs, penalties: their steps run whole), then queued steps once those ended: every output,
    logprob and finish reason equals the step-by-step run's. The sampled requests are seeded: an unseeded row's
    numbers depend on the batch (how many rows drew before it), and asynchronous scheduling plans a request that
    stops on a token one step longer than a step-by-step run does (its extra token is dropped). That extra row
    changes a step's batch, and a CPU matrix product's rounding of one row depends on how many rows it has (a
    1-ulp difference, about 5e-7 here), so logprobs are compared to 1e-5: the same ids in the same order, values
    that a wrong row, position or step would miss by far more."""
    path = tiny_models["llama"].path
    prompts = random_prompts([3, 9, 17, 5, 6, 4], seed=21)

    def params(stop: int | None = None) -> list[SamplingParams]:
        return [
            SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[stop] if stop is not None else None),
            SamplingParams(max_tokens=7, temperature=0.7, top_k=20, seed=4, ignore_eos=True),
            # These two end early, so the steps after them stay queued.
            SamplingParams(max_tokens=6, temperature=0.9, logprobs=3, seed=6, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7,
                           ignore_eos=True),
        ]

    greedy = LLM(path, seed=7, **ENGINE_KW).generate([prompts[2]], params()[2])[0].token_ids
    stop = next(t for j, t in enumerate(greedy) if j >= 3 and t not in greedy[:j])
    runs = {}
    for name, kw in (("step by step", ENGINE_KW), ("pipelined", PIPELINED)):
        llm = LLM(path, seed=7, **kw)
        outs = llm.generate(prompts, params(stop))
        runs[name] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
        if name == "pipelined":
            assert _pipeline(llm).num_queued_ahead > 0
            assert_kv_released(llm)
    assert [r[:2] for r in runs["pipelined"]] == [r[:2] for r in runs["step by step"]]
    for got, want in zip(runs["pipelined"], runs["step by step"]):
        assert (got[2] is None) == (want[2] is None)
        for top_got, top_want in zip(got[2] or [], want[2] or [], strict=True):
            assert list(top_got) == list(top_want)
            assert top_got == pytest.approx(top_want, abs=1e-5, rel=0)
    tokens = [r[0] for r in runs["pipelined"]]
    assert tokens[2][-1] == stop and runs["pipelined"][2][1] == "stop"
    assert len(tokens[3]) == 7 and runs["pipelined"][4][2] is not None
    assert len(set(map(tuple, tokens))) == len(tokens)  # really sampled, not one repeated stream


def test_pipelined_seeded_sampling_is_batch_independent(tiny_models):
    path = tiny_models["qwen3"].path
    llm = LLM(path, **PIPELINED)
    prompts = random_prompts([5] * 6, seed=9)
    seeded = [SamplingParams(max_tokens=10, temperature=0.9, seed=s, ignore_eos=True) for s in range(6)]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, seeded, strict=True)]
    batched = llm.generate(prompts + [PROMPTS[2]], seeded + [SamplingParams(max_tokens=30, ignore_eos=True)])
    assert [o.token_ids for o in batched[:6]] == alone
    assert len(set(map(tuple, alone))) > 3


def test_pipelined_preemption_and_abort(tiny_models, target_greedy):
    path = tiny_models["llama"].path
    # 16 blocks of 4 tokens for three requests of up to 41 tokens: preemptions, their requests resumed.
    llm = LLM(path, block_size=4, max_model_len=48, num_kv_blocks=16, async_scheduling=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy("llama")
    assert_kv_released(llm)

    llm = LLM(path, **PIPELINED)
    engine = llm.engine
    reqs = start_requests(engine, PROMPTS, GREEDY, steps=4)
    assert reqs[1].inflight is not None and _pipeline(llm).pending is not None
    engine.abort_request("r1")
    n_out = reqs[1].num_output_tokens
    while engine.has_unfinished():
        engine.step()
    assert reqs[1].num_output_tokens == n_out  # the queued step's token was dropped
    ref = target_greedy("llama")
    assert reqs[0].output_token_ids == ref[0] and reqs[2].output_token_ids == ref[2]
    assert_kv_released(llm)
    assert _pipeline(llm).pending is None


def test_a_placeholder_no_queued_step_fills_is_refused():
    """Never feed PENDING_TOKEN to a model: an input holding one that no queued step will overwrite is an error."""
    entry = PlannedRequest("x", [4, PENDING_TOKEN], 0, 0, True, [[0]])
    with pytest.raises(RuntimeError, match="request x's input holds a token no queued step will give"):
        _pending_slots(StepPlan(0, [entry]), None)
    assert _pending_slots(StepPlan(0, [PlannedRequest("y", [4, 5], 0, 0, True, [[0]])]), None) == ([], [])


def test_pipelining_by_default_on_cpu_and_with_each_kind_of_draft(tiny_models, near_drafts):
    """Off by default on CPU (a queued step runs at once); asked for, on for a target alone and for a draft model,
    whose steps without speculation it queues; off where every step must run at once (speculation ahead)."""
    path = tiny_models["llama"].path
    assert LLM(path, **ENGINE_KW).engine.executor.pipeline is None
    assert LLM(path, draft_model=near_drafts["llama"].path, num_speculative_tokens=2,
               **ENGINE_KW).engine.executor.pipeline is None
    assert _pipeline(LLM(path, **PIPELINED)) is not None
    assert _pipeline(LLM(path, draft_model=near_drafts["llama"].path, num_speculative_tokens=2, **PIPELINED))
    ahead = LLM(path, draft_model=near_drafts["llama"].path, num_speculative_tokens=2, speculation_ahead=True,
                **PIPELINED)
    assert ahead.engine.executor.pipeline is None and ahead.engine.async_scheduling


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_steps_without_speculation_queue_beside_a_draft(tiny_models, near_drafts, tiny_drafts, target_greedy,
                                                        family):
    """A draft model pair whose k is 0 for runs of steps and 2 between them: the k = 0 steps queue one ahead as a
    target alone's do, while the draft sits out; the steps that speculate drain the queue, the draft catches up over
    what it missed, and greedy output stays the target's token for token."""
    draft = near_drafts["llama"].path if family == "llama" else tiny_drafts["gemma3-2l"].path
    llm = LLM(tiny_models[family].path, draft_model=draft, num_speculative_tokens=2, rejection_sampling="strict",
              **PIPELINED)
    ks = [0, 0, 0, 2, 0, 0, 2, 2]
    llm.engine.scheduler.draft_length_fn = lambda batch, it=iter(ks * 100): next(it)
    submitted = _count_steps(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(family)
    assert all(o.spec.num_drafts > 0 for o in outs)  # it did speculate between the queued runs
    pipeline = _pipeline(llm)
    assert pipeline.num_queued_ahead > len(submitted) // 4, (pipeline.num_queued_ahead, len(submitted))
    assert pipeline.pending is None and not llm.engine.executor._deferred
    assert llm.engine.draft_kv.num_used_blocks() == [0] * len(llm.engine.draft_kv.num_used_blocks())


@pytest.mark.parametrize("fail_at", [2, 3, 5])
def test_a_failed_step_loses_the_queued_one_and_the_engine_recovers(tiny_models, target_greedy, fail_at):
    """A plan lost on its way fails its submit, and the pipeline loses the step queued before it too (its tokens
    were never read back): the engine forgets every step in flight and plans explicit input, which replaces the
    placeholders in the side's table. Without that the next open input would find a placeholder no step fills."""
    from test_plan_deltas import _drive

    llm = LLM(tiny_models["llama"].path, **PIPELINED)
    assert _drive(llm, PROMPTS, fail_at=fail_at) == target_greedy("llama")
    assert _pipeline(llm).pending is None
    assert_kv_released(llm)
