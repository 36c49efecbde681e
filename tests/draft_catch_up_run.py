"""Run in a subprocess by test_draft_catch_up_buffers.py: Triton's interpreter must be switched on before triton is
first imported, which other test modules may already have done in the pytest process. Argv: the target's checkpoint,
the drafter's (a draft model, or an EAGLE-3 head with "eagle3" after it), then the case as JSON (prompts,
max_tokens, the forced draft lengths)."""

from __future__ import annotations

import itertools
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from draft_catch_up_support import ENGINE_KW  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main(target: str, drafter: str, method: str, case: dict) -> dict:
    torch.set_num_threads(1)
    kw = dict(ENGINE_KW, attention_backend="triton")
    if method == "eagle3":
        k = kw.pop("num_speculative_tokens")
        llm = LLM(target, speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": k}, **kw)
    else:
        llm = LLM(target, draft_model=drafter, **kw)
    engine = llm.engine
    ks = itertools.chain(case["ks"], itertools.repeat(case["ks"][-1]))
    chosen: list[int] = []
    engine.scheduler.draft_length_fn = lambda batch: chosen.append(next(ks)) or chosen[-1]
    runner = engine.executor.draft
    pieces: list[list[int]] = []  # every forward run ahead of a catch-up: its chunks' token counts
    cut_to_fit = getattr(runner, "cut_to_fit", None)  # None: a runner that cannot run a catch-up ahead

    def recording(chunks):
        cut = cut_to_fit(chunks)
        if cut is not None:
            pieces.extend([len(c.token_ids) for c in piece] for piece, _ in cut.pieces)
        return cut

    if cut_to_fit is not None:
        runner.cut_to_fit = recording
    outs = llm.generate(case["prompts"], SamplingParams(max_tokens=case["max_tokens"], temperature=0.0,
                                                        ignore_eos=True))
    return {"tokens": [o.token_ids for o in outs], "pieces": pieces, "chosen": chosen,
            "capacity": runner.buffers.max_num_tokens, "num_drafts": sum(o.spec.num_drafts for o in outs)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))))
