"""Run in a subprocess by test_draft_catch_up_buffers.py: Triton's interpreter must be switched on before triton is
first imported, which other test modules may already have done in the pytest process. Argv: the target's and the
draft's checkpoints, then the case as JSON (prompts, max_tokens, the forced draft lengths)."""

from __future__ import annotations

import itertools
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from draft_catch_up_support import ENGINE_KW  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main(target: str, draft: str, case: dict) -> dict:
    torch.set_num_threads(1)
    llm = LLM(target, draft_model=draft, attention_backend="triton", **ENGINE_KW)
    engine = llm.engine
    ks = itertools.chain(case["ks"], itertools.repeat(case["ks"][-1]))
    chosen: list[int] = []
    engine.scheduler.draft_length_fn = lambda batch: chosen.append(next(ks)) or chosen[-1]
    runner = engine.executor.draft
    pieces: list[list[tuple[int, int]]] = []  # every forward run ahead of a catch-up: (start, tokens) per chunk
    prefill_piece = getattr(runner, "_prefill_piece", None)  # None: a runner that cannot run a catch-up ahead

    def recording(chunks):
        pieces.append([(c.start_pos, len(c.token_ids)) for c in chunks])
        return prefill_piece(chunks)

    if prefill_piece is not None:
        runner._prefill_piece = recording
    outs = llm.generate(case["prompts"], SamplingParams(max_tokens=case["max_tokens"], temperature=0.0,
                                                        ignore_eos=True))
    return {"tokens": [o.token_ids for o in outs], "pieces": pieces, "chosen": chosen,
            "capacity": runner.buffers.max_num_tokens, "num_drafts": sum(o.spec.num_drafts for o in outs)}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
