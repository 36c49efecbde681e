"""engine/gc_heap.py: an engine's or serving process's startup heap frozen out of garbage collection, garbage
collected first. The offline engine is checked here; the serving processes that call it (workers, routers, ingress
replicas) where they start: tests/test_ray_executor.py (worker actors) and tests/test_reliability_faults.py (a router
actor)."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    """The test process's heap is thawed again afterwards, so later tests' garbage stays collectable."""
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_live_objects_are_frozen_and_garbage_is_collected_first(unfrozen) -> None:
    alive = [_Node() for _ in range(1000)]
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a reference cycle: only the cyclic collector reclaims it
    dead = weakref.ref(a)
    del a, b
    frozen = freeze_startup_heap("test")
    assert dead() is None  # collected before the freeze, not kept forever by it
    # The count at the freeze; a frozen object that dies later (by refcount, on any thread) leaves the permanent
    # generation, so the count can only have fallen since.
    assert frozen >= gc.get_freeze_count() >= len(alive)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in alive)  # collections no longer walk them
    # Objects made afterwards are tracked (and collected) as usual.
    later = _Node()
    assert id(later) in {id(o) for o in gc.get_objects()}


def test_the_offline_engine_freezes_its_heap_and_a_later_one_reclaims_the_first(unfrozen, tiny_models) -> None:
    from engine.llm import LLM

    first = LLM(tiny_models["llama"].path, device="cpu", dtype="float32")
    assert first.gc_frozen > 10_000  # torch, transformers and the model: the engine's startup heap
    node = _Node()
    node.other = _Node()
    node.other.other = node  # a reference cycle, frozen with the first engine
    gc.freeze()
    dead = weakref.ref(node)
    del node
    gc.collect()
    assert dead() is not None  # frozen garbage outlives a collection...
    LLM(tiny_models["llama"].path, device="cpu", dtype="float32")
    assert dead() is None  # ...until the next engine thaws and collects it before freezing
