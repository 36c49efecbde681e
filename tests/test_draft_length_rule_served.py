"""The draft length rule served (engine/speculation/draft_length_rule.py): target and draft on Ray worker actors of
their own, behind the HTTP front end. The rule is on by default; its choice is made to change every step, through
runs of k = 0 (the draft sits out, then catches up), and the served greedy output must equal the target alone's.
Its series reach /metrics: the chosen-k histogram, the k = 0 steps and the estimates."""

from __future__ import annotations

import pytest
from byte_models import make_byte_models
from serve_support import router_call, running_server, serve_config

from deploy.bench.runner import parse_prometheus
from engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the quick brown fox", "speculative decoding is", "a b c d e f"]
MAX_TOKENS = 24


def test_served_greedy_equals_target_alone_while_k_changes(tmp_path_factory):
    target, draft = make_byte_models(tmp_path_factory.mktemp("rule-served"))
    alone = LLM(target, block_size=4, max_model_len=128)
    expected = [o.text for o in alone.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                       ignore_eos=True))]
    with running_server(serve_config(target, draft), num_cpus=4) as server:
        def force_cycle(router):
            import itertools

            rule = router.engine.draft_rule
            assert rule is not None, "the rule is on by default when served"
            cycle = itertools.cycle([3, 0, 0, 2, 1, 0, 3])
            rule.forced = []
            choose = rule.choose

            def forced(batch_size):
                choose(batch_size)  # the rule still books the step (its bucket, its counters)
                k = rule.pin(next(cycle))
                rule.forced.append(k)
                return k

            router.engine.scheduler.draft_length_fn = forced
            return True

        assert router_call(force_cycle)
        with server.http(timeout=120) as c:
            for prompt, want in zip(PROMPTS, expected, strict=True):
                r = c.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["choices"][0]["text"] == want
                assert body["spec_decode"]["num_drafts"] > 0
            metrics = parse_prometheus(c.get("/metrics").text)
        chosen = router_call(lambda r: list(r.engine.draft_rule.forced))
        assert {0, 1, 2, 3} <= set(chosen)
        assert sum(v for k, v in metrics.items() if k.startswith("specserve_spec_decode_draft_length_chosen_count")) > 0
        assert sum(v for k, v in metrics.items() if k.startswith("specserve_spec_decode_rule_zero_steps_total")) > 0
        assert any(k.startswith("specserve_spec_decode_rule_acceptance") for k in metrics), sorted(metrics)[:40]
