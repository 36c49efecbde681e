"""The options' one declaration (deploy/serve_options.py): every field reachable, with the same value, by its
`specserve serve` flag, a YAML file, `serve run`'s key=value text (and KubeRay's args) and, for the engine's and the
speculation's, `specserve generate`'s flags; vLLM's engine flags reach the engine; docs/configuration.md is what
the declaration generates."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from deploy import options
from deploy.cli import _GENERATE_SKIP, _given, build_parser
from deploy.config import ServeConfig, load_config
from deploy.serve_options import EngineOptions, SpeculationOptions

FIELDS = dataclasses.fields(ServeConfig)
HINTS = typing.get_type_hints(ServeConfig)


def _sample(f: dataclasses.Field) -> tuple[object, str]:
    """A value other than the field's default, within its declared bounds, and its text form."""
    default, meta, hint = options.default_of(f), f.metadata, HINTS[f.name]
    kinds = {hint} if typing.get_origin(hint) is dict else set(typing.get_args(hint)) or {hint}
    if meta.get("choices"):
        value = next(c for c in meta["choices"] if c != default and c is not None)
        return value, str(value)
    if kinds <= {bool, type(None)}:
        value = not default if default is not None else True
        return value, str(value).lower()
    if f.name == "draft_length_schedule":
        return "2:3,8:1", "2:3,8:1"
    if any(typing.get_origin(k) is dict for k in kinds):
        return {"a": 1}, "{a: 1}"
    if int in kinds:
        lo, hi = meta.get("minimum"), meta.get("maximum")
        value = int(lo) + 1 if lo is not None else 3
        if value == default:
            value += 1
        assert hi is None or value <= hi
        return value, str(value)
    if float in kinds:
        lo, hi = meta.get("minimum") or 0.0, meta.get("maximum") or 100.0
        value = round((lo + hi) / 2 + 0.125, 3)
        return value, str(value)
    return f"x-{f.name}", f"x-{f.name}"


def _flag_args(f: dataclasses.Field, value: object, text: str) -> list[str]:
    flag = options.flag_name(f.name)
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, text]


@pytest.mark.parametrize("f", FIELDS, ids=[f.name for f in FIELDS])
def test_every_field_by_flag_yaml_and_serve_run_args(f: dataclasses.Field, tmp_path: Path) -> None:
    value, text = _sample(f)
    assert value != options.default_of(f)
    assert f.metadata["help"], f"{f.name} has no help text"
    by_flag = load_config(None, _given(build_parser().parse_args(["serve", *_flag_args(f, value, text)])))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({f.name: value}))
    by_yaml = load_config(path)
    by_serve_run = ServeConfig.from_dict({f.name: text})  # `serve run deploy.app:build_app name=text`
    by_kuberay = ServeConfig.from_dict({f.name: value})  # serveConfigV2 args: YAML's own types
    got = [getattr(c, f.name) for c in (by_flag, by_yaml, by_serve_run, by_kuberay)]
    assert got == [value] * 4, (f.name, got)
    # Nothing else moved.
    for other in FIELDS:
        if other.name != f.name:
            assert getattr(by_flag, other.name) == options.default_of(other), (f.name, other.name)
    shared = {g.name for cls in (EngineOptions, SpeculationOptions) for g in dataclasses.fields(cls)}
    if f.name in shared and f.name not in _GENERATE_SKIP:  # `specserve generate` shares these
        gen = build_parser().parse_args(["generate", "--prompt", "x", *_flag_args(f, value, text)])
        assert getattr(ServeConfig.from_dict(_given(gen)), f.name) == value


def test_speculative_config_and_positional_model_are_the_same_fields() -> None:
    vllm = build_parser().parse_args(["serve", "m", "--speculative-config",
                                      '{"model": "d", "num_speculative_tokens": 3, "method": "draft_model", '
                                      '"draft_tensor_parallel_size": 2, "disable_by_batch_size": 8}'])
    ours = build_parser().parse_args(["serve", "--model", "m", "--draft-model", "d", "--num-speculative-tokens", "3",
                                      "--draft-tensor-parallel-size", "2", "--spec-disable-above-batch-size", "8"])
    assert load_config(None, _given(vllm)) == load_config(None, _given(ours))
    assert ServeConfig.from_dict({"speculative_config": {"model": "d", "rejection_sampling": "strict"}}) == \
        ServeConfig(draft_model="d", rejection_sampling="strict")


def test_vllm_engine_flags_reach_the_engine(tmp_path: Path) -> None:
    """Each vLLM engine flag is honoured: the offline engine built from the flags (as `specserve generate` builds
    it) runs with their values, and speculates with --speculative-config's draft."""
    from byte_models import make_byte_models

    from engine import LLM, SamplingParams

    target, draft = make_byte_models(tmp_path)
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--model", target, "--speculative-config",
        f'{{"model": "{draft}", "num_speculative_tokens": 2, "rejection_sampling": "strict"}}', "--max-num-seqs", "3",
        "--max-num-batched-tokens", "48", "--block-size", "8", "--enforce-eager", "--gpu-memory-utilization", "0.7",
        "--tokenizer", draft, "--kv-cache-dtype", "float32", "--dtype", "float32", "--max-model-len", "64",
        "--seed", "3", "--no-enable-prefix-caching", "-tp", "1", "--device", "cpu", "--num-kv-blocks", "64"])
    llm = LLM(**ServeConfig.from_dict(_given(args)).engine_args())
    cfg = llm.engine_config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, cfg.enforce_eager,
            cfg.gpu_memory_utilization, cfg.tokenizer, cfg.kv_cache_dtype, str(cfg.dtype), cfg.max_model_len,
            cfg.seed, cfg.enable_prefix_caching) == (3, 48, 8, True, 0.7, draft, "float32", "torch.float32", 64, 3,
                                                     False)
    assert llm.engine.spec_config.num_speculative_tokens == 2
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.spec.num_drafts > 0


def test_configuration_docs_are_current() -> None:
    """docs/configuration.md is generated from the declaration: `python -m deploy.config_docs` rewrites it."""
    from deploy.config_docs import DOCS_PATH, render

    assert DOCS_PATH.read_text() == render(), "docs/configuration.md is stale: run `python -m deploy.config_docs`"
