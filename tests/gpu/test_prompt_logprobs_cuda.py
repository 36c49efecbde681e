"""Prompt logprobs on the GPU fast path (Triton kernels, CUDA graphs), float32: HF's log_softmax at every prompt
position, for a Gemma 3 target (two KV-cache groups) with a hybrid draft. The prompts take each way a chunk that
wants every position's logits can run: a short prompt fits a verify graph (all of its rows' logits), a longer one
beside decodes runs eagerly, and one longer than the token budget spans chunks. Output tokens are those of the
same requests without prompt logprobs."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KW = dict(max_model_len=256, block_size=16, num_kv_blocks=512, max_num_seqs=8, cuda_graph_batch_sizes=(1, 4, 8),
          device="cuda", dtype="float32", max_num_batched_tokens=64)


def test_prompt_logprobs_on_the_fast_path(tiny_models, tiny_drafts) -> None:
    target, draft = tiny_models["gemma3"], tiny_drafts["gemma3-2l"]
    llm = LLM(target.path, draft_model=draft.path, num_speculative_tokens=4, **KW)
    assert llm.executor.target.graphs is not None  # graphs captured: the fast path, not the torch reference
    prompts = random_prompts([3, 40, 150], seed=6)
    scored = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2))
    plain = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in scored] == [o.token_ids for o in plain]
    hf = target.hf.to("cuda")
    try:
        for prompt, out in zip(prompts, scored):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0, :-1].float(), -1).cpu()
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            got = [entry[tok] for tok, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
            assert got == pytest.approx([ref[j, t].item() for j, t in enumerate(prompt[1:])], abs=1e-3)
    finally:
        target.hf.to("cpu")
