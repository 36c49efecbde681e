"""Speculation ahead in process (engine/speculation/ahead/proposer.py): the draft drafts the next window after each
proposal, the next step proposes it on a hit. Everything a user sees must be what plain speculation gives: greedy
tokens equal to the target alone, seeded sampled tokens equal to a run without drafting ahead (so a hit uses the
probabilities of the forward that drafted its tokens: a stale q changes them, which the negative control shows),
the target's distribution (chi-square), and stops, max_tokens, aborts and preemptions inside a window drafted ahead
exact, with every block and cache entry released. tests/test_ray_executor.py runs it across processes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import random_prompts, start_requests
from spec_support import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS, assert_kv_released
from test_async_scheduling import _draft, stops_and_max_tokens_inside
from test_spec_distribution import (
    DIST_PROMPT,
    DIST_SAMPLES,
    assert_first_three_follow_target,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)

from engine import LLM, SamplingParams
from engine.speculation.ahead.proposer import AheadProposer

pytestmark = pytest.mark.usefixtures("one_thread")

# A fixed k (the draft length rule off): windows drafted ahead for k hit, and are counted, at that k.
AHEAD = dict(ENGINE_KW, speculation_ahead=True, adaptive_draft_length=False)


def _ahead(llm: LLM) -> AheadProposer:
    ahead = llm.engine.executor.ahead
    assert ahead is not None
    return ahead


def _assert_released(llm: LLM) -> None:
    """No request left, every block back, and the cache holds nothing but entries of requests the next plan's
    finished ids will drop (as the request table)."""
    engine = llm.engine
    assert not engine.has_unfinished()
    assert_kv_released(llm)
    gone = set(engine._finished_ids)
    assert engine.executor.table.requests.keys() <= gone
    assert _ahead(llm).cache.entries.keys() <= gone


def _kv_at(llm: LLM, tables: list[list[int]], positions: list[int]) -> list[torch.Tensor]:
    """Per draft KV-cache group, K and V of every layer at these positions of a request: [layers, 2, n, heads, dim]."""
    runner = llm.engine.executor.draft
    bs = runner.config.block_size
    out = []
    for g, tensors in enumerate(runner.kv_caches):
        blocks = torch.tensor([tables[g][p // bs] for p in positions])
        offsets = torch.tensor([p % bs for p in positions])
        out.append(torch.stack([t[:, blocks, offsets] for t in tensors]).clone())
    return out


def _exact_at_max_model_len(path: str, draft: str, **ahead: object) -> LLM:
    """Long greedy requests against max_model_len=13 with k = 2 and speculation ahead (`ahead`): the outputs equal the
    target alone's. Returns the engine, for its counters."""
    prompts = random_prompts([9, 7], seed=5)
    kw = dict(block_size=4, max_model_len=13)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = LLM(path, **kw).generate(prompts, params)
    llm = LLM(path, draft_model=draft, num_speculative_tokens=2, speculation_ahead=True, adaptive_draft_length=False,
              **ahead, **kw)  # a fixed k: the callers count hits
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    return llm


def _abort_after_four_steps(llm: LLM, target_greedy: Callable[[str], list[list[int]]],
                            drafted: Callable[[list], None] = lambda entries: None) -> None:
    """Greedy PROMPTS; after four steps request r1 has drafted ahead, and `drafted` checks its cache entries; then r1
    is aborted: the next plan names it finished, so its entries are never proposed, and dropped; the others still
    equal the target alone."""
    engine, ahead = llm.engine, _ahead(llm)
    reqs = start_requests(engine, PROMPTS, GREEDY, steps=4)
    assert "r1" in ahead.cache.entries
    drafted(ahead.cache.entries["r1"])
    engine.abort_request("r1")
    engine.step()  # the next plan names it finished: its entries are not proposed, and dropped
    assert "r1" not in ahead.cache.entries
    while engine.has_unfinished():
        engine.step()
    ref = target_greedy("llama")
    assert reqs[0].output_token_ids == ref[0] and reqs[2].output_token_ids == ref[2]


@pytest.mark.parametrize("target,draft,k,mode,async_", [
    ("llama", "near", 3, "probabilistic", False), ("qwen3", "near", 5, "strict", True),
    ("gemma3", "gemma3-2l", 3, "probabilistic", True), ("gemma3", "near", 4, "strict", False),
    ("mistral", "near", 2, "probabilistic", True),
])
def test_ahead_greedy_is_lossless(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, mode,
                                  async_):
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, rejection_sampling=mode, async_scheduling=async_, **AHEAD)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy(target)
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)
    lookups, hits, drafted, unused, skipped, *_ = _ahead(llm).stats.as_tuple()
    assert lookups > 0 and drafted > 0 and unused <= drafted
    assert skipped == 0  # one window a request, and the draft loop has a row for each
    if draft == "near":  # the near drafts agree with the target often enough for whole windows to hit
        assert hits > 0, (lookups, hits)
    assert llm.engine.speculation_ahead_stats() == _ahead(llm).stats.as_tuple()
    _assert_released(llm)


def test_ahead_identical_draft_hits_every_window(tiny_models, target_greedy):
    # A draft identical to the target accepts everything and guesses every bonus token (greedy): after each
    # request's first proposal, every proposal comes from the cache, and no draft token drafted ahead is wasted
    # except the windows drafted for the last step.
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, **AHEAD)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == target_greedy("llama")
    lookups, hits, drafted, unused, *_ = _ahead(llm).stats.as_tuple()
    assert hits >= lookups - 2 * len(PROMPTS), (lookups, hits)
    assert unused <= 3 * len(PROMPTS)


SEEDED_PROMPTS = random_prompts([5] * 6, seed=9)
SEEDED = [SamplingParams(max_tokens=24, temperature=0.5, seed=s, ignore_eos=True) for s in range(6)]


@pytest.fixture(scope="module")
def seeded_plain(tiny_models) -> list[list[int]]:
    """Seeded sampled outputs of plain speculation with the target as its own draft (k=3): at this temperature its
    guess of the bonus token is often right, so most windows drafted ahead hit."""
    path = tiny_models["llama"].path
    outs = LLM(path, draft_model=path, num_speculative_tokens=3, **ENGINE_KW).generate(SEEDED_PROMPTS, SEEDED)
    ref = [o.token_ids for o in outs]
    assert len(set(map(tuple, ref))) > 3  # really sampled
    return ref


def test_ahead_seeded_sampling_equals_plain_speculation(tiny_models, seeded_plain):
    # A hit's drafts were drawn with the noise the next proposal would have drawn (a seeded request's generator
    # is seeded by output position) from the same distribution, and verified with their own q: seeded outputs
    # equal a run that drafts nothing ahead, token for token.
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, **AHEAD)
    assert [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)] == seeded_plain
    assert _ahead(llm).stats.hits > 5


def test_ahead_stale_probabilities_are_caught(tiny_models, seeded_plain):
    # Negative control of the test above: a cache that hands the verify a q that is not its tokens' own (here
    # each window's q is the one drafted for the position before, as a static buffer overwritten by the next
    # proposal would give) changes probabilistic acceptance, and the seeded outputs no longer match.
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, **AHEAD)
    ahead = _ahead(llm)
    speculate_ahead = ahead.speculate_ahead

    def stale_speculate_ahead(plan, proposal):
        n = speculate_ahead(plan, proposal)
        for entries in ahead.cache.entries.values():
            for e in entries:
                if e.probs is not None:
                    e.probs = torch.roll(e.probs, 1, dims=0)
        return n

    ahead.speculate_ahead = stale_speculate_ahead
    outs = [o.token_ids for o in llm.generate(SEEDED_PROMPTS, SEEDED)]
    assert ahead.stats.hits > 5
    assert outs != seeded_plain


@pytest.mark.parametrize("mode,async_", [("probabilistic", False), ("strict", True), ("probabilistic", True)])
def test_ahead_sampling_follows_target_distribution(small_vocab_pair, mode, async_):  # noqa: F811
    # k = 1 with a one-token prompt: the first step drafts token 1 and verifies it (bonus: token 2), so the
    # window drafted ahead proposes token 3, inside the three tokens whose joint law is enumerated.
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=1, rejection_sampling=mode, seed=4321,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES, max_num_batched_tokens=3 * DIST_SAMPLES,
              async_scheduling=async_, speculation_ahead=True, adaptive_draft_length=False)
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    # Strict acceptance needs the draft's own sample to equal the target's, so fewer windows hit.
    assert _ahead(llm).stats.hits > DIST_SAMPLES // (10 if mode == "probabilistic" else 50)
    assert_first_three_follow_target(outs, target_hf, draft_hf)


@pytest.mark.parametrize("async_", [False, True])
def test_ahead_stop_token_and_max_tokens_inside_a_window(tiny_models, target_greedy, async_):
    # With a draft identical to the target every window drafted ahead hits, so stops and max_tokens land inside
    # proposals that came from the cache: the tokens after them must be dropped and everything released.
    path = tiny_models["llama"].path
    ref = target_greedy("llama")
    llm = LLM(path, draft_model=path, num_speculative_tokens=4, async_scheduling=async_, **AHEAD)
    stops_and_max_tokens_inside(llm, ref, past=5, max_tokens=9)
    assert _ahead(llm).stats.hits > 0
    _assert_released(llm)


def test_ahead_max_model_len(tiny_models):
    # The window ahead never reaches past max_model_len (its KV is not allocated there).
    path = tiny_models["llama"].path
    llm = _exact_at_max_model_len(path, path)
    assert _ahead(llm).stats.hits > 0
    _assert_released(llm)


@pytest.mark.parametrize("target,draft,k,async_", [("llama", "near", 3, False), ("gemma3", "gemma3-2l", 4, True)])
def test_ahead_preemption(tiny_models, tiny_drafts, near_drafts, target_greedy, target, draft, k, async_):
    # 16 blocks per model force preemptions: a preempted request resumes with explicit input from position 0, so
    # its window drafted ahead misses and is dropped.
    llm = LLM(tiny_models[target].path, draft_model=_draft(tiny_drafts, near_drafts, target, draft),
              num_speculative_tokens=k, block_size=4, max_model_len=48, num_kv_blocks=16, async_scheduling=async_,
              speculation_ahead=True)
    outs = llm.generate(PROMPTS, GREEDY)
    assert any(o.num_preemptions > 0 for o in outs)
    assert [o.token_ids for o in outs] == target_greedy(target)
    _assert_released(llm)


def test_ahead_abort_drops_the_window(tiny_models, target_greedy):
    path = tiny_models["llama"].path
    llm = LLM(path, draft_model=path, num_speculative_tokens=3, async_scheduling=True, **AHEAD)
    _abort_after_four_steps(llm, target_greedy)
    _assert_released(llm)


def test_synthetic_bonus_agreement(tiny_models, tiny_drafts):
    # Benchmark setting: random weights never agree on a bonus token, so without it nothing hits; with rate 1 and
    # every draft accepted, every lookup after a request's first proposal hits.
    path, draft = tiny_models["llama"].path, tiny_drafts["llama-1l"].path
    kw = dict(num_speculative_tokens=3, rejection_sampling="synthetic", synthetic_acceptance_rate=1.0, **AHEAD)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    none = LLM(path, draft_model=draft, **kw)
    none.generate(PROMPTS, params)
    assert _ahead(none).stats.hits <= 1
    full = LLM(path, draft_model=draft, synthetic_bonus_agreement=1.0, **kw)
    full.generate(PROMPTS, params)
    lookups, hits, *_ = _ahead(full).stats.as_tuple()
    assert hits >= lookups - 2 * len(PROMPTS) and hits > 0
    with pytest.raises(ValueError, match="synthetic_bonus_agreement"):
        LLM(path, draft_model=draft, num_speculative_tokens=3, synthetic_bonus_agreement=0.5, **AHEAD)
    with pytest.raises(ValueError, match="synthetic_bonus_agreement"):
        LLM(path, draft_model=draft, synthetic_bonus_agreement=1.5, **kw)
    with pytest.raises(ValueError, match="speculation_ahead"):
        LLM(path, draft_model=draft, num_speculative_tokens=3, speculation_ahead="yes")


def test_ahead_off_by_default_in_process(tiny_models, near_drafts):
    llm = LLM(tiny_models["llama"].path, draft_model=near_drafts["llama"].path, **ENGINE_KW)
    assert llm.engine.executor.ahead is None and not llm.engine.scheduler.speculation_ahead
