"""EngineCore's methods for servers (what the router reads and changes between steps), on the offline engine.

The Ray side of the same methods (workers, health, detach/attach of a draft group) runs in
tests/test_reliability_faults.py, through a real server whose draft and target workers are killed.
"""

from __future__ import annotations

import pytest
from spec_support import ENGINE_KW, PROMPTS

from engine import LLM, SamplingParams
from engine.request import Request


def test_counts_stats_and_membership_follow_the_requests(tiny_models) -> None:
    llm = LLM(tiny_models["llama"].path, max_num_seqs=1, **ENGINE_KW)
    engine = llm.engine
    assert (engine.num_running(), engine.num_waiting()) == (0, 0)
    a = Request("a", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    b = Request("b", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request(a)
    engine.add_request(b)
    assert engine.has_request("a") and engine.has_request("b") and not engine.has_request("c")
    assert (engine.num_running(), engine.num_waiting()) == (0, 2)
    engine.step()  # one sequence slot: a runs, b waits
    assert (engine.num_running(), engine.num_waiting()) == (1, 1)
    stats = engine.stats()
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1 and stats["speculation"] is False
    assert stats["kv_blocks_used"]["target/0"] > 0 and 0 < stats["kv_cache_usage"]["target/0"] <= 1
    assert engine.abort_request("b") is b
    assert not engine.has_request("b") and engine.num_waiting() == 0
    while engine.has_unfinished():
        engine.step()
    assert not engine.has_request("a") and engine.stats()["kv_blocks_used"] == {"target/0": 0}
    # Models in this process: no workers to list, nothing to check or release.
    assert engine.workers() == []
    engine.check_health(1.0)
    engine.shutdown()


def test_detach_draft_refuses_what_it_cannot_do(tiny_models) -> None:
    plain = LLM(tiny_models["llama"].path, **ENGINE_KW).engine
    with pytest.raises(RuntimeError, match="does not speculate"):
        plain.detach_draft()
    spec = LLM(tiny_models["llama"].path, draft_model=tiny_models["llama"].path, num_speculative_tokens=2,
               **ENGINE_KW).engine
    with pytest.raises(RuntimeError, match="cannot run without its draft"):
        spec.detach_draft()
    # Refused before changing anything: the engine still speculates.
    assert spec.spec_config is not None and spec.draft_kv is not None and spec.stats()["speculation"] is True
