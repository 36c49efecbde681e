"""The server and the offline oracle the end-to-end serving tests share: each started once for the package."""

from __future__ import annotations

import pytest
from serve_support import running_server

from engine import LLM
from serving_e2e import ENGINE


@pytest.fixture(scope="package")
def server():
    with running_server(dict(ENGINE), num_cpus=4) as s:
        yield s


@pytest.fixture(scope="package")
def llm():
    import torch

    # One thread, like the router: on this project's small CPU runners two threads make a 135M-model step
    # many times slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(**ENGINE)
    finally:
        torch.set_num_threads(threads)
