"""The teacher side of distillation: what the target writes after each prompt, and its next-token
distributions over prompt + continuation."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.distill.data import DistillSequence, collate
from engine.distill.logits import autocast, logits_at_targets
from engine.llm import LLM
from engine.request import SamplingParams

logger = logging.getLogger("specserve")


def generate_continuations(llm: LLM, prompts: Sequence[list[int]], max_new_tokens: int, samples_per_prompt: int = 1,
                           temperature: float = 0.7, seed: int = 0, chunk: int = 512,
                           progress: bool = True) -> list[DistillSequence]:
    """Per prompt: the target's greedy continuation, then `samples_per_prompt` samples at `temperature`.

    Both kinds matter: served traffic is greedy and sampled alike, and a draft trained only on greedy text never
    sees the less likely turns a sampled request takes. Each sample has its own seed, so the data set is the same
    on every run whatever the batching. Empty continuations (EOS at once) carry no signal and are dropped.
    """
    jobs: list[tuple[list[int], SamplingParams]] = []
    for i, p in enumerate(prompts):
        jobs.append((p, SamplingParams(max_tokens=max_new_tokens, temperature=0.0)))
        for j in range(samples_per_prompt):
            jobs.append((p, SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                           seed=seed * 1_000_003 + i * 1009 + j)))
    seqs: list[DistillSequence] = []
    bar = tqdm(total=len(jobs), desc="teacher continuations", unit="seq", disable=not progress)
    # Chunks only so the bar moves; the engine batches within a chunk.
    for start in range(0, len(jobs), chunk):
        part = jobs[start:start + chunk]
        for out in llm.generate([p for p, _ in part], [sp for _, sp in part]):
            if out.token_ids:
                seqs.append(DistillSequence(list(out.prompt_token_ids) + list(out.token_ids),
                                            len(out.prompt_token_ids)))
        bar.update(len(part))
    bar.close()
    return seqs


def load_teacher(path: str | Path, device: torch.device) -> PreTrainedModel:
    """The target as an HF model (the project's reference implementation), frozen. float32 weights: on GPU the
    trainer runs it under bf16 autocast, on CPU float32 is the fast path anyway."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    return model


@dataclass
class TopK:
    """A sequence's teacher distributions, truncated to the k most likely tokens per scored position."""

    logprobs: torch.Tensor  # [num_targets, k] float16, log-probabilities under the full distribution
    token_ids: torch.Tensor  # [num_targets, k] int32


@torch.no_grad()
def precompute_topk(teacher: PreTrainedModel, seqs: Sequence[DistillSequence], k: int, batch_size: int,
                    max_len: int, pad_id: int, device: torch.device, progress: bool = True) -> list[TopK]:
    """Top-k teacher log-probabilities for every scored position of every sequence, computed once.

    For CPU training: the teacher's 30-layer forward then runs once per sequence instead of once per step, and
    k=64 entries per position keep nearly all of the probability mass of a peaked instruct model at 1/768 of the
    memory of full 49152-wide rows.
    """
    out: list[TopK] = []
    bar = tqdm(total=len(seqs), desc="teacher top-k", unit="seq", disable=not progress)
    for start in range(0, len(seqs), batch_size):
        part = seqs[start:start + batch_size]
        batch = collate(part, pad_id, max_len).to(device)
        with autocast(device):
            logp = torch.log_softmax(logits_at_targets(teacher, batch), dim=-1)
        vals, idx = logp.topk(k, dim=-1)
        counts = batch.loss_mask.sum(dim=1).tolist()
        for v, i in zip(vals.split(counts), idx.split(counts)):
            out.append(TopK(v.half().cpu(), i.int().cpu()))
        bar.update(len(part))
    bar.close()
    return out

