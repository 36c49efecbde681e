"""The distillation data: the project's prompt set, its tokenisation, and padded training batches."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

PROMPTS_DIR = Path(__file__).parent / "prompts"
SPLITS = ("train", "eval")


def load_prompts(split: str, limit: int | None = None) -> list[str]:
    """The committed prompts of `split` ("train" or "eval"; eval prompts never appear in train)."""
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; use one of {SPLITS}")
    with open(PROMPTS_DIR / f"{split}.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:limit] if limit is not None else prompts


def encode_prompt(text: str, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                  chat: bool = True) -> list[int]:
    """Token ids the target sees for `text`: the chat template when the tokenizer has one (instruct targets are
    served that way, so the draft must learn that distribution), else plain tokenisation.

    Without a tokenizer (random-weight test targets) characters map to ids in [3, vocab_size), skipping the
    usual pad/BOS/EOS ids 0-2: any fixed, varied mapping will do for a model that has no language anyway.
    """
    if tokenizer is None:
        if vocab_size <= 3:
            raise ValueError(f"vocab_size={vocab_size} leaves no ids for the character fallback tokenisation")
        return [3 + ord(c) % (vocab_size - 3) for c in text]
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return list(tokenizer(text)["input_ids"])


@dataclass
class DistillSequence:
    """One training example: a prompt and the target's continuation of it."""

    token_ids: list[int]  # prompt + continuation
    prompt_len: int

    @property
    def num_targets(self) -> int:
        """Positions whose next token is a continuation token: the ones the loss scores."""
        return len(self.token_ids) - self.prompt_len


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T] int64; 1 = real token
    loss_mask: torch.Tensor  # [B, T] bool; True where position t predicts continuation token t + 1

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))


def collate(seqs: Sequence[DistillSequence], pad_id: int, max_len: int) -> Batch:
    """Right-pad `seqs` into one batch. Sequences longer than `max_len` keep their first `max_len` tokens
    (continuations are scored left to right, so cutting the tail keeps every remaining target's context)."""
    lens = [min(len(s.token_ids), max_len) for s in seqs]
    t = max(lens)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.int64)
    attn = torch.zeros((len(seqs), t), dtype=torch.int64)
    loss = torch.zeros((len(seqs), t), dtype=torch.bool)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        ids[i, :n] = torch.tensor(s.token_ids[:n])
        attn[i, :n] = 1
        loss[i, s.prompt_len - 1:n - 1] = True
    return Batch(ids, attn, loss)


def save_atomic(obj: object, path: Path) -> None:
    """torch.save through a temporary file and a rename: a killed run never leaves a half-written file that
    --resume would trust."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def save_sequences(seqs: Sequence[DistillSequence], path: Path) -> None:
    """One flat int32 tensor of every token plus the lengths: a few bytes a token, where a pickled list of Python
    ints takes several times that (millions of teacher tokens are tens of MB)."""
    flat = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int32)
    lengths = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64)
    prompt_lens = torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64)
    save_atomic({"tokens": flat, "lengths": lengths, "prompt_lens": prompt_lens}, path)


def load_sequences(path: Path) -> list[DistillSequence]:
    data = torch.load(path)
    rows = data["tokens"].split(data["lengths"].tolist())
    return [DistillSequence(r.tolist(), n) for r, n in zip(rows, data["prompt_lens"].tolist())]
