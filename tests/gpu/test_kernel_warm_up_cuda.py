"""No Triton kernel compiles inside a serving step: the runner compiles every paged-attention variant at start
(ModelRunner.warm_up_attention), and the values that change from step to step (split counts, the adaptive draft
length) are not specialized on. A compile inside a step stalls it for a second or more, in every worker process."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.kernels.attention import paged as paged_attention
from engine.kernels.speculation import rejection

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=512, block_size=16, num_kv_blocks=512, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          device="cuda", dtype="float32")
KERNELS = [paged_attention._paged_attention_kernel, paged_attention._combine_splits_kernel]


def compiled(kernels) -> int:
    """Compiled variants held by these kernels' caches, over every device."""
    return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_no_attention_variant_compiles_after_start(tiny_models, family):
    llm = LLM(tiny_models[family].path, **KW)
    assert llm.engine.executor.target.warm_up_attention(), "the warm-up ran no step"
    before = compiled(KERNELS)
    # Prefill chunks of many lengths, batches of every size, decodes growing past several key tiles: every launch
    # shape the engine selects, eager and replayed.
    for n in (1, 3, 8, 5):
        prompts = random_prompts([7 + 37 * i % 200 for i in range(n)], seed=n)
        llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    assert compiled(KERNELS) == before


def test_no_rejection_variant_compiles_as_the_draft_length_changes(tiny_models, tiny_drafts):
    """Adaptive draft length: k changes between steps; the rejection kernel must not compile per k."""
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=4,
              rejection_sampling="probabilistic", **KW)
    prompts = random_prompts([9, 30], seed=1)
    llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.8, seed=2, ignore_eos=True))
    before = compiled([rejection._rejection_kernel])
    for k in (1, 2, 3):
        llm.engine.scheduler.num_speculative_tokens = k
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, seed=k, ignore_eos=True))
    assert compiled([rejection._rejection_kernel]) == before


@pytest.mark.parametrize("mode", ["probabilistic", "strict", "synthetic"])
def test_no_rejection_variant_compiles_on_the_first_requests(tiny_models, tiny_drafts, mode):
    """The verifier compiles every rejection variant at start (engine/kernels/speculation/rejection.py `warm_up`): the
    first greedy and sampled requests of a fresh engine compile none."""
    rate = dict(synthetic_acceptance_rate=0.7) if mode == "synthetic" else {}
    llm = LLM(tiny_models["llama"].path, draft_model=tiny_drafts["llama-1l"].path, num_speculative_tokens=3,
              rejection_sampling=mode, **rate, **KW)
    assert llm.engine.executor.verifier.rejection_variants_warmed == 6
    before = compiled([rejection._rejection_kernel])
    prompts = random_prompts([11, 40], seed=5)
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True))
    assert compiled([rejection._rejection_kernel]) == before
