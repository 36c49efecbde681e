"""The teacher side of distillation: what the target writes after each prompt, and its next-token
distributions over prompt + continuation."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.distill.data import DistillSequence, collate, load_sequences, save_sequences
from engine.distill.logits import autocast, logits_at_targets
from engine.llm import LLM
from engine.request import SamplingParams

logger = logging.getLogger("specserve")


def generate_continuations(llm: LLM, prompts: Sequence[list[int]], max_new_tokens: int, samples_per_prompt: int = 1,
                           temperature: float = 0.7, chunk: int = 4096, shard_dir: Path | None = None,
                           progress: bool = True, desc: str = "teacher continuations") -> list[DistillSequence]:
    """Per prompt: the target's greedy continuation, then `samples_per_prompt` samples at `temperature`.

    Both kinds matter: served traffic is greedy and sampled alike, and a draft trained only on greedy text never
    sees the less likely turns a sampled request takes. Sampling follows the engine's seed, not a seed per
    request: per-request generators cost a kernel per row per step, which at thousands of rows is most of a
    step. Empty continuations (EOS at once) carry no signal and are dropped.

    With `shard_dir`, each chunk of jobs is saved as it finishes and chunks already there are loaded instead of
    generated, so a run stopped part-way (a time limit, a lost machine) resumes at its last chunk.
    """
    jobs: list[tuple[list[int], SamplingParams]] = []
    for p in prompts:
        jobs.append((p, SamplingParams(max_tokens=max_new_tokens, temperature=0.0, detokenize=False)))
        for _ in range(samples_per_prompt):
            jobs.append((p, SamplingParams(max_tokens=max_new_tokens, temperature=temperature, detokenize=False)))
    if shard_dir is not None:
        shard_dir.mkdir(parents=True, exist_ok=True)
    seqs: list[DistillSequence] = []
    bar = tqdm(total=len(jobs), desc=desc, unit="seq", disable=not progress)
    generated = 0
    t0 = time.perf_counter()
    # The engine batches within a chunk; a chunk several times the engine's batch keeps its tail (the last,
    # longest requests running nearly alone) short next to the rest.
    for start in range(0, len(jobs), chunk):
        part = jobs[start:start + chunk]
        shard = shard_dir / f"part-{start:08d}-{len(part)}.pt" if shard_dir is not None else None
        if shard is not None and shard.is_file():
            seqs.extend(load_sequences(shard))
            bar.update(len(part))
            continue
        new = []
        for out in llm.generate([p for p, _ in part], [sp for _, sp in part]):
            generated += len(out.token_ids)
            if out.token_ids:
                new.append(DistillSequence(list(out.prompt_token_ids) + list(out.token_ids),
                                           len(out.prompt_token_ids)))
        if shard is not None:
            save_sequences(new, shard)
        seqs.extend(new)
        bar.update(len(part))
        logger.info("%s: %d of %d done, %.0f tokens/s", desc, start + len(part), len(jobs),
                    generated / (time.perf_counter() - t0))
    bar.close()
    seconds = time.perf_counter() - t0
    if generated:
        logger.info("%s: %d tokens generated in %.0f s (%.0f tokens/s)", desc, generated, seconds,
                    generated / seconds)
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

