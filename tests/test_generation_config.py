"""generation_config.json, as vLLM reads it: its extra EOS ids stop generation (engine), and its sampling keys are
the defaults of the request fields they name (serving). The served side is tested end to end in
tests/openai_parity/test_fields.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from serving.openai.generation_config import load_generation_defaults


def _greedy(path: str, prompt: list[int], **params) -> tuple[list[int], str | None]:
    out = LLM(model=path, max_model_len=64, block_size=4, num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=12, **params))[0]
    return out.token_ids, out.finish_reason


def test_extra_eos_ids_stop_generation(tiny_models, tmp_path: Path) -> None:
    path = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"].path, path)
    prompt = random_prompts([6], seed=3)[0]
    full, _ = _greedy(str(path), prompt, ignore_eos=True)
    # A token of the output that did not come before it: making it an EOS id must end the output right there.
    j = next(i for i in range(2, len(full)) if full[i] not in full[:i] and full[i] != 2)
    gen = path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [2, full[j]]}))
    assert ModelConfig.from_path(path).eos_token_ids == [2, full[j]]
    assert _greedy(str(path), prompt) == (full[:j + 1], "stop")
    assert _greedy(str(path), prompt, ignore_eos=True) == (full, "length")  # ignore_eos covers them too


def test_sampling_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 100, "repetition_penalty": 1.0,
        "min_p": 0.05, "eos_token_id": [1, 2], "do_sample": True}))
    # A field outside `supported` (here min_p) is left out with a warning rather than pretended; a neutral value
    # (repetition_penalty 1.0) needs no support.
    assert load_generation_defaults(tmp_path, frozenset({"temperature", "top_p", "top_k", "max_tokens"})) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100, "repetition_penalty": 1.0}


def test_serve_config_generation_config_modes() -> None:
    import pytest

    from deploy.config import ServeConfig

    ServeConfig(generation_config="vllm").validate()
    ServeConfig.from_dict({"generation_config": "auto"}).validate()
    with pytest.raises(ValueError, match="generation_config"):
        ServeConfig(generation_config="hf").validate()
