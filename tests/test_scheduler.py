"""Continuous batching: preemption by recompute, abort at any time, batching that changes nothing."""

from __future__ import annotations

from conftest import hf_greedy, random_prompts

from engine import LLM, SamplingParams
from engine.request import Request, RequestStatus


def test_preempted_requests_produce_the_same_tokens(tiny_models):
    m = tiny_models["llama"]
    prompts = random_prompts([12, 15, 9, 14], seed=5)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    roomy = LLM(model=m.path, max_model_len=64, block_size=4, num_kv_blocks=128).generate(prompts, params)
    # 22 usable blocks of 4 tokens cannot hold four requests of ~40 tokens: some must be preempted.
    tight_llm = LLM(model=m.path, max_model_len=64, block_size=4, num_kv_blocks=23)
    tight = tight_llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert tight[0].token_ids == hf_greedy(m.hf, prompts[0], 30)
    assert tight_llm.engine.target_kv.num_used_blocks() == [0]


def test_seeded_sampling_survives_preemption(tiny_models):
    m = tiny_models["qwen3"]
    prompts = random_prompts([12, 15, 9, 14], seed=6)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    roomy = LLM(model=m.path, max_model_len=64, block_size=4, num_kv_blocks=128).generate(prompts, params)
    tight = LLM(model=m.path, max_model_len=64, block_size=4, num_kv_blocks=23).generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_abort_returns_every_block(tiny_models):
    m = tiny_models["gemma3"]
    llm = LLM(model=m.path, max_model_len=128, block_size=4, num_kv_blocks=64)
    eng = llm.engine
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
            for i, p in enumerate(random_prompts([20, 7, 13], seed=2))]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # prefill
    for _ in range(5):
        eng.step()
    assert all(u > 0 for u in eng.target_kv.num_used_blocks())
    eng.abort_request("r1")
    assert reqs[1].status == RequestStatus.FINISHED_ABORTED and not eng.target_kv.has("r1")
    eng.abort_request("r0")
    eng.abort_request("r2")
    assert eng.target_kv.num_used_blocks() == [0, 0]
    assert not eng.has_unfinished()
    # A waiting request (never scheduled) can be aborted too.
    eng.add_request(Request("w", [5, 6, 7], SamplingParams(max_tokens=3)))
    eng.abort_request("w")
    assert not eng.has_unfinished()


def test_batching_does_not_change_greedy_output(tiny_models):
    m = tiny_models["mistral"]
    prompts = random_prompts([4, 19, 11, 8, 25], seed=9)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(model=m.path, max_model_len=128, block_size=4, num_kv_blocks=128, max_num_seqs=2)
    batched = llm.generate(prompts, params)
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
