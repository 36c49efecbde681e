"""The server the bad-input tests share, started once for the package: each of its files would otherwise start
its own (about 25 s on a CI machine) for a few seconds of requests. Every test leaves it as it found it (the
tables' bad requests are refused, the fuzzing's are refused or served, and both files check that no KV block
stays held)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from byte_models import make_byte_models
from serve_support import Server, running_server, serve_config

from http_api import API_KEY, MAX_BODY, MAX_MODEL_LEN


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    target, draft = make_byte_models(tmp_path_factory.mktemp("byte"))
    cfg = serve_config(target, draft, api_key=API_KEY, max_request_body_bytes=MAX_BODY, max_model_len=MAX_MODEL_LEN)
    with running_server(cfg) as srv:
        yield srv
