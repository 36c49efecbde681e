"""specserve's inference engine: paged KV cache with KV-cache groups, Llama-family and Gemma 3 models,
continuous batching and lossless speculative decoding. Pure PyTorch (+ Triton on GPU); no Ray."""

from engine.llm import LLM
from engine.request import RequestOutput, SamplingParams, SpecStats

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecStats"]
