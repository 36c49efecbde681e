"""Graph capture holds off Python's cyclic garbage collector (engine/runner/cuda_graphs.py says why); CPU-only."""

from __future__ import annotations

import gc

import pytest

from engine.runner.cuda_graphs import no_gc_while_capturing


def test_collector_is_off_while_capturing_and_back_after_an_error():
    assert gc.isenabled()
    with no_gc_while_capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"), no_gc_while_capturing():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


def test_collector_left_off_stays_off():
    gc.disable()
    try:
        with no_gc_while_capturing():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
