"""The target alone and a draft model pair under each way of scheduling a step, in one process and interleaved:
round after round every engine runs the same batch once, so that whatever slows the host for a while (a busy
neighbour, a clock change) falls on every engine alike. Separate processes of one configuration measured 30% apart
on one GPU (gemma-3-1b alone at batch 32: 12107 and 15892 tok/s, 2026-12-06), more than the differences asked
about here.

Modes (each an engine of its own, random weights):
- alone, alone_sync: the target alone, its steps queued one ahead (asynchronous scheduling, the GPU default) or not;
- k0, k0_sync: the pair with a static schedule of k = 0 (the draft never runs): what a step without speculation
  costs beside a draft;
- fixed, fixed_sync: the pair at k = --k every step (the draft length rule off);
- rule, rule_sync: the pair with the draft length rule (num_speculative_tokens = --k).

    python3 benchmarks/gpu_spec_modes.py --target gemma3-1b --draft gemma3-270m --batch 1,8,32,64 --k 3

Prints tokens/s a mode and batch (medians of --rounds), each ratio to `alone`, the decode pipeline's counts (steps
queued ahead, and of those queued while the step before still ran on the GPU), and the engine's phase medians of
each mode's decode steps. --profile-batch B also runs each mode once more at batch B under cProfile and writes its
functions by own time, a section a mode, to --profile (what the host spends a step on).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from common import environment, markdown_table, save_json
from gpu_shapes import shape_dir
from gpu_spec import ChoiceLog, PhaseLog, per_position

from engine import LLM, SamplingParams

MODES = ("alone", "alone_sync", "k0", "k0_sync", "fixed", "fixed_sync", "rule", "rule_sync")


def mode_options(mode: str, draft: str, k: int, rate: float) -> dict:
    """LLM options of a mode (see the module docstring)."""
    sync = {"async_scheduling": False} if mode.endswith("_sync") else {}
    base = mode.removesuffix("_sync")
    if base == "alone":
        return sync
    pair = dict(draft_model=draft, num_speculative_tokens=k, rejection_sampling="synthetic",
                synthetic_acceptance_rate=rate, **sync)
    if base == "k0":
        return dict(pair, draft_length_schedule="1:0")
    if base == "fixed":
        # The rule off; asynchronous scheduling then defaults to off too, so the asynchronous mode asks for it.
        return dict(pair, adaptive_draft_length=False, **({} if sync else {"async_scheduling": True}))
    if base == "rule":
        return pair
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="gemma3-1b")
    ap.add_argument("--draft", default="gemma3-270m")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rate", type=float, default=0.7)
    ap.add_argument("--position-rate", action="store_true", help="as gpu_spec.py's: every draft position accepted "
                    "with probability --rate at any k")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV-cache memory of each model of each engine, GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-batch", type=int, default=None)
    ap.add_argument("--profile", default="profile.txt")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.position_rate:
        per_position()
    batches = [int(b) for b in args.batch.split(",")]
    modes = args.modes.split(",")
    common = dict(seed=0, load_format="dummy", device=args.device, max_num_seqs=max(batches),
                  max_model_len=args.context + args.new_tokens + 16, kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
                  cuda_graph_batch_sizes=tuple(batches))
    target, draft = shape_dir(args.target), shape_dir(args.draft)
    llms, phases = {}, {}
    for mode in modes:
        llms[mode] = LLM(target, **mode_options(mode, draft, args.k, args.rate), **common)
        phases[mode] = PhaseLog(llms[mode])
    # The draft length rule's choices and step times, of the first rule mode
    pauses: list[float] = []  # ms of each full (generation 2) garbage collection in the timed rounds
    started: list[float] = []

    def gc_timer(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(gc_timer)
    rule_mode = next((m for m in modes if m.startswith("rule")), None)
    choices = ChoiceLog(llms[rule_mode]) if rule_mode is not None else None
    vocab = llms[modes[0]].engine.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    cuda = args.device.startswith("cuda")
    rows = []
    for b in batches:
        prompts = [torch.randint(0, min(150000, vocab), (args.context,)).tolist() for _ in range(b)]
        for llm in llms.values():  # warm-up: a whole run (the rule settles, as a server that has run a while)
            llm.generate(prompts, params)
        tok_s: dict[str, list[float]] = {m: [] for m in modes}
        for ph in phases.values():
            ph.reset()
            ph.on = True
        if choices is not None:
            choices.reset()
            choices.on = True
        pauses.clear()
        for _ in range(args.rounds):
            for mode, llm in llms.items():
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                tok_s[mode].append(b * args.new_tokens / (time.perf_counter() - t0))
        for ph in phases.values():
            ph.on = False
        if choices is not None:
            choices.on = False
            print(f"batch {b} {rule_mode}: {choices.summary(b)}", flush=True)
            for sw in choices.switches[:12]:
                print(f"  switch at step {sw[0]}: batch {sw[1]}, k {sw[2]} -> {sw[3]}, step ms {sw[4]}, "
                      f"acceptance {sw[5]}", flush=True)
        gc_ms = sorted(pauses, reverse=True)
        print(f"batch {b}: {len(gc_ms)} full garbage collections in the timed rounds, longest ms "
              f"{[round(x, 1) for x in gc_ms[:6]]}", flush=True)
        base = statistics.median(tok_s["alone"]) if "alone" in tok_s else None
        for mode in modes:
            t = statistics.median(tok_s[mode])
            pl = llms[mode].engine.executor.pipeline
            rows.append({"mode": mode, "batch": b, "tok_s": t, "vs_alone": t / base if base else None,
                         "queued_ahead": pl.num_queued_ahead if pl else None,
                         "overlapped": pl.num_overlapped if pl else None, "phases_ms": phases[mode].medians(),
                         **({"choices": choices.summary(b), "trace": choices.trace, "switches": choices.switches}
                            if mode == rule_mode else {})})
            print(f"batch {b} {mode}: {t:.1f} tok/s; phases (ms) {phases[mode].medians()}", flush=True)
    print(markdown_table(rows, ["mode", "batch", "tok_s", "vs_alone", "queued_ahead", "overlapped"]))
    if args.profile_batch is not None:
        prompts = [torch.randint(0, min(150000, vocab), (args.context,)).tolist() for _ in range(args.profile_batch)]
        text = io.StringIO()
        for mode, llm in llms.items():
            llm.generate(prompts, params)
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, params)
            prof.disable()
            text.write(f"=== {mode}, batch {args.profile_batch}\n")
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        Path(args.profile).write_text(text.getvalue())
    save_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
