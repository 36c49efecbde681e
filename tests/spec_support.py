"""Shared helpers and fixtures of the speculative-decoding tests (test_spec_decode, test_spec_distribution)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from conftest import random_prompts
from scipy import stats

from engine import LLM, SamplingParams

P_VALUE_THRESHOLD = 1e-3
PROMPTS = random_prompts([3, 9, 17], seed=11)
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# max_num_batched_tokens=20 makes the first step a mix of whole prompts and a chunk of the 17-token prompt, and
# later steps mix speculative decodes with that prompt's last chunk; max_model_len keeps the KV pools small.
ENGINE_KW = dict(block_size=4, max_model_len=64, max_num_batched_tokens=20)


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One request's share of one step that sampled for it (a verify step, or a plain decode / last prefill chunk)."""

    request_id: str
    num_output_before: int  # output tokens before this step
    num_tokens_before: int  # prompt + output tokens before this step
    num_draft_tokens: int  # k this step (0: plain decode / last prefill chunk)
    num_accepted: int


def record_steps(llm: LLM) -> list[Step]:
    """Record every sampled request of every step `llm` runs from now on.

    SpecStats only holds totals; the per-step k and accepted counts are what the scheduler's k-shrinking and the
    reference comparison are about. They cross the executor boundary (StepPlan in, StepResult out: the same
    interface the Ray workers serve), so this instance's executor is wrapped.
    """
    steps: list[Step] = []
    executor = llm.engine.executor
    execute = executor.execute

    def recording_execute(plan):
        result = execute(plan)
        for p, tokens, accepted in zip(plan.requests, result.sampled, result.num_accepted, strict=True):
            if tokens is not None:  # None: a prefill chunk short of the prompt's end
                steps.append(Step(p.request_id, p.num_output_tokens, p.start_pos + len(p.token_ids),
                                  p.num_draft_tokens, accepted))
        return result

    executor.execute = recording_execute
    return steps


def steps_by_request(steps: list[Step]) -> dict[str, list[Step]]:
    out: dict[str, list[Step]] = defaultdict(list)
    for s in steps:
        out[s.request_id].append(s)
    return out


def kv_used_blocks(llm: LLM) -> dict[str, list[int]]:
    """Blocks in use per KV-cache group, for the target's and the draft's managers."""
    used = {"target": llm.engine.target_kv.num_used_blocks()}
    if llm.engine.draft_kv is not None:
        used["draft"] = llm.engine.draft_kv.num_used_blocks()
    return used


def assert_kv_released(llm: LLM) -> None:
    used = kv_used_blocks(llm)
    assert set(used) == {"target", "draft"}
    assert all(n == 0 for groups in used.values() for n in groups), f"blocks still held after generate: {used}"


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, float]:
    """Pearson chi-square goodness of fit: (statistic, p-value, the statistic's critical value at
    P_VALUE_THRESHOLD). Cells with expected count < 5 are pooled into one cell (the chi-square approximation needs
    expected counts >= 5). Cells of probability 0 must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "the engine produced a sequence of probability 0"
    expected = probs * counts.sum()
    big = expected >= 5
    small = ~big & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    if exp[-1] < 5:  # a pooled cell that is still small joins the smallest big cell
        i = int(exp[:-1].argmin())
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    res = stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    return float(res.statistic), float(res.pvalue), float(stats.chi2.isf(P_VALUE_THRESHOLD, len(obs) - 1))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of `chi_square`."""
    return chi_square(counts, probs)[1]


def first_three_counts(llm: LLM, prompt: list[int], samples: int, vocab: int) -> tuple[torch.Tensor, list]:
    """`samples` generations of three tokens after `prompt` at temperature 1 (no truncation): how often each
    (x1, x2, x3) came, [vocab, vocab, vocab] float64, and the outputs."""
    outs = llm.generate([prompt] * samples, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    counts = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    return counts, outs


def run_together(engines: list, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    """The prompts in every engine (EngineCore) under the same request ids, each engine in another order (so that the
    same ids and the same local block ids hold different tokens in each), the engines stepped in turn until all
    have finished; each engine's outputs in prompt order. What engines sharing one draft group are tested with."""
    from engine.request import Request

    n = len(prompts)
    orders = [[(i + shift) % n for i in range(n)] for shift in range(len(engines))]
    reqs = [[Request(f"r{j}", prompts[i], params[i]) for j, i in enumerate(order)] for order in orders]
    for engine, rs in zip(engines, reqs):
        for r in rs:
            engine.add_request(r)
    while any(e.has_unfinished() for e in engines):
        for e in engines:
            if e.has_unfinished():
                e.step()
    return [[rs[order.index(i)].output_token_ids for i in range(n)] for rs, order in zip(reqs, orders)]
