"""The draft's LM head restricted to a token map (EngineConfig.draft_token_map,
engine/runner/draft_vocabulary.py): its
logits are the full head's inside the map and a masked constant outside, the draft never proposes a token outside
the map, greedy output stays the target's alone (in process, asynchronous with speculation ahead, on Ray workers), the
sampled law stays the target's (chi-square against enumeration), and every bad map is refused naming the field."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, local_ray
from spec_support import ENGINE_KW, GREEDY, PROMPTS, chi_square_p_value
from test_spec_distribution import (
    DIST_PROMPT,
    DIST_SAMPLES,
    SMALL_VOCAB,
    exact_joint,
    small_vocab_pair,  # noqa: F401 - the distribution test's fixture
)

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.runner.draft_vocabulary import MASKED_LOGIT, check_token_map, load_token_map
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk

pytestmark = pytest.mark.usefixtures("one_thread")


def write_map(path: Path, ids: list[int] | torch.Tensor) -> str:
    """A token map file: .pt for a tensor (torch.save), .json for a list."""
    if isinstance(ids, torch.Tensor):
        torch.save(ids, path)
    else:
        path.write_text(json.dumps(ids))
    return str(path)


def random_map(n: int, seed: int, exclude: set[int] = frozenset()) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(VOCAB, generator=g).tolist() if i not in exclude][:n]


def draft_logits(path: str, token_map: str | None) -> torch.Tensor:
    cfg = EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=64, block_size=4,
                       num_kv_blocks=32, max_num_seqs=2)
    mc = ModelConfig.from_path(path)
    mc.max_model_len = 64
    runner = ModelRunner(mc, cfg, "draft", draft_token_map=token_map)
    groups = len(runner.kv_groups)  # the Gemma 3 draft has two (sliding and full layers)
    chunks = [Chunk([5, 9, 17, 33, 2], 0, 3, [[1, 2]] * groups), Chunk([7, 7, 100], 0, 2, [[3]] * groups)]
    return runner.forward_chunks(chunks)


@pytest.mark.parametrize("draft", ["llama-1l", "gemma3-2l"])
@pytest.mark.parametrize("kind", ["prefix", "random"])
def test_restricted_head_logits(tiny_drafts, tmp_path, draft, kind):
    """Inside the map the logits are the whole head's, to the bit (Gemma 3's soft-capping applied to the map's
    tokens as to the whole row); outside they are MASKED_LOGIT; a prefix map (a view of the head) and any other map
    (the map's own rows) give the same."""
    ids = list(range(50)) if kind == "prefix" else random_map(50, seed=3)
    full = draft_logits(tiny_drafts[draft].path, None)
    part = draft_logits(tiny_drafts[draft].path, write_map(tmp_path / "map.json", ids))
    assert part.shape == full.shape == (5, VOCAB)
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[ids] = True
    assert torch.equal(part[:, inside], full[:, inside])
    assert bool((part[:, ~inside] == MASKED_LOGIT).all())
    probs = torch.softmax(part, dim=-1)
    assert bool((probs[:, ~inside] == 0).all())  # exp underflows to exactly 0: q never proposes them


def test_a_row_whose_map_tokens_are_all_disallowed_still_has_a_distribution():
    """A grammar may allow only tokens outside the map: masking the map's tokens to -inf (as its bitmask does)
    leaves the masked constant, so the row still softmaxes to a distribution, over the allowed tokens."""
    logits = torch.full((1, 8), MASKED_LOGIT)
    logits[0, :3] = torch.tensor([1.0, 2.0, 3.0])  # the map: tokens 0-2
    logits[0, :3] = float("-inf")  # the grammar allows none of them
    logits[0, 6:] = float("-inf")  # nor 6 and 7
    probs = torch.softmax(logits / 0.01, dim=-1)  # a low temperature keeps it finite
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-6
    assert torch.equal(probs[0, 3:6], torch.full((3,), 1 / 3))


@pytest.mark.parametrize("family,async_,ahead", [("llama", False, False), ("gemma3", True, True),
                                                  ("qwen3", True, False)])
def test_greedy_with_a_token_map_equals_the_target_alone(tiny_models, near_drafts, target_greedy, tmp_path, family,
                                                         async_, ahead):
    """Half of the vocabulary, without some of the target's own greedy tokens: the draft cannot propose those, is
    rejected there, and the output is still the target's; every proposal stays inside the map."""
    target = tiny_models[family].path
    outs_ref = target_greedy(family)
    # A third of the distinct tokens of the target's greedy output, its rarest, are left out; its other greedy tokens
    # and random ones up to half of the vocabulary are in: the draft (the target plus noise) still guesses right
    # often enough for accepted runs.
    counts = Counter(t for out in outs_ref for t in out)
    by_count = sorted(counts, key=lambda t: (counts[t], t))
    excluded = set(by_count[:len(by_count) // 3])
    kept = sorted(set(by_count) - excluded)
    ids = kept + random_map(VOCAB // 2 - len(kept), seed=1, exclude=excluded | set(kept))
    llm = LLM(target, draft_model=near_drafts[family].path, num_speculative_tokens=3, async_scheduling=async_,
              speculation_ahead=ahead, draft_token_map=write_map(tmp_path / "map.pt", torch.tensor(ids)),
              adaptive_draft_length=False, **ENGINE_KW)  # a fixed k: the proposals are checked
    proposed: list[int] = []
    proposer = llm.executor.step.draft.proposer
    propose = proposer.propose

    def recording_propose(plan, **kwargs):
        proposal = propose(plan, **kwargs)
        rows = proposal.host_rows([p.num_draft_tokens for p in plan.requests])
        proposed.extend(t for row in rows for t in row if t >= 0)
        return proposal

    proposer.propose = recording_propose
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == outs_ref
    assert proposed and set(proposed) <= set(ids)
    assert llm.spec_stats(outs).acceptance_rate > 0.1


@pytest.mark.parametrize("mode", ["probabilistic", "strict"])
def test_sampling_with_a_token_map_follows_target_distribution(small_vocab_pair, tmp_path, mode):  # noqa: F811
    """k = 2 from a one-token prompt over an 8-token vocabulary, the draft restricted to five tokens: the joint law
    of the first three sampled tokens is the target's (enumerated), and far from the draft's own."""
    target_path, target_hf, draft_path, draft_hf = small_vocab_pair
    token_map = write_map(tmp_path / "map.json", [0, 2, 3, 5, 6])
    llm = LLM(target_path, draft_model=draft_path, num_speculative_tokens=2, rejection_sampling=mode, seed=99,
              block_size=4, max_model_len=16, max_num_seqs=DIST_SAMPLES, max_num_batched_tokens=3 * DIST_SAMPLES,
              draft_token_map=token_map, adaptive_draft_length=False)
    outs = llm.generate([DIST_PROMPT] * DIST_SAMPLES, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids[:3])] += 1
    assert chi_square_p_value(counts, exact_joint(target_hf, DIST_PROMPT, 1.0, 0, 1.0)) > 1e-3
    assert llm.spec_stats(outs).acceptance_rate > 0.05  # speculation did happen
    q = exact_joint(draft_hf, DIST_PROMPT, 1.0, 0, 1.0)
    support = q > 0
    assert chi_square_p_value(counts[support], q[support] / q[support].sum()) < 1e-6  # the test tells them apart


def test_a_ray_draft_worker_takes_the_map(tiny_models, near_drafts, tmp_path):
    """On Ray workers (the draft in a group of its own, asynchronous scheduling, speculation ahead): the same greedy
    output; a bad map is refused before any worker starts."""
    import ray
    from test_ray_executor import greedy_tokens, llm_greedy

    from serving.engine_factory import build_ray_engine

    target = tiny_models["llama"].path
    token_map = write_map(tmp_path / "map.json", random_map(VOCAB // 2, seed=2))
    with local_ray():
        engine = build_ray_engine(target, near_drafts["llama"].path, num_speculative_tokens=3, seed=5,
                                  speculation_ahead=True, draft_token_map=token_map, **ENGINE_KW)
        try:
            assert greedy_tokens(engine) == llm_greedy(target)
            worker = engine.executor.draft.workers[0]
            width = ray.get(worker.__ray_call__.remote(lambda self: self.runner.draft_head.weight.shape[0]))
            assert width == VOCAB // 2  # the draft worker's head is the map's
        finally:
            engine.executor.shutdown()
        with pytest.raises(ValueError, match="draft_token_map"):
            build_ray_engine(target, near_drafts["llama"].path, num_speculative_tokens=3,
                             draft_token_map=write_map(tmp_path / "bad.json", [0, VOCAB]), **ENGINE_KW)


def test_bad_maps_are_refused_naming_the_field(tiny_models, tiny_drafts, tmp_path):
    bad = {
        "missing": str(tmp_path / "none.json"),
        "out of range": write_map(tmp_path / "range.json", [1, 2, VOCAB]),
        "negative": write_map(tmp_path / "neg.json", [-1, 2]),
        "empty": write_map(tmp_path / "empty.json", []),
        "floats": write_map(tmp_path / "floats.json", [1.0, 2.0]),
        "not a list": write_map(tmp_path / "obj.json", {"ids": [1]}),  # type: ignore[arg-type]
        "2-D tensor": write_map(tmp_path / "two.pt", torch.tensor([[1, 2]])),
        "float tensor": write_map(tmp_path / "float.pt", torch.tensor([1.0])),
    }
    (tmp_path / "garbage.json").write_text("[1, 2")
    bad["bad json"] = str(tmp_path / "garbage.json")
    for why, path in bad.items():
        with pytest.raises(ValueError, match="draft_token_map") as e:
            load_token_map(path, VOCAB)
        assert path in str(e.value), why
    assert load_token_map(write_map(tmp_path / "dup.json", [5, 1, 5]), VOCAB) == [1, 5]
    with pytest.raises(ValueError, match="draft_token_map needs the draft in one process"):
        check_token_map(write_map(tmp_path / "ok.json", [1]), VOCAB, tp_size=2)
    for path in (bad["empty"], ""):  # through the engine, before anything runs; an empty path is no file either
        with pytest.raises(ValueError, match="draft_token_map"):
            LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, draft_token_map=path,
                **ENGINE_KW)
    with pytest.raises(ValueError, match="draft_token_map restricts a draft model"):
        LLM(tiny_models["llama"].path, draft_token_map=write_map(tmp_path / "ok2.json", [1]), **ENGINE_KW)
    with pytest.raises(ValueError, match="draft_token_map must be the path"):
        LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, draft_token_map=3, **ENGINE_KW)
