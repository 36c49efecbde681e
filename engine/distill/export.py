"""Write a trained student as the HF directory the engine loads as a draft: config.json, safetensors of the
student's own tensors, and the target's tokenizer files (a draft must tokenize as its target does)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.distill.student import Student
from engine.models.loader import SHARED_FROM_KEY, SHARED_TENSORS_KEY

# Tokenizer files HF tokenizers may consist of; whichever the target has are copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def export_draft(student: Student, out_dir: Path, target_dir: Path, shared_from: str | None,
                 dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """Write the draft into `out_dir` (created; files of the same names replaced) and return the files written.

    `shared_from` is what the engine's loader resolves to find the shared tensors (a bundled name, or a path);
    None stores them in the draft instead. bf16 halves the size and is what the engine serves in on GPU; the
    engine upcasts on CPU.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    state = student.trainable_state() if shared_from else _full_state(student)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    written = [out_dir / "model.safetensors"]
    save_file(tensors, str(written[0]), metadata={"format": "pt"})
    cfg = student.model.config.to_diff_dict()  # what differs from the class defaults, as save_pretrained writes
    cfg["model_type"] = student.model.config.model_type
    for k in ("_name_or_path", "_model_name_or_path"):  # the target's checkpoint name, not the draft's
        cfg.pop(k, None)
    cfg["architectures"] = [type(student.model).__name__]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    if shared_from:
        cfg[SHARED_FROM_KEY] = shared_from
        cfg[SHARED_TENSORS_KEY] = list(student.shared)
    written.append(out_dir / "config.json")
    written[-1].write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)
            written.append(out_dir / name)
    _apply_umask(written)
    return written


def _apply_umask(files: list[Path]) -> None:
    """safetensors writes 0o600 files; a draft directory is meant to be shared (a cache, a package)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in files:
        f.chmod(0o666 & ~umask)


def _full_state(student: Student) -> dict[str, torch.Tensor]:
    """Every tensor, shared ones included (a self-contained draft); a tied head is stored once, as HF does."""
    sd = student.model.state_dict()
    if student.model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd
