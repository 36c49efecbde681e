"""Shared by the kernel-path tests on CPU (Triton's interpreter) and on CUDA: the draft loop run directly on a
draft model, against HF greedy decoding of the same model as the oracle."""

from __future__ import annotations

import torch
from conftest import TinyModel, hf_greedy

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk
from engine.sample.metadata import SamplingMetadata
from engine.speculation.draft_loop import DraftLoop
from engine.step.plan_sampling import request_generator

BLOCKS_PER_REQ = 16


def draft_runner(model: TinyModel, device: str, k: int, block_size: int, graphs: bool,
                 dtype: torch.dtype = torch.float32, small_m_rows: int = EngineConfig.small_m_rows) -> ModelRunner:
    cfg = EngineConfig(device=torch.device(device), dtype=dtype, max_model_len=BLOCKS_PER_REQ * block_size,
                       block_size=block_size, num_kv_blocks=1 + 8 * BLOCKS_PER_REQ, max_num_seqs=8,
                       attention_backend="triton", enforce_eager=not graphs, num_speculative_tokens=k,
                       small_m_rows=small_m_rows)
    mc = ModelConfig.from_path(model.path)
    mc.max_model_len = cfg.max_model_len
    return ModelRunner(mc, cfg, "draft")


def tables(runner: ModelRunner, i: int) -> list[list[int]]:
    """Request i's own blocks in every KV-cache group (block 0 is the null block)."""
    first = 1 + i * BLOCKS_PER_REQ
    return [list(range(first, first + BLOCKS_PER_REQ)) for _ in runner.kv_groups]


def run_draft_loop(runner: ModelRunner, loop: DraftLoop, prompts: list[list[int]], ks: list[int],
                   temperature: float = 0.0, seed: int = 0,
                   catch_up: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill all but each prompt's last `catch_up` tokens, then one draft loop from those (the loop's first step
    catches up one token after a rejection, two after a fully accepted window)."""
    dev = runner.device
    c = catch_up
    runner.forward_chunks([Chunk(p[:-c], 0, 0, tables(runner, i)) for i, p in enumerate(prompts)])
    n = len(prompts)
    md = SamplingMetadata.from_lists([temperature] * n, [1.0] * n, [0] * n, device=dev)
    gens = {i: request_generator(seed, 0, 1, dev) for i in range(n)} if temperature > 0 else {}
    default = torch.Generator(device=dev)
    default.manual_seed(seed)
    chunks = [Chunk(p[-c:], len(p) - c, 1, tables(runner, i)) for i, p in enumerate(prompts)]
    return loop.run(chunks, ks, md, gens, default)


def hf_draft_tokens(model: TinyModel, prompts: list[list[int]], ks: list[int]) -> list[list[int]]:
    return [hf_greedy(model.hf, p, k) for p, k in zip(prompts, ks)]
