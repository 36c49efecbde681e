"""The layout grammar of benchmarks/serve_layouts.py: what each name stands for, the engine settings it runs with,
and the names it refuses (a benchmark that silently ran another layout than the one named would report the wrong
figures)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from layouts import Layout, serve_config  # noqa: E402
from sweep_models import Pair  # noqa: E402


def _args(**over: object) -> argparse.Namespace:
    base = {"concurrency": [1, 16], "smoke": False, "device": "cuda", "eager": False, "bonus_agreement": None,
            "k": 4, "max_model_len": 1024, "dtype": None}
    return argparse.Namespace(**{**base, **over})


PAIR = Pair("synthetic pair", "target-dir", "draft-dir", "synthetic", 0.8)


def test_layout_names_parse_to_their_settings() -> None:
    lay = Layout.parse("t1+d1/predraft/b4")
    assert (lay.target_tp, lay.draft_tp, lay.predraft, lay.branches, lay.num_gpus) == (1, 1, True, 4, 2)
    assert not lay.is_reference  # a branch budget changes how the draft runs, so it is compared, not referred to
    kwargs = serve_config(PAIR, lay, _args())["engine_kwargs"]
    assert kwargs["speculation_ahead"] is True and kwargs["speculation_ahead_branches"] == 4
    assert kwargs["draft_placement"] == "separate"

    plain = Layout.parse("t1+d1")
    assert plain.branches is None and plain.is_reference
    assert "speculation_ahead_branches" not in serve_config(PAIR, plain, _args())["engine_kwargs"]

    offline = Layout.parse("offline+d/b2")  # a branch budget turns speculation ahead on where it is off by default
    assert offline.offline and offline.branches == 2 and offline.predraft is True and offline.num_gpus == 1
    assert serve_config(PAIR, offline, _args())["engine_kwargs"]["speculation_ahead"] is True
    assert Layout.parse("t1+d1/shared/b4").predraft is True
    shared = Layout.parse("t2+d1/shared")
    assert shared.num_gpus == 2 and serve_config(PAIR, shared, _args())["engine_kwargs"]["draft_resources"] == {
        "GPU": 0.25}
    colocated = Layout.parse("t2+d2/colocated")
    assert colocated.num_gpus == 2
    assert serve_config(PAIR, colocated, _args())["engine_kwargs"]["draft_placement"] == "colocated"


@pytest.mark.parametrize(("name", "words"), [
    ("t1/b4", "need a draft"),
    ("offline/b2", "needs a draft"),
    ("t1+d1/b0", "N >= 1"),
    ("t1+d1/b2/b4", "one b<N>"),
    ("t1+d1/b2/nopredraft", "nopredraft"),
    ("t1+d1/predraft/nopredraft", "not both"),
    ("t1+d2/colocated", "colocated needs"),
    ("t1+d1/fast", "unknown options"),
    ("x1+d1", "is not t<T>"),
])
def test_bad_layout_names_are_refused_with_the_reason(name: str, words: str) -> None:
    with pytest.raises(ValueError, match="layout") as err:
        Layout.parse(name)
    assert words in str(err.value)
