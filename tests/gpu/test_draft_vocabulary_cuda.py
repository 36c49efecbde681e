"""A draft token map on CUDA (see tests/test_draft_vocabulary.py): graph-captured draft loops with the restricted
head give the target's greedy tokens (float32, where greedy speculation is exact against the target alone) for a Qwen3
and a Gemma 3 (two KV-cache groups) draft."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompts
from test_draft_vocabulary import write_map

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family,draft", [("qwen3", "qwen3-1l"), ("gemma3", "gemma3-2l")])
def test_graphs_with_a_token_map_keep_the_target_greedy(tiny_models, tiny_drafts, tmp_path, family, draft):
    target = tiny_models[family].path
    prompts = random_prompts([5, 17, 30], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=256, max_num_seqs=4,
              cuda_graph_batch_sizes=(1, 2, 4))
    alone = [o.token_ids for o in LLM(target, **kw).generate(prompts, params)]
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:VOCAB // 2]
    llm = LLM(target, draft_model=tiny_drafts[draft].path, num_speculative_tokens=3,
              draft_token_map=write_map(tmp_path / "map.pt", ids), **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    assert llm.executor.draft.draft_head is not None and llm.executor.draft.draft_head.num_ids == VOCAB // 2
