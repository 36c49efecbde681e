"""Shared fixtures: tiny random-weight models of every family (HF transformers is the oracle) and the
real bundled models."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.engine_core import EngineCore
    from engine.request import Request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))

VOCAB = 128


@dataclass
class TinyModel:
    name: str
    path: str
    hf: torch.nn.Module  # the HF transformers reference, fp32, eval mode
    config: PretrainedConfig


def _base(**kw: object) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=16,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return base


# Family -> config. Sliding windows (5-7 tokens) are far shorter than prompt + output in the tests.
TINY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_base()),
    "mistral": MistralConfig(**_base(sliding_window=7)),
    "qwen2": Qwen2Config(**_base(num_hidden_layers=2)),
    "qwen3": Qwen3Config(**_base()),
    "gemma3": Gemma3TextConfig(**_base(num_hidden_layers=4, sliding_window=6, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                    "sliding_attention"])),
}


def make_tiny_model(root: Path, name: str, config: PretrainedConfig, seed: int = 0, scale: float = 6.0) -> TinyModel:
    """Random weights, with matrices scaled up so next-token distributions are peaked: greedy then has
    clear winners, and a comparison with HF cannot flip on a rounding-level tie."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
        for n, p in model.named_parameters():  # nonzero biases, so the Qwen2 bias path is exercised
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    path = root / name
    model.save_pretrained(path)
    # The engine is run with ignore_eos; HF must not stop (or, with min_new_tokens, suppress EOS) either.
    model.generation_config.eos_token_id = None
    return TinyModel(name, str(path), model, config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(root, name, cfg) for name, cfg in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """Drafts of other shapes than the targets, same vocabulary: a 1-layer Llama, a 2-layer Gemma 3 hybrid
    (two KV-cache groups) and a 1-layer Qwen3."""
    root = tmp_path_factory.mktemp("drafts")
    cfgs = {
        "llama-1l": LlamaConfig(**_base(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=64)),
        "gemma3-2l": Gemma3TextConfig(**_base(num_hidden_layers=2, sliding_window=5, query_pre_attn_scalar=16,
                                              layer_types=["sliding_attention", "full_attention"])),
        "qwen3-1l": Qwen3Config(**_base(num_hidden_layers=1)),
    }
    return {n: make_tiny_model(root, n, c, seed=1) for n, c in cfgs.items()}


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([prompt])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids from 3 up, so no prompt contains BOS/EOS/PAD
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from engine.models.source import resolve_model
    return str(resolve_model("smollm2-135m-instruct").path)


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from engine.models.source import resolve_model
    return str(resolve_model("gemma3-270m").path)


# --------------------------------------------------------------------------------------------------------
# Fixtures of the speculative-decoding tests (tests/test_spec_*.py)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a second busy process makes
    2-thread kernels 10-30x slower (measured); one thread keeps this module's runtime steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_greedy(tiny_models):
    """Target-only greedy outputs per family, checked against HF greedy once: a speculative run is then compared
    with an oracle already known to be right, so a failure points at speculation."""
    from spec_support import ENGINE_KW, GREEDY, NEW_TOKENS, PROMPTS

    from engine import LLM

    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            m = tiny_models[family]
            outs = LLM(m.path, **ENGINE_KW).generate(PROMPTS, GREEDY)
            ids = [o.token_ids for o in outs]
            assert ids == [hf_greedy(m.hf, p, NEW_TOKENS) for p in PROMPTS], f"{family}: target-only != HF"
            cache[family] = ids
        return cache[family]

    return get


@pytest.fixture(scope="module")
def near_drafts(tiny_models, tmp_path_factory) -> dict[str, TinyModel]:
    """Per target family, a draft of another shape that agrees with the target about half the time: the target's
    weights plus 5% noise, and one extra layer (a sliding-window one for Gemma 3). Random drafts of other
    architectures are almost always rejected, which leaves the paths of accepted runs untested."""
    import copy

    root = tmp_path_factory.mktemp("near")
    drafts = {}
    for family, target in tiny_models.items():
        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers += 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types) + ["sliding_attention"]
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(cfg).eval()  # the extra layer keeps its small random init
        weights = model.state_dict()
        with torch.no_grad():
            for name, w in target.hf.state_dict().items():
                weights[name] = w + 0.05 * w.std() * torch.randn_like(w) if w.dim() == 2 else w.clone()
        model.load_state_dict(weights)
        model.save_pretrained(root / family)
        drafts[family] = TinyModel(f"{family}-near", str(root / family), model, cfg)
    return drafts


@pytest.fixture(scope="module")
def near_llama(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama's weights plus 5% noise: a draft that agrees with the target often, so speculative steps
    accept runs of tokens (4 heads and 2 KV heads: splits evenly over 2 ranks). Its shape is the target's (the
    drafts of `near_drafts` have one layer more)."""
    import copy

    target = tiny_models["llama"]
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(target.config)).eval()
    with torch.no_grad():
        model.load_state_dict({n: w + 0.05 * w.std() * torch.randn_like(w) if w.dim() == 2 else w.clone()
                               for n, w in target.hf.state_dict().items()})
    path = tmp_path_factory.mktemp("near") / "llama"
    model.save_pretrained(path)
    return str(path)


def hf_greedy_cuda(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt` on the GPU (the model moves there and back)."""
    model = model.to("cuda")
    x = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    model.to("cpu")
    return out[0, len(prompt):].tolist()


@contextlib.contextmanager
def local_ray(num_cpus: int = 4, num_gpus: int | None = None) -> Iterator[None]:
    """A real local Ray runtime for a test module, its workers importing this checkout (and what PYTHONPATH adds,
    where Ray itself may be installed) with one tokenizer thread each."""
    import ray

    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    from serving import serve_process_env

    serve_process_env.apply()  # the Serve process settings `specserve serve` runs with
    # address="local": this module's own cluster, whatever Ray's current-cluster file says (a killed run leaves it)
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield
    finally:
        ray.shutdown()


def start_requests(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   steps: int = 0) -> list[Request]:
    """Add one request per prompt (ids r0, r1, ...; `params` one for all, or one each) to an EngineCore and run
    `steps` steps; returns the requests, in prompt order."""
    from engine.request import Request

    each = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, each))]
    for r in reqs:
        engine.add_request(r)
    for _ in range(steps):
        engine.step()
    return reqs


def run_to_completion(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[Request]:
    """Add one request per prompt (ids r0, r1, ...) to an EngineCore and step it until every one has finished;
    returns the requests, in prompt order."""
    reqs = start_requests(engine, prompts, params)
    while engine.has_unfinished():
        engine.step()
    return reqs

