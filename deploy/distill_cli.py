"""`specserve distill`: train a draft for a target (engine/distill), save it, and report its acceptance."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from engine.config import option_default

# A flag not given is absent from the namespace: the field it sets keeps its dataclass's default (DistillConfig,
# TrainConfig, StudentSpec in engine/distill), declared there only.
_UNSET = argparse.SUPPRESS
# Flags -> the fields they set, besides DistillConfig's own of the same name.
_STUDENT_FLAGS = {"layers": "num_layers", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                  "num_heads": "num_heads", "num_kv_heads": "num_kv_heads", "layer_types": "layer_types",
                  "sliding_window": "sliding_window"}
_TRAIN_FLAGS = {"steps": "steps", "batch_size": "batch_size", "lr": "lr", "max_seq_len": "max_seq_len",
                "checkpoint_every": "checkpoint_every", "seed": "seed"}
_LAYER_TYPE_ALIASES = {"full": "full_attention", "sliding": "sliding_attention",
                       "full_attention": "full_attention", "sliding_attention": "sliding_attention"}


def _add_distill_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `distill` subcommand on the CLI's subparsers."""
    p = sub.add_parser("distill", help="distill a small draft model for a target and measure its acceptance",
                       description="Generate the target's continuations of the project's prompt set, train a small "
                                   "draft on the target's distributions (KL), save it as a directory that "
                                   "--draft-model loads, and measure its acceptance on the eval prompts.")
    p.add_argument("--target", default=option_default("model"), help="bundled name, HF directory or .gguf path")
    p.add_argument("--out", required=True, type=Path, help="directory to write the draft into")
    p.add_argument("--work-dir", type=Path, default=_UNSET,
                   help="data, checkpoints and logs (default: OUT/distill_work)")
    p.add_argument("--resume", action="store_true", default=_UNSET,
                   help="continue from the work directory's data and checkpoint")
    p.add_argument("--data-only", action="store_true", default=_UNSET,
                   help="stop once the teacher data is in the work directory (then --resume trains on it)")
    g = p.add_argument_group("draft shape (default: the target's, with 2 layers)")
    g.add_argument("--layers", type=int, default=_UNSET,
                   help="decoder layers (started from evenly spaced target layers)")
    g.add_argument("--hidden-size", type=int, default=_UNSET,
                   help="the target's (default) shares its embeddings and starts from its layers")
    g.add_argument("--intermediate-size", type=int, default=_UNSET)
    g.add_argument("--num-heads", type=int, default=_UNSET)
    g.add_argument("--num-kv-heads", type=int, default=_UNSET)
    g.add_argument("--layer-types", default=_UNSET,
                   help="comma-separated per layer: full or sliding (e.g. sliding,full); default: the source layers'")
    g.add_argument("--sliding-window", type=int, default=_UNSET, help="window of sliding layers (default: target's)")
    g = p.add_argument_group("data")
    g.add_argument("--num-prompts", type=int, default=_UNSET, help="training prompts to use (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=_UNSET, help="tokens per teacher continuation")
    g.add_argument("--samples-per-prompt", type=int, default=_UNSET,
                   help="continuations sampled at --sample-temperature per prompt, besides the greedy one")
    g.add_argument("--sample-temperature", type=float, default=_UNSET)
    g.add_argument("--generation-max-num-seqs", type=int, default=_UNSET,
                   help="engine batch for the teacher's continuations (default: 512 on GPU, 64 on CPU)")
    g.add_argument("--self-prompts", type=int, default=_UNSET, metavar="N",
                   help="also ask the target to write N user prompts of its own (through its chat template) and "
                        "train on its answers to them; unfinished, short and repeated ones are dropped")
    g.add_argument("--self-prompt-samples", type=int, default=_UNSET,
                   help="continuations sampled per self-written prompt, besides the greedy one")
    g.add_argument("--self-prompt-max-tokens", type=int, default=_UNSET, help="longest self-written prompt, in tokens")
    g.add_argument("--teacher-topk", type=int, default=_UNSET,
                   help="0: live full teacher distributions; K: precomputed top-K (default: 0 on GPU, 64 on CPU)")
    g.add_argument("--val-every", type=int, default=_UNSET,
                   help="hold out every N-th training prompt to validate on and keep the best weights (0: off)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=_UNSET)
    g.add_argument("--batch-size", type=int, default=_UNSET)
    g.add_argument("--lr", type=float, default=_UNSET)
    g.add_argument("--max-seq-len", type=int, default=_UNSET)
    g.add_argument("--checkpoint-every", type=int, default=_UNSET)
    g.add_argument("--time-budget", type=float, default=_UNSET, metavar="MINUTES",
                   help="cut --steps to what fits this many minutes of training (measured over the first steps)")
    g.add_argument("--device", default=_UNSET, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--seed", type=int, default=_UNSET)
    g.add_argument("--dtype", default=_UNSET, choices=["bfloat16", "float16", "float32"],
                   help="of the saved draft")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=_UNSET,
                   help="eval prompts to measure on (default all, 0: skip)")
    g.add_argument("--eval-max-tokens", type=int, default=_UNSET)
    g.add_argument("--num-speculative-tokens", type=int, default=_UNSET)
    g.add_argument("--no-progress", action="store_false", dest="progress", default=_UNSET, help="no progress bars")
    p.set_defaults(func=_distill)
    return p


def _distill(args: argparse.Namespace) -> int:
    from engine.distill.pipeline import DistillConfig, run_distill
    from engine.distill.student import StudentSpec
    from engine.distill.trainer import TrainConfig

    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose")}
    if given.get("layer_types"):
        names = [t.strip() for t in given["layer_types"].split(",")]
        bad = [t for t in names if t not in _LAYER_TYPE_ALIASES]
        if bad:
            raise ValueError(f"--layer-types: unknown {bad}; use full or sliding, comma-separated")
        given["layer_types"] = [_LAYER_TYPE_ALIASES[t] for t in names]
    elif "layer_types" in given:
        given["layer_types"] = None
    spec = StudentSpec(**{field: given.pop(flag) for flag, field in _STUDENT_FLAGS.items() if flag in given})
    train = {field: given[flag] for flag, field in _TRAIN_FLAGS.items() if flag in given}
    for flag in _TRAIN_FLAGS:
        if flag != "seed":  # the seed is the run's too
            given.pop(flag, None)
    if "time_budget" in given:
        train["time_budget_s"] = given.pop("time_budget") * 60
    cfg = DistillConfig(spec=spec, train=TrainConfig(**train), **given)
    report = run_distill(cfg)
    print(report.summary(cfg.num_speculative_tokens))
    return 0
