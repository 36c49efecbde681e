"""Bad input raises ValueError with a message a user can act on, and loses nothing already queued."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(model=tiny_models["llama"].path, max_model_len=32, block_size=4, num_kv_blocks=64)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=4))


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6, 100000]], SamplingParams(max_tokens=4))


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=4))


def test_bad_prompt_in_a_batch_loses_nothing(llm):
    good = random_prompts([5])[0]
    with pytest.raises(ValueError):
        llm.generate([good, []], SamplingParams(max_tokens=4))
    # The engine is clean: nothing left queued, and it still serves.
    assert not llm.engine.has_unfinished()
    assert llm.engine.target_kv.num_used_blocks() == [0]
    assert len(llm.generate([good], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@pytest.mark.parametrize("model, match", [
    ("no-such-model", "unknown model"),
    ("/nonexistent/dir/model", "does not exist"),
    ("/nonexistent/file.gguf", "does not exist"),
])
def test_unknown_model(model, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=model)


def test_bad_engine_settings(tiny_models):
    path = tiny_models["llama"].path
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=path, max_model_len=100000)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=path, dtype="float8")
    with pytest.raises(ValueError, match="CUDA is not available"):
        import torch
        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
        LLM(model=path, device="cuda")
