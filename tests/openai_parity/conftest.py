"""The server and the offline oracle the OpenAI parity tests share: each started once for the package.

The server runs with vLLM's chat flags (tool calls parsed as Hermes markup with auto tool choice on, Qwen3-style
reasoning split, a chat template from a file) so that the client tests (test_tool_clients.py) need no second
app: a template that renders the same text as the model's own when a request has no tools, and no reasoning in
a random model's outputs, leave the other tests' outputs as they were. Its context is 1024 bytes (the model's
config says so): client libraries' prompts (instructor's schema instructions) are longer than 128."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from byte_models import CHAT_TEMPLATE, make_byte_models
from serve_support import Server, running_server, serve_config

from engine import LLM
from openai_parity import MAX_NEW_TOKENS, SERVED_MAX_MODEL_LEN

# generation_config.json of the served target: its defaults apply to what a request leaves unset.
# max_new_tokens leaves room for tool calls (test_outputs.py, test_tool_clients.py).
GEN_DEFAULTS = {"top_k": 7, "max_new_tokens": MAX_NEW_TOKENS}
# The byte models' template, and "[tools]" ahead of it when a request has tools (the tiny model needs no listing).
SERVED_CHAT_TEMPLATE = "{% if tools %}[tools]{% endif %}" + CHAT_TEMPLATE


@pytest.fixture(scope="package")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target, draft = make_byte_models(tmp_path_factory.mktemp("byte"))
    gen = Path(target) / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **GEN_DEFAULTS}))
    for model in (target, draft):
        config = Path(model) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()),
                                      "max_position_embeddings": SERVED_MAX_MODEL_LEN}))
    return target, draft


@pytest.fixture(scope="package")
def server(models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    target, draft = models
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(SERVED_CHAT_TEMPLATE)
    config = serve_config(target, draft, rejection_sampling="probabilistic", max_model_len=SERVED_MAX_MODEL_LEN,
                          enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
                          chat_template=str(template))
    with running_server(config, num_cpus=4) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.http(timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def llm(models: tuple[str, str]) -> LLM:
    target, draft = models
    return LLM(model=target, draft_model=draft, num_speculative_tokens=3, max_model_len=256, device="cpu",
               block_size=4, num_kv_blocks=256)
