"""Distillation training: the student learns the teacher's next-token distributions over the continuations.

Loss: KL(teacher || student), summed over the vocabulary and averaged over scored positions. Matching whole
distributions, not just the teacher's sampled token, is what acceptance needs: at temperature T a draft token
is kept with probability min(1, p/q), so the expected acceptance is sum_x min(p(x), q(x)) = 1 - TV(p, q).
The teacher is either live (the full distribution, recomputed each step: cheap on a GPU) or precomputed top-k
(CPU training: one teacher pass in all, and the tail past k is dropped and the head renormalised).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from engine.distill.data import Batch, DistillSequence, collate, save_atomic
from engine.distill.logits import autocast, logits_at_targets
from engine.distill.student import Student
from engine.distill.teacher import TopK

logger = logging.getLogger("specserve")

CHECKPOINT_NAME = "trainer.pt"
# Steps into a run at which a time budget is (re)fitted to the measured step time. The first hundreds of steps
# run slower (new batch shapes, the allocator growing): fitted at step 200 only, a 7-minute budget on an H100
# trained 281 s. The refit at 1000 stretches or shrinks the cosine's remainder, a small jump in the rate.
_FIT_AT = (10, 50, 200, 1000)


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16  # sequences per step
    lr: float = 5e-4
    warmup_steps: int | None = None  # None: 5% of steps
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio, not 0: the last steps still learn
    weight_decay: float = 0.0  # few parameters, teacher-defined targets: nothing to regularise towards
    grad_clip: float = 1.0
    max_seq_len: int = 512
    checkpoint_every: int = 200
    seed: int = 0
    # Wall-clock budget for training: after a few steps the step count is cut to what fits (the cosine schedule
    # then still ends at its floor), and a run that overruns anyway stops at 110% with a checkpoint.
    time_budget_s: float | None = None

    def validate(self) -> None:
        for name in ("steps", "batch_size", "max_seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be positive, got {self.time_budget_s}")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # [steps] KL per step, from step 0 (resumed runs included)
    start_step: int = 0  # where this run began: 0, or the checkpoint's step with --resume
    seconds: float = 0.0  # this run's training time
    validation: list[dict[str, float]] = field(default_factory=list)  # {step, kl, top1} per validation
    best_step: int | None = None  # the step whose weights the student ends with (lowest validation KL)


def kl_full(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher) || softmax(student)); both [N, vocab]."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def kl_topk(student_logits: torch.Tensor, logprobs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """KL from the teacher's renormalised top-k (logprobs, token_ids: [N, k]) to the student's full softmax."""
    s = F.log_softmax(student_logits.float(), dim=-1).gather(1, token_ids.long())
    t = F.log_softmax(logprobs.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def _agreement(student_logits: torch.Tensor, teacher_top1: torch.Tensor) -> torch.Tensor:
    """Fraction of positions where the student's argmax is the teacher's: the draft's acceptance at T=0 for a
    first draft position."""
    return (student_logits.argmax(-1) == teacher_top1).float().mean()


class Trainer:
    """Trains `student` on `seqs` against a live `teacher` or precomputed `topk` (one per sequence)."""

    def __init__(self, student: Student, seqs: Sequence[DistillSequence], cfg: TrainConfig, device: torch.device,
                 pad_id: int, teacher: PreTrainedModel | None = None, topk: Sequence[TopK] | None = None,
                 checkpoint_dir: Path | None = None, progress: bool = True,
                 val_seqs: Sequence[DistillSequence] = (), val_topk: Sequence[TopK] | None = None) -> None:
        cfg.validate()
        if (teacher is None) == (topk is None):
            raise ValueError("give exactly one of teacher (live distributions) or topk (precomputed)")
        if topk is not None and len(topk) != len(seqs):
            raise ValueError(f"{len(topk)} top-k entries for {len(seqs)} sequences")
        if not seqs:
            raise ValueError("no training sequences: the teacher wrote nothing (check the prompts/max_new_tokens)")
        if any(s.prompt_len >= cfg.max_seq_len for s in seqs):
            raise ValueError(f"a prompt fills max_seq_len={cfg.max_seq_len}, leaving nothing to score; raise "
                             "max_seq_len or drop such prompts")
        self.student, self.seqs, self.cfg, self.device = student, list(seqs), cfg, device
        self.pad_id, self.teacher, self.topk = pad_id, teacher, topk
        self.checkpoint_dir, self.progress = checkpoint_dir, progress
        self.model = student.model.to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # fused AdamW: one kernel for all parameters on GPU; the plain loop on CPU, where fused is unsupported.
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98),
                                           fused=device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.step = 0
        self.losses: list[float] = []
        self._perms: dict[int, list[int]] = {}
        # Held-out sequences (from prompts the training never sees): the student keeps the weights that
        # scored best on them, since a few-layer student memorises a few hundred prompts' continuations long
        # before its training loss stops falling.
        self.val_seqs, self.val_topk = list(val_seqs), val_topk
        self.validation: list[dict[str, float]] = []
        self.best: dict | None = None  # {"step", "kl", "model": trainable state on CPU}

    def _lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine from lr down to lr * min_lr_ratio at the last step."""
        cfg = self.cfg
        warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 20)
        if step < warm:
            return (step + 1) / warm
        frac = min(1.0, (step - warm) / max(1, cfg.steps - warm))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    def _batch_indices(self, step: int) -> list[int]:
        """Sequences of `step`: epochs of seeded permutations, a pure function of (seed, step), so a resumed
        run sees exactly the batches the uninterrupted one would have."""
        b, n = self.cfg.batch_size, len(self.seqs)
        out = []
        for g in range(step * b, (step + 1) * b):
            epoch = g // n
            if epoch not in self._perms:
                perm = list(range(n))
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(perm)
                self._perms = {epoch: perm}  # g only grows: earlier epochs are never needed again
            out.append(self._perms[epoch][g % n])
        return out

    def _loss(self, idx: list[int], seqs: Sequence[DistillSequence] | None = None,
              topk: Sequence[TopK] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL, top-1 agreement) of the sequences `idx` of `seqs` (default: the training set)."""
        seqs = self.seqs if seqs is None else seqs
        topk = self.topk if seqs is self.seqs else topk
        batch: Batch = collate([seqs[i] for i in idx], self.pad_id, self.cfg.max_seq_len).to(self.device)
        with autocast(self.device):
            logits = logits_at_targets(self.model, batch)
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = logits_at_targets(self.teacher, batch)
                return kl_full(logits, teacher_logits), _agreement(logits, teacher_logits.argmax(-1))
        assert topk is not None
        lp = torch.cat([topk[i].logprobs for i in idx]).to(self.device)
        ids = torch.cat([topk[i].token_ids for i in idx]).to(self.device)
        return kl_topk(logits, lp, ids), _agreement(logits, ids[:, 0])

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """KL and top-1 agreement with the teacher on the held-out sequences, weighted by scored positions."""
        self.model.eval()
        kl = top1 = 0.0
        n = 0
        for start in range(0, len(self.val_seqs), self.cfg.batch_size):
            idx = list(range(start, min(start + self.cfg.batch_size, len(self.val_seqs))))
            k, a = self._loss(idx, self.val_seqs, self.val_topk)
            m = sum(min(len(self.val_seqs[i].token_ids), self.cfg.max_seq_len) - self.val_seqs[i].prompt_len
                    for i in idx)
            kl, top1, n = kl + k.item() * m, top1 + a.item() * m, n + m  # SYNC: scalars for the log
        self.model.train()
        out = {"step": self.step, "kl": kl / max(n, 1), "top1": top1 / max(n, 1)}
        self.validation.append(out)
        if self.best is None or out["kl"] < self.best["kl"]:
            self.best = {"step": self.step, "kl": out["kl"],
                         "model": {k: v.detach().to("cpu", copy=True) for k, v in
                                   self.student.trainable_state().items()}}
        logger.info("step %d: validation KL %.4f, top-1 agreement %.3f", self.step, out["kl"], out["top1"])
        return out

    def train(self, stop_at: int | None = None) -> TrainResult:
        """Train to `cfg.steps`, or only to step `stop_at` (checkpointed there: a run in slices, or a test of
        --resume)."""
        start_step = self.step
        t0 = time.perf_counter()
        t_probe = t0
        paused = 0.0  # validation and checkpoint time since t_probe: not training steps, left out of their rate
        budget = self.cfg.time_budget_s
        requested = self.cfg.steps
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="distill", unit="step", disable=not self.progress)
        while self.step < self.cfg.steps:
            loss, _ = self._loss(self._batch_indices(self.step))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.losses.append(loss.item())  # SYNC: one scalar per step, for the log and the loss curve
            bar.set_postfix(kl=f"{self.losses[-1]:.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
            bar.update(1)
            done = self.step - start_step
            elapsed = time.perf_counter() - t0
            if budget is not None and done == 1:
                t_probe = time.perf_counter()  # the first step pays one-off costs (allocator, kernels): skip it
                paused = 0.0
            if budget is not None and done in _FIT_AT:
                # Refitted as the run goes: early steps see new batch shapes and run slower than the rest.
                per_step = (time.perf_counter() - t_probe - paused) / (done - 1)
                fit = min(requested, max(self.step, self.step + int((budget - elapsed) / per_step)))
                if fit != self.cfg.steps:
                    logger.warning("time budget %.0f s: %.3f s/step, training %d steps (asked for %d)",
                                   budget, per_step, fit, requested)
                    self.cfg.steps = fit
                    bar.total = fit
            over = (budget is not None and elapsed > 1.1 * budget) or self.step == stop_at
            at_checkpoint = self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps or over
            t_pause = time.perf_counter()
            if at_checkpoint and self.val_seqs:
                self.validate()
            if at_checkpoint and self.checkpoint_dir is not None:
                self.save_checkpoint()
            paused += time.perf_counter() - t_pause
            if over:
                logger.warning("stopped at step %d of %d (time budget or stop_at; checkpointed, --resume continues)",
                               self.step, self.cfg.steps)
                break
        bar.close()
        best_step = None
        sliced = stop_at is not None and self.step == stop_at < self.cfg.steps
        if self.best is not None and not sliced:  # a slice goes on training from the latest weights
            best_step = self.best["step"]
            if best_step != self.step:
                logger.warning("keeping the weights of step %d (validation KL %.4f), not the last step's",
                               best_step, self.best["kl"])
                self.model.load_state_dict(self.best["model"], strict=False)
        return TrainResult(list(self.losses), start_step, time.perf_counter() - t0, list(self.validation), best_step)

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """model (trainable tensors) + optimizer + schedule + step + loss curve, written atomically."""
        assert self.checkpoint_dir is not None
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / CHECKPOINT_NAME
        save_atomic({"step": self.step, "model": self.student.trainable_state(),
                     "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "losses": self.losses, "config": asdict(self.cfg), "validation": self.validation,
                     "best": self.best}, path)
        return path

    def load_checkpoint(self) -> bool:
        """Continue from the checkpoint in `checkpoint_dir`, if any; False if there is none."""
        path = self.checkpoint_dir / CHECKPOINT_NAME if self.checkpoint_dir is not None else None
        if path is None or not path.is_file():
            return False
        ckpt = torch.load(path, map_location=self.device, weights_only=False)
        saved = {k: ckpt["config"].get(k) for k in ("steps", "batch_size", "lr", "max_seq_len", "seed")}
        now = {k: getattr(self.cfg, k) for k in saved}
        if ckpt["config"].get("time_budget_s") is not None and saved["steps"] <= now["steps"]:
            now["steps"] = self.cfg.steps = saved["steps"]  # the budgeted run fixed its step count: keep it
        if saved != now:
            raise ValueError(f"checkpoint {path} was trained with {saved}, this run asks for {now}: resume with "
                             "the same settings, or start afresh in another --out directory")
        missing, unexpected = self.model.load_state_dict(ckpt["model"], strict=False)
        if unexpected or set(missing) - set(self.student.shared) - {"lm_head.weight"}:
            raise ValueError(f"checkpoint {path} does not fit this student (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.step, self.losses = int(ckpt["step"]), list(ckpt["losses"])
        self.validation, self.best = list(ckpt.get("validation", [])), ckpt.get("best")
        logger.info("resumed from %s at step %d", path, self.step)
        return True
