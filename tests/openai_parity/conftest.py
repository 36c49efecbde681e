"""The server and the offline oracle the OpenAI parity tests share: each started once for the package."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from byte_models import make_byte_models
from serve_support import Server, running_server, serve_config

from engine import LLM

# generation_config.json of the served target: its defaults apply to what a request leaves unset.
# max_new_tokens leaves room for a tool call (the structured-output tests in test_outputs.py).
GEN_DEFAULTS = {"top_k": 7, "max_new_tokens": 96}


@pytest.fixture(scope="package")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target, draft = make_byte_models(tmp_path_factory.mktemp("byte"))
    gen = Path(target) / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **GEN_DEFAULTS}))
    return target, draft


@pytest.fixture(scope="package")
def server(models: tuple[str, str]) -> Iterator[Server]:
    target, draft = models
    with running_server(serve_config(target, draft, rejection_sampling="probabilistic"), num_cpus=4) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.http(timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def llm(models: tuple[str, str]) -> LLM:
    target, draft = models
    return LLM(model=target, draft_model=draft, num_speculative_tokens=3, max_model_len=128, device="cpu",
               block_size=4, num_kv_blocks=256)
