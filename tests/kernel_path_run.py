"""Run in a subprocess by test_kernel_path.py: Triton's interpreter must be switched on before triton is first
imported, which other test modules may already have done in the pytest process."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from conftest import TINY_CONFIGS, make_tiny_model, random_prompts  # noqa: E402
from fast_path_support import draft_runner, hf_draft_tokens, run_draft_loop  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.speculation.draft_loop import DraftLoop  # noqa: E402

# Sixteen tokens give the Mistral pair's speculation ahead a rejection window that hits (at ten it has none); the
# other cases hold at ten, past both families' windows (7 and 6), and the Gemma 3 pair's speculation ahead (its
# slowest case) at seven, still past its window from the shortest prompt (3 + 7 > 6) with windows that hit.
TOKENS = 10
AHEAD_TOKENS = {"mistral": 16, "gemma3": 7}
# The shortest prompt (3 tokens) decodes positions 3-7: the last step's window (7) leaves position 0 out.
PERSISTENT_TOKENS = 6


def main(root: str, families: list[str]) -> dict:
    torch.set_num_threads(1)
    from pathlib import Path

    out: dict = {"generate": {}, "draft_loop": {}}
    prompts = random_prompts([5, 9, 14, 3], seed=4)
    # Single rows through the few-row products (interpreted, they cost minutes at 2-4 rows a step here): the
    # products at every row count have their own greedy tests against HF (tests/test_small_m_linear.py).
    kw = dict(device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=4, small_m_rows=1)
    for fam in families:
        target = make_tiny_model(Path(root), fam, TINY_CONFIGS[fam])
        # A slightly perturbed copy: accepts often, rejects sometimes, so both commit paths run.
        draft = make_tiny_model(Path(root), fam + "-draft", TINY_CONFIGS[fam], scale=5.9)
        res = out["generate"][fam] = {}
        generate_cases(res, target.path, draft.path, prompts, AHEAD_TOKENS[fam], kw)
        if fam == "mistral":
            persistent_cases(res, target.path, draft.path, prompts, kw)
        # The draft loop alone, k = 6 steps from positions that cross block (4) and window (5-7) boundaries.
        runner = draft_runner(draft, "cpu", 6, 4, graphs=False)
        loop = DraftLoop(runner, 6, keep_probs=False)
        lp = random_prompts([6, 7, 10], seed=5)
        ks = [6, 4, 6]
        ids, _ = run_draft_loop(runner, loop, lp, ks)
        out["draft_loop"][fam] = {"loop": [row[:k] for row, k in zip(ids.tolist(), ks)],
                                  "padding": [row[k:] for row, k in zip(ids.tolist(), ks)],
                                  "hf": hf_draft_tokens(draft, lp, ks)}
    return out


def generate_cases(res: dict, target: str, draft: str, prompts: list[list[int]], ahead_tokens: int,
                   kw: dict) -> None:
    """Greedy tokens of the target alone and with the draft on both backends (TOKENS of them; the torch path's
    target alone, the reference, the longer of TOKENS and `ahead_tokens`), and speculation ahead on the kernel path
    (`ahead_tokens`), into `res`."""
    res["tokens"] = TOKENS
    res["ahead_tokens"] = ahead_tokens
    for backend in ("torch", "triton"):
        for d in (None, draft):
            n = max(ahead_tokens, TOKENS) if (backend, d) == ("torch", None) else TOKENS
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            # A fixed k: the two backends' acceptance rates are compared, so both draft at every step.
            llm = LLM(target, draft_model=d, num_speculative_tokens=3, attention_backend=backend,
                      adaptive_draft_length=False, **kw)
            outs = llm.generate(prompts, params)
            key = f"{backend}{'+spec' if d else ''}"
            res[key] = [o.token_ids for o in outs]
            if d:
                res[key + ":acceptance"] = llm.spec_stats(outs).acceptance_rate
    # Speculation ahead with branches on the kernel path: the windows run through the draft loop (runner-up
    # tokens from its step function, per-row guesses in column 0, scratch windows copied back on a hit).
    llm = LLM(target, draft_model=draft, num_speculative_tokens=3, attention_backend="triton",
              speculation_ahead=True, speculation_ahead_branches=4, adaptive_draft_length=False, **kw)
    params = SamplingParams(max_tokens=ahead_tokens, temperature=0.0, ignore_eos=True)
    res["triton+ahead4"] = [o.token_ids for o in llm.generate(prompts, params)]
    st = llm.engine.executor.ahead.stats
    res["triton+ahead4:hits"] = [st.hits_accept, st.hits_reject]


def persistent_cases(res: dict, target: str, draft: str, prompts: list[list[int]], kw: dict) -> None:
    """Every decoder layer of a decode step in one persistent launch (target and draft), staged on the
    interpreter: the same tokens; the counts say the path ran on both models. PERSISTENT_TOKENS (greedy: a prefix of
    the reference's) still cross the 7-token window; fewer tokens cut this part's time."""
    calls = []
    short = SamplingParams(max_tokens=PERSISTENT_TOKENS, temperature=0.0, ignore_eos=True)
    for d in (None, draft):
        llm = LLM(target, draft_model=d, num_speculative_tokens=3, attention_backend="triton",
                  persistent_decode_rows=4, adaptive_draft_length=False, **kw)  # the draft runs every step
        res[f"triton{'+spec' if d else ''}+persistent"] = [o.token_ids for o in llm.generate(prompts, short)]
        runner = llm.engine.executor.draft if d else llm.engine.executor.target
        calls.append(runner.model.model.persistent.calls)
    res["persistent_tokens"] = PERSISTENT_TOKENS
    res["persistent_calls"] = calls  # the target alone's decode steps, the draft's steps


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2:] or ["mistral", "gemma3"])))
