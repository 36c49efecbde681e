"""The L2 prefetch kernel (engine/kernels/l2_prefetch.py) on CUDA: it issues its requests (the PTX holds them),
changes no memory (its torch reference does nothing), and graph replays of a model whose layers prefetch give the
tokens of the same model without it."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.kernels.l2_prefetch import (
    LANES,
    LINE_BYTES,
    PrefetchTable,
    _l2_prefetch_kernel,
    l2_prefetch,
    l2_prefetch_ref,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bulk", [True, False])
def test_prefetch_requests_and_changes_nothing(bulk):
    if bulk and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk prefetch needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    # Sizes that are not multiples of the chunk or of 16 bytes, and two dtypes.
    tensors = [torch.randn(1000, 37, device="cuda", generator=g, dtype=torch.bfloat16),
               torch.randn(333, device="cuda", generator=g, dtype=torch.float32),
               torch.randn(4096, 1024, device="cuda", generator=g, dtype=torch.bfloat16)]
    before = [t.clone() for t in tensors]
    table = PrefetchTable(tensors, chunk_bytes=4096)
    assert table.nbytes >= sum(t.numel() * t.element_size() for t in tensors)
    compiled = _l2_prefetch_kernel[(triton_cdiv(table.num_chunks, LANES),)](
        table.table, table.num_chunks, BULK=bulk, LINE=LINE_BYTES, LANES_=LANES, USE_PDL=False, num_warps=1)
    assert ("cp.async.bulk.prefetch.L2.global" if bulk else "prefetch.global.L2") in compiled.asm["ptx"]
    l2_prefetch(table)
    l2_prefetch_ref(table)
    torch.cuda.synchronize()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_prefetching_layers_give_the_same_tokens(tiny_models, tiny_drafts):
    """float32, graphs, with a draft: every l2_prefetch mode gives the tokens of the model without it (the
    requests are hints; a wrongly placed one would at worst slow a step, but one that broke the dependent-launch
    chain would change tokens)."""
    prompts = random_prompts([5, 17, 30], seed=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("off", "attention", "layer+next", "attention+next"):
        llm = LLM(model=tiny_models["qwen3"].path, draft_model=tiny_drafts["qwen3-1l"].path, num_speculative_tokens=3,
                  device="cuda", dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=4,
                  cuda_graph_batch_sizes=(1, 2, 4), l2_prefetch=mode)
        if mode != "off":
            layers = [m for m in llm.executor.target.model.modules() if hasattr(m, "l2_prefetch")]
            assert layers and all(layer.l2_prefetch for layer in layers)
        runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(r == runs["off"] for r in runs.values())
