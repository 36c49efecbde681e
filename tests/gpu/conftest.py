"""GPU tests: skipped where there is no CUDA (CI); run on the GPU machine with `pytest tests/gpu`."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared fixtures of tests/conftest.py

pytestmark = pytest.mark.gpu


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
