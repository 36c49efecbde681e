"""The draft length rule (engine/speculation/draft_length_rule.py) in the engine: greedy output equal to the target
alone while k changes every step, through k = 0 periods (the draft catches up), synchronous and asynchronous, with
prefix caching; the output distribution at temperature 1 with k changing (chi-square, the pattern of
test_spec_distribution). The rule alone on a simulated clock: tests/test_draft_length_rule.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from spec_support import ENGINE_KW, NEW_TOKENS, PROMPTS, Step
from test_spec_distribution import (
    DIST_PROMPT,
    DIST_SAMPLES,
    assert_first_three_follow_target,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)

from engine import LLM, SamplingParams
from engine.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")


# k of successive steps: every value, changes every step, and runs of k = 0 the draft must catch up after.
K_CYCLE = [3, 0, 0, 0, 2, 1, 0, 3, 3, 0, 0, 1]


def _cycling(llm: LLM, cycle: list[int]) -> list[int]:
    """Make the rule's choice follow `cycle`; returns the list the chosen k's are appended to."""
    rule = llm.engine.draft_rule
    assert rule is not None  # on by default
    chosen: list[int] = []
    it = itertools.cycle(cycle)
    choose = rule.choose

    def forced(batch_size: int) -> int:
        choose(batch_size)  # the rule still books the step
        k = rule.pin(next(it))
        chosen.append(k)
        return k

    rule.choose = forced
    llm.engine.scheduler.draft_length_fn = forced
    return chosen


def record_commits(llm: LLM) -> list[Step]:
    """Every sampled request of every step `llm` commits from now on, with the k its verify took (an open entry's
    from the result: asynchronous steps leave it to the sides)."""
    steps: list[Step] = []
    engine = llm.engine
    commit = engine.commit

    def recording_commit(scheduled, result):
        for n, (s, tokens, accepted) in enumerate(zip(scheduled, result.sampled, result.num_accepted)):
            k = result.num_draft_tokens[n] if result.num_draft_tokens is not None else s.num_draft_tokens
            if tokens is not None:
                r = s.request
                steps.append(Step(r.request_id, r.num_output_tokens, r.num_tokens, k, accepted))
        return commit(scheduled, result)

    engine.commit = recording_commit
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("target,draft", [("llama", "near"), ("gemma3", "gemma3-2l")])
def test_greedy_stays_the_targets_while_k_changes_every_step(tiny_models, tiny_drafts, near_drafts, target_greedy,
                                                              target, draft, async_scheduling):
    draft_path = near_drafts[target].path if draft == "near" else tiny_drafts[draft].path
    llm = LLM(tiny_models[target].path, draft_model=draft_path, num_speculative_tokens=3,
              rejection_sampling="strict", enable_prefix_caching=True, async_scheduling=async_scheduling,
              **ENGINE_KW)
    chosen = _cycling(llm, K_CYCLE)
    steps = record_commits(llm)
    expected = target_greedy(target)
    # Two requests share a prompt: the second's prefix comes from the cache, the draft's included.
    outs = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[2]],
                        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [expected[2], expected[0], expected[2]]
    assert set(chosen) == set(K_CYCLE)
    drafted = {s.num_draft_tokens for s in steps}
    assert {0, 1, 2, 3} <= drafted, drafted  # verifies of every k, and plain decodes between them
    assert all(o.spec.num_drafts > 0 for o in outs)
    if async_scheduling:  # runs of k = 0 steps queued one ahead, as the target alone's do
        assert llm.engine.executor.pipeline.num_queued_ahead > 0
    kv = llm.engine
    assert kv.draft_kv.num_used_blocks() == [0] * len(kv.draft_kv.num_used_blocks())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_no_request_drafts_in_is_booked_at_k_zero(tiny_models, near_drafts, async_scheduling):
    """k = 3 every step: a request's last step, one token from max_tokens, drafts nothing (its k shrinks to 0), so
    the draft sits it out; the rule is told, and books that step as k = 0 (not as a k = 3 step with a catch-up)."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=3,
              rejection_sampling="strict", async_scheduling=async_scheduling, **ENGINE_KW)
    _cycling(llm, [3])
    rule = llm.engine.draft_rule
    booked: list[tuple[int, bool]] = []
    observe = rule.observe

    def recording(step_id, verifies, propose_seconds, drafted=True):
        p = rule._planned.get(step_id)
        observe(step_id, verifies, propose_seconds, drafted)
        if p is not None:
            booked.append((p.k, drafted))

    rule.observe = recording
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert booked[-1] == (0, False), booked  # the last step: no request drafted, booked at k = 0
    assert any(k == 3 and drafted for k, drafted in booked)


def test_draft_catches_up_after_k_zero_without_recomputing_its_cache(tiny_models, near_drafts):
    """After steps at k = 0 the draft's first forward is one chunk of what it missed; with a prefix hit it starts
    from its cached blocks, not from the prompt's start."""
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, num_speculative_tokens=2,
              rejection_sampling="strict", enable_prefix_caching=True, **ENGINE_KW)
    engine = llm.engine
    prompt = PROMPTS[2] + PROMPTS[1][:3]  # 20 tokens: four full blocks to cache
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # both models cache its blocks
    ks = iter([0] * 6 + [2] * 100)
    engine.scheduler.draft_length_fn = lambda batch: next(ks)
    forwards = []
    runner = engine.executor.draft
    forward = runner.forward_chunks
    runner.forward_chunks = lambda chunks: forwards.append(sum(len(c.token_ids) for c in chunks)) or forward(chunks)
    a = Request("a", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request(a)
    for _ in range(6):
        engine.step()
        assert engine.last_step.draft_length == 0
    assert forwards == [] and a.num_draft_computed_tokens == 16  # the draft only took its cached prefix
    seen = a.num_tokens - 1
    engine.step()
    assert engine.last_step.draft_length == 2
    assert forwards[0] == seen + 1 - 16  # one chunk: what it missed after its cache, and the last token
    while engine.has_unfinished():
        engine.step()


def test_rule_off_and_static_schedule_override(tiny_models, near_drafts):
    path, draft = tiny_models["llama"].path, near_drafts["llama"].path
    assert LLM(path, draft_model=draft, **ENGINE_KW).engine.draft_rule is not None
    assert LLM(path, draft_model=draft, adaptive_draft_length=False, **ENGINE_KW).engine.draft_rule is None
    assert LLM(path, draft_model=draft, spec_disable_above_batch_size=8, **ENGINE_KW).engine.draft_rule is None
    assert LLM(path, draft_model=draft, draft_length_schedule="4:2", **ENGINE_KW).engine.draft_rule is None
    with pytest.raises(ValueError, match="adaptive_draft_length must be true or false"):
        LLM(path, draft_model=draft, adaptive_draft_length="sometimes", **ENGINE_KW)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampling_follows_target_while_k_changes(small_vocab_pair, async_scheduling):  # noqa: F811
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    # Waves of requests start at different points of the cycle, so each of the first three tokens comes from
    # verifies of every k and from plain decodes.
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=2, rejection_sampling="probabilistic",
              seed=77, block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES // 7,
              max_num_batched_tokens=3 * DIST_SAMPLES, async_scheduling=async_scheduling)
    chosen = _cycling(llm, [2, 0, 1, 1, 2, 0, 2])
    steps = record_commits(llm)
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in outs)
    assert {0, 1, 2} <= set(chosen)
    first = {s.num_draft_tokens for s in steps if s.num_output_before == 0}
    assert {0, 1, 2} <= first, first  # the first token came from every k
    assert_first_three_follow_target(outs, target_hf, draft_hf)
    torch.manual_seed(0)
