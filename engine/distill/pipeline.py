"""`specserve distill` end to end: teacher data -> student -> training -> draft directory -> acceptance.

Everything a run produces besides the draft (generated data, top-k cache, trainer checkpoint, logs) goes to a
work directory, so `--out` holds only what the engine loads and a run can be resumed from its last checkpoint.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.config import option_default, resolve_device
from engine.distill.data import (
    DistillSequence,
    encode_prompt,
    load_prompts,
    load_sequences,
    save_atomic,
    save_sequences,
)
from engine.distill.evaluate import Acceptance, format_acceptance, measure_acceptance
from engine.distill.export import export_draft
from engine.distill.self_prompts import chat_frame, synthesize_prompts
from engine.distill.student import StudentSpec, build_student
from engine.distill.teacher import TopK, generate_continuations, load_teacher, precompute_topk
from engine.distill.trainer import TrainConfig, Trainer, TrainResult
from engine.llm import LLM, load_tokenizer
from engine.model_config import ModelConfig
from engine.models.source import BUNDLED_MODELS, resolve_model

logger = logging.getLogger("specserve")


@dataclass
class DistillConfig:
    target: str  # bundled name, HF directory or .gguf, as LLM(model=...) takes it
    out: Path  # the draft directory
    spec: StudentSpec = field(default_factory=StudentSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    max_new_tokens: int = 128  # per teacher continuation
    num_prompts: int | None = None  # training prompts used (None: all)
    samples_per_prompt: int = 1  # sampled continuations per prompt, besides the greedy one
    sample_temperature: float = 0.7
    teacher_topk: int | None = None  # 0: live full distributions; k: precomputed top-k; None: 0 on GPU, 64 on CPU
    val_every: int = 20  # every n-th training prompt is held out to validate on (0: none); eval stays unseen
    eval_prompts: int | None = None  # eval prompts for the acceptance check (None: all; 0: skip it)
    eval_max_tokens: int = 128
    # The engine's options for the acceptance check and the teacher: their defaults are the engine's.
    num_speculative_tokens: int = option_default("num_speculative_tokens")
    device: str | None = option_default("device")
    dtype: str = "bfloat16"  # of the saved draft
    seed: int = 0
    work_dir: Path | None = None  # None: <out>/distill_work
    resume: bool = False
    progress: bool = True
    generation_max_num_seqs: int | None = None  # engine batch for the teacher's continuations (None: 512 GPU, 64 CPU)
    # Prompts the target writes itself (engine/distill/self_prompts.py), on top of the hand-written set: how many
    # to ask for (fewer are kept: unfinished, too short and repeated ones are dropped), how many sampled
    # continuations each gets besides the greedy one, and how long a written prompt may be.
    self_prompts: int = 0
    self_prompt_samples: int = 1
    self_prompt_max_tokens: int = 96
    data_only: bool = False  # stop once the teacher data is saved (a later --resume trains on it)


@dataclass
class DistillReport:
    out: Path
    num_sequences: int
    num_target_tokens: int  # scored positions in the training data
    train: TrainResult
    acceptance: list[Acceptance]
    seconds: dict[str, float]  # per phase: data, train, eval

    def summary(self, k: int) -> str:
        lines = [f"draft written to {self.out}" if self.train.losses else "teacher data only (no draft written)",
                 f"data: {self.num_sequences} sequences, {self.num_target_tokens} scored tokens "
                 f"({self.seconds.get('data', 0):.0f} s)"]
        if self.train.losses:
            lines.append(f"train: steps {self.train.start_step}->{len(self.train.losses)}, KL first "
                         f"{_mean(self.train.losses[:10]):.3f} -> last {_mean(self.train.losses[-10:]):.3f} "
                         f"({self.seconds.get('train', 0):.0f} s)")
        if self.train.validation:
            v = min(self.train.validation, key=lambda r: r["kl"])
            lines.append(f"validation (held-out train prompts): best KL {v['kl']:.3f}, top-1 agreement "
                         f"{v['top1']:.3f} at step {v['step']:.0f} (kept)")
        if self.acceptance:
            lines.append(f"acceptance on the eval split, k={k} ({self.seconds.get('eval', 0):.0f} s):")
            lines.append(format_acceptance(self.acceptance, k))
        return "\n".join(lines)


def run_distill(cfg: DistillConfig) -> DistillReport:
    device = resolve_device(cfg.device)
    cfg.spec.validate()
    cfg.train.validate()
    save_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(cfg.dtype)
    if save_dtype is None:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")
    topk = cfg.teacher_topk if cfg.teacher_topk is not None else (0 if device.type == "cuda" else 64)
    out = Path(cfg.out)
    work = Path(cfg.work_dir) if cfg.work_dir is not None else out / "distill_work"
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_model(cfg.target).path
    target_cfg = ModelConfig.from_path(target_dir)
    tokenizer = load_tokenizer(str(target_dir))
    seconds: dict[str, float] = {}

    t0 = time.perf_counter()
    prompts = [encode_prompt(p, tokenizer, target_cfg.vocab_size)  # type: ignore[arg-type]
               for p in load_prompts("train", cfg.num_prompts)]
    data = _teacher_data(cfg, device, work, prompts, target_cfg, tokenizer)
    seqs = [s for s in data.seqs if s.prompt_len < cfg.train.max_seq_len]
    seconds["data"] = time.perf_counter() - t0
    if cfg.data_only:
        logger.info("teacher data saved in %s; --resume without --data-only trains on it", work)
        return DistillReport(out, len(seqs), sum(s.num_targets for s in seqs), TrainResult(), [], seconds)

    teacher = load_teacher(target_dir, device)
    student = build_student(teacher, cfg.spec, cfg.seed)
    pad_id = _pad_id(teacher.config)
    cached_topk: list[TopK] | None = None
    if topk > 0:
        cached_topk = _topk_cache(cfg, teacher, seqs, topk, pad_id, device, work)
        del teacher
        teacher = None
        _free(device)
    # Validation holds out whole prompts (all their continuations), so it measures prompts never trained on.
    held = {tuple(p) for group in (prompts, data.self_prompts) for i, p in enumerate(group)
            if cfg.val_every and i % cfg.val_every == cfg.val_every - 1}
    is_val = [tuple(s.token_ids[:s.prompt_len]) in held for s in seqs]
    train_idx = [i for i, v in enumerate(is_val) if not v]
    val_idx = [i for i, v in enumerate(is_val) if v]
    trainer = Trainer(student, [seqs[i] for i in train_idx], cfg.train, device, pad_id, teacher=teacher,
                      topk=[cached_topk[i] for i in train_idx] if cached_topk is not None else None,
                      checkpoint_dir=work, progress=cfg.progress, val_seqs=[seqs[i] for i in val_idx],
                      val_topk=[cached_topk[i] for i in val_idx] if cached_topk is not None else None)
    if cfg.resume:
        trainer.load_checkpoint()
    t0 = time.perf_counter()
    result = trainer.train()
    seconds["train"] = time.perf_counter() - t0
    # Drafts of a bundled target name it, so they load wherever the bundle is installed; others use the path.
    shared_from = None
    if student.shared:
        shared_from = cfg.target if cfg.target in BUNDLED_MODELS else str(target_dir.resolve())
    export_draft(student, out, target_dir, shared_from, save_dtype)
    del trainer, student, teacher
    _free(device)

    acceptance: list[Acceptance] = []
    if cfg.eval_prompts != 0:
        t0 = time.perf_counter()
        acceptance = evaluate_draft(cfg.target, str(out), tokenizer, target_cfg.vocab_size, device,
                                    cfg.num_speculative_tokens, cfg.eval_max_tokens, cfg.eval_prompts, cfg.seed)
        seconds["eval"] = time.perf_counter() - t0
    report = DistillReport(out, len(train_idx), sum(seqs[i].num_targets for i in train_idx), result, acceptance,
                           seconds)
    (work / "report.json").write_text(json.dumps(
        {"config": _jsonable(asdict(cfg)), "num_sequences": report.num_sequences,
         "num_target_tokens": report.num_target_tokens, "num_self_prompts": len(data.self_prompts),
         "losses": result.losses, "seconds": seconds,
         "validation": result.validation, "best_step": result.best_step,
         "acceptance": [a.as_dict() for a in acceptance], "device": str(device)}, indent=1))
    return report


def evaluate_draft(target: str, draft: str, tokenizer: object, vocab_size: int, device: torch.device, k: int,
                   max_tokens: int, num_prompts: int | None, seed: int) -> list[Acceptance]:
    """Acceptance on the eval split at T=0 and T=0.7, probabilistic rejection sampling (the serving default)."""
    prompts = [encode_prompt(p, tokenizer, vocab_size) for p in load_prompts("eval", num_prompts)]  # type: ignore
    llm = LLM(model=target, draft_model=draft, num_speculative_tokens=k, device=device, seed=seed)
    try:
        return [measure_acceptance(llm, prompts, t, max_tokens, seed) for t in (0.0, 0.7)]
    finally:
        del llm
        _free(device)


@dataclass
class TeacherData:
    seqs: list[DistillSequence]  # every prompt's continuations: hand-written prompts' first
    self_prompts: list[list[int]]  # the prompts the target wrote, framed by its chat template


def _teacher_data(cfg: DistillConfig, device: torch.device, work: Path, prompts: list[list[int]],
                  target_cfg: ModelConfig, tokenizer: object) -> TeacherData:
    """The target's continuations of the hand-written prompts and of the prompts it writes itself. Each part is
    saved as it is made (`--resume` picks up from there): the written prompts, then continuation shards."""
    path = work / "data.pt"
    self_path = work / "self_prompts.pt"
    if cfg.resume and path.is_file():
        logger.info("reusing the teacher data in %s", path)
        return TeacherData(load_sequences(path), torch.load(self_path) if self_path.is_file() else [])
    if not cfg.resume:  # a fresh run must not pick up another run's shards
        for old in (work / "shards").glob("*/*.pt") if (work / "shards").is_dir() else ():
            old.unlink()
        self_path.unlink(missing_ok=True)
    max_seqs = cfg.generation_max_num_seqs or (512 if device.type == "cuda" else 64)
    # Prefill chunks as large as a batch's prompts: a step then admits a whole wave of new requests.
    llm = LLM(model=cfg.target, device=device, seed=cfg.seed, max_num_seqs=max_seqs,
              max_num_batched_tokens=max(2048, 16 * max_seqs))
    try:
        written: list[list[int]] = []
        if cfg.self_prompts:
            if self_path.is_file():
                written = torch.load(self_path)
            else:
                frame = chat_frame(tokenizer, getattr(target_cfg.hf_config, "bos_token_id", None),  # type: ignore
                                   target_cfg.eos_token_ids)
                # The eval split must stay unseen, and a hand-written prompt needs no second copy.
                evals = [encode_prompt(p, tokenizer, target_cfg.vocab_size)  # type: ignore[arg-type]
                         for p in load_prompts("eval")]
                written = synthesize_prompts(llm, frame, cfg.self_prompts, cfg.self_prompt_max_tokens,
                                             exclude=[*evals, *prompts], progress=cfg.progress)
                save_atomic(written, self_path)
        seqs = generate_continuations(llm, prompts, cfg.max_new_tokens, cfg.samples_per_prompt,
                                      cfg.sample_temperature, shard_dir=work / "shards" / "hand",
                                      progress=cfg.progress)
        if written:
            seqs += generate_continuations(llm, written, cfg.max_new_tokens, cfg.self_prompt_samples,
                                           cfg.sample_temperature, shard_dir=work / "shards" / "self",
                                           progress=cfg.progress, desc="continuations of written prompts")
    finally:
        del llm
        _free(device)
    save_sequences(seqs, path)
    return TeacherData(seqs, written)


def _topk_cache(cfg: DistillConfig, teacher: torch.nn.Module, seqs: list[DistillSequence], k: int, pad_id: int,
                device: torch.device, work: Path) -> list[TopK]:
    path = work / f"topk{k}.pt"
    if cfg.resume and path.is_file():
        return [TopK(lp, ids) for lp, ids in torch.load(path)]
    topk = precompute_topk(teacher, seqs, k, cfg.train.batch_size, cfg.train.max_seq_len, pad_id, device,
                           cfg.progress)  # type: ignore[arg-type]
    save_atomic([(t.logprobs, t.token_ids) for t in topk], path)
    return topk


def _pad_id(hf_config: object) -> int:
    """Padding only fills masked positions; any valid id works, the model's own pad id if it has one."""
    pad = getattr(hf_config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _jsonable(d: dict) -> dict:
    return {k: (_jsonable(v) if isinstance(v, dict) else str(v) if isinstance(v, Path) else v) for k, v in d.items()}
