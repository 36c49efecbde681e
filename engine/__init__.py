"""specserve's inference engine: paged KV cache with KV-cache groups, Llama-family, Gemma 3, GPT-OSS and Qwen3-MoE
models, continuous batching and lossless speculative decoding. Pure PyTorch (+ Triton on GPU); no Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.request import RequestOutput, SamplingParams, SpecStats

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecStats"]


def __getattr__(name: str) -> Any:
    """Imported on first use: `import engine.config` (the CLI checking its options before anything starts) need
    not load the models' code."""
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "SamplingParams", "SpecStats"):
        from engine import request

        return getattr(request, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
