"""OpenAI API parity with vLLM, served for real: a local Ray, Serve's HTTP proxy on 127.0.0.1, the tiny byte-level
models (target + noisy draft, probabilistic rejection sampling, so speculation really runs).

test_fields.py: every field is honoured or refused with a 400 naming it (a table over the refused ones); unknown
fields and bad chat messages are 400s naming the field; the tokenizer routes, /version and /v1/models/{id}; usage in
streams as vLLM sends it; generation_config.json defaults. test_outputs.py: n > 1 and prompt batches (independent,
reproducible choices), logprobs, logits processing and stop options, structured outputs and tools. The oracle for
outputs is the offline engine (engine.LLM) with the same models and settings. Both files share one server, started
once for the package (conftest.py).
"""

from __future__ import annotations

from engine import LLM, SamplingParams

MODEL = "tiny"
SERVED_MAX_MODEL_LEN = 1024  # the served context (conftest.py)
MAX_NEW_TOKENS = 160  # the target's generation_config.json: a cap on max_tokens (room for two tool calls)

CMPL = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _offline(llm: LLM, prompt: str, **params) -> str:
    return llm.generate([prompt], SamplingParams(**params))[0].text
