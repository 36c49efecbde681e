"""`specserve distill`: train a draft for a target (engine/distill), save it, and report its acceptance."""

from __future__ import annotations

import argparse
from pathlib import Path

_LAYER_TYPE_ALIASES = {"full": "full_attention", "sliding": "sliding_attention",
                       "full_attention": "full_attention", "sliding_attention": "sliding_attention"}


def _add_distill_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `distill` subcommand on the CLI's subparsers."""
    p = sub.add_parser("distill", help="distill a small draft model for a target and measure its acceptance",
                       description="Generate the target's continuations of the project's prompt set, train a small "
                                   "draft on the target's distributions (KL), save it as a directory that "
                                   "--draft-model loads, and measure its acceptance on the eval prompts.")
    p.add_argument("--target", default="smollm2-135m-instruct", help="bundled name, HF directory or .gguf path")
    p.add_argument("--out", required=True, type=Path, help="directory to write the draft into")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="data, checkpoints and logs (default: OUT/distill_work)")
    p.add_argument("--resume", action="store_true", help="continue from the work directory's data and checkpoint")
    p.add_argument("--data-only", action="store_true",
                   help="stop once the teacher data is in the work directory (then --resume trains on it)")
    g = p.add_argument_group("draft shape (default: the target's, with 2 layers)")
    g.add_argument("--layers", type=int, default=2, help="decoder layers (started from evenly spaced target layers)")
    g.add_argument("--hidden-size", type=int, default=None,
                   help="the target's (default) shares its embeddings and starts from its layers")
    g.add_argument("--intermediate-size", type=int, default=None)
    g.add_argument("--num-heads", type=int, default=None)
    g.add_argument("--num-kv-heads", type=int, default=None)
    g.add_argument("--layer-types", default=None,
                   help="comma-separated per layer: full or sliding (e.g. sliding,full); default: the source layers'")
    g.add_argument("--sliding-window", type=int, default=None, help="window of sliding layers (default: target's)")
    g = p.add_argument_group("data")
    g.add_argument("--num-prompts", type=int, default=None, help="training prompts to use (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens per teacher continuation")
    g.add_argument("--samples-per-prompt", type=int, default=1,
                   help="continuations sampled at --sample-temperature per prompt, besides the greedy one")
    g.add_argument("--sample-temperature", type=float, default=0.7)
    g.add_argument("--generation-max-num-seqs", type=int, default=None,
                   help="engine batch for the teacher's continuations (default: 512 on GPU, 64 on CPU)")
    g.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="also ask the target to write N user prompts of its own (through its chat template) and "
                        "train on its answers to them; unfinished, short and repeated ones are dropped")
    g.add_argument("--self-prompt-samples", type=int, default=1,
                   help="continuations sampled per self-written prompt, besides the greedy one")
    g.add_argument("--self-prompt-max-tokens", type=int, default=96, help="longest self-written prompt, in tokens")
    g.add_argument("--teacher-topk", type=int, default=None,
                   help="0: live full teacher distributions; K: precomputed top-K (default: 0 on GPU, 64 on CPU)")
    g.add_argument("--val-every", type=int, default=20,
                   help="hold out every N-th training prompt to validate on and keep the best weights (0: off)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=5e-4)
    g.add_argument("--max-seq-len", type=int, default=512)
    g.add_argument("--checkpoint-every", type=int, default=200)
    g.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                   help="cut --steps to what fits this many minutes of training (measured over the first steps)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of the saved draft")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=None, help="eval prompts to measure on (default all, 0: skip)")
    g.add_argument("--eval-max-tokens", type=int, default=128)
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_distill)
    return p


def _distill(args: argparse.Namespace) -> int:
    from engine.distill.pipeline import DistillConfig, run_distill
    from engine.distill.student import StudentSpec
    from engine.distill.trainer import TrainConfig

    layer_types = None
    if args.layer_types:
        names = [t.strip() for t in args.layer_types.split(",")]
        bad = [t for t in names if t not in _LAYER_TYPE_ALIASES]
        if bad:
            raise ValueError(f"--layer-types: unknown {bad}; use full or sliding, comma-separated")
        layer_types = [_LAYER_TYPE_ALIASES[t] for t in names]
    spec = StudentSpec(num_layers=args.layers, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                       num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, layer_types=layer_types,
                       sliding_window=args.sliding_window)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_seq_len=args.max_seq_len,
                        checkpoint_every=args.checkpoint_every, seed=args.seed,
                        time_budget_s=args.time_budget * 60 if args.time_budget is not None else None)
    cfg = DistillConfig(target=args.target, out=args.out, spec=spec, train=train, max_new_tokens=args.max_new_tokens,
                        num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                        sample_temperature=args.sample_temperature, teacher_topk=args.teacher_topk,
                        val_every=args.val_every, eval_prompts=args.eval_prompts, eval_max_tokens=args.eval_max_tokens,
                        num_speculative_tokens=args.num_speculative_tokens, device=args.device, dtype=args.dtype,
                        seed=args.seed, work_dir=args.work_dir, resume=args.resume, progress=not args.no_progress,
                        generation_max_num_seqs=args.generation_max_num_seqs, self_prompts=args.self_prompts,
                        self_prompt_samples=args.self_prompt_samples,
                        self_prompt_max_tokens=args.self_prompt_max_tokens, data_only=args.data_only)
    report = run_distill(cfg)
    print(report.summary(args.num_speculative_tokens))
    return 0
