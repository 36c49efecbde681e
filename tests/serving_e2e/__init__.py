"""The serving stack end to end: a real local Ray, Serve's HTTP and gRPC proxies on 127.0.0.1, the router
actor driving the real SmolLM2-135M with itself as the draft (k=3, so speculation really runs and accepts).

The oracle is the offline engine (engine.LLM) with the same settings in this process: served greedy and
seeded-sampled outputs must equal it token for token, whichever front end (raw HTTP, SSE, the official
openai client, gRPC) they come through. test_generation.py: completions, chat, streams, the openai client, batching,
gRPC. test_operations.py: models, health, metrics, the prefix cache, aborts, errors, and last, recovery (it replaces
the router). Both files share one server, started once for the package (conftest.py); pytest runs a directory's
files in name order, so the recovery tests stay last.
"""

from __future__ import annotations

from engine import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
ENGINE = dict(model=MODEL, draft_model=MODEL, num_speculative_tokens=3, rejection_sampling="probabilistic",
              max_model_len=512, device="cpu",
              adaptive_draft_length=False)  # a fixed k: the tests check what speculation does served
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def _offline(llm: LLM, prompt: str | list[dict], **params) -> tuple[str, list[int]]:
    sp = SamplingParams(**params)
    out = llm.chat(prompt, sp) if isinstance(prompt, list) else llm.generate([prompt], sp)[0]
    return out.text, out.token_ids
