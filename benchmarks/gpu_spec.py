"""Speculative decoding speed on one GPU in synthetic mode (random weights; the acceptance rate is set, so speed
can be measured without a trained pair): a Qwen3-8B-shaped target with a Qwen3-0.6B-shaped draft, acceptance
0.6 and 0.8, k in {2, 4, 6}, batch 1, 8, 32; output tokens/s against the target alone, medians of 3 runs.

    python benchmarks/gpu_spec.py --out results/gpu_spec.json

Fixed-k rows run with the draft length rule off (adaptive_draft_length=False). --rule adds rows "rule": the engine's
default, k chosen each step in 0..max(--k) (engine/speculation/draft_length_rule.py), each with its ratio to the
target alone and to the best fixed k (0..max(--k), k = 0 being the target alone) at that acceptance and batch.
Before its timed runs each row runs --warmup-tokens tokens a request at its batch, untimed: with a whole row there
(the default), the rule's rows measure the choices it settles on, as a server that has run a while makes them;
`--warmup-tokens 8` also times the steps it learns in.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from common import environment, markdown_table, prefix_token_map, save_json
from gpu_shapes import eagle3_head_dir, shape_dir

from engine import LLM, SamplingParams
from engine.kernels.triton_compat import set_pdl
from engine.speculation.draft_cost_model import Acceptance, BucketCosts
from engine.speculation.draft_length_rule import bucket_of


def per_position() -> None:
    """The synthetic acceptance of --position-rate: a benchmark's own setting, so it lives here (the engine's synthetic
    mode keeps vLLM's reading of the rate)."""
    from engine.kernels.speculation import rejection
    from engine.speculation import rejection_sampler

    def same_at_every_k(rate: float, k: int) -> float:
        return float(rate)

    rejection.synthetic_position_rate = same_at_every_k
    rejection_sampler.synthetic_position_rate = same_at_every_k


class ChoiceLog:
    """The draft length rule's choices during the timed runs: k -> steps, and how many were probes."""

    def __init__(self, llm: LLM) -> None:
        self.rule = llm.engine.draft_lengths.rule
        self.on = False
        self.ks: dict[int, int] = {}
        self.probes = 0
        self.samples: dict[int, list[float]] = {}  # k -> the step seconds the rule took in, in order
        # Every committed step in order: (k, probe, timed, catch-up tokens, ms from the commit before it).
        self.trace: list[tuple[int, bool, bool, int, float]] = []
        # Each choice of a new k outside probes: (trace index, batch size, k before, k, the bucket's step ms by k,
        # the acceptance by position), the figures the rule chose from.
        self.switches: list[tuple] = []
        choose = self.rule.choose
        observe_step = self.rule.observe

        def traced(step_id: int, verifies: list, propose_seconds: float | None, drafted: bool = True) -> None:
            p, last = self.rule._planned.get(step_id), self.rule._last_commit
            observe_step(step_id, verifies, propose_seconds, drafted)
            if self.on and p is not None and last is not None:
                ms = round((self.rule._last_commit - last) * 1e3, 3)
                self.trace.append((p.k, p.probe, p.timed, p.catch_up, ms))

        self.rule.observe = traced
        observe = BucketCosts.observe

        def sampled(st: BucketCosts, k: int, seconds: float, propose_seconds: float | None) -> None:
            # The patch is the class's, seen by every rule engine of the process: keep this rule's samples only.
            if self.on and any(st is mine for mine in self.rule.buckets.values()):
                self.samples.setdefault(k, []).append(seconds)
            observe(st, k, seconds, propose_seconds)

        BucketCosts.observe = sampled

        def logged(batch_size: int, catch_up_tokens: int = 0) -> int:
            before = self.rule.last_k
            k = choose(batch_size, catch_up_tokens)
            if self.on and batch_size > 0:
                self.ks[k] = self.ks.get(k, 0) + 1
                self.probes += self.rule._probing
                if k != before and not self.rule._probing:
                    st = self.rule.buckets.get(bucket_of(batch_size))
                    ms = {j: round(t * 1e3, 3) for j in range(self.rule.max_k + 1)
                          if st is not None and (t := st.seconds(j)) is not None}
                    self.switches.append((len(self.trace), batch_size, before, k, ms,
                                          [round(a, 3) for a in self.rule.acceptance.rates(self.rule.max_k)]))
            return k

        self.rule.choose = logged

    def reset(self) -> None:
        self.ks, self.probes, self.samples, self.trace, self.switches = {}, 0, {}, [], []

    def summary(self, batch: int) -> str:
        st = self.rule.buckets.get(bucket_of(batch))
        times = " ".join(f"{k}:{t * 1e3:.2f}" for k in range(self.rule.max_k + 1)
                         if st is not None and (t := st.seconds(k)) is not None)
        taken = "; ".join(f"{k}: {len(v)} median {statistics.median(v) * 1e3:.2f} max {max(v) * 1e3:.2f} first "
                          f"{[round(x * 1e3, 2) for x in v[:6]]}" for k, v in sorted(self.samples.items()))
        return (f"k steps {dict(sorted(self.ks.items()))}, probes {self.probes}; the bucket's step ms {times}; "
                f"acceptance {[round(a, 3) for a in self.rule.acceptance.rates(self.rule.max_k)]}; "
                f"step ms taken in by k: {taken}")


class PhaseLog:
    """The engine's phases of each decode or verify step (at most 8 tokens a request: never a prompt's) during the
    timed runs: medians in ms."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.on = False
        self.steps: list[dict[str, float]] = []
        step = self.engine.step

        def logged(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - the engine's own step
            out = step(*a, **kw)
            last = self.engine.last_step
            if self.on and last.phase_seconds and 0 < last.num_batched_tokens <= 8 * last.num_scheduled:
                self.steps.append(dict(last.phase_seconds))
            return out

        self.engine.step = logged

    def reset(self) -> None:
        self.steps = []

    def medians(self) -> dict[str, float]:
        names = sorted({k for p in self.steps for k in p})
        return {k: round(statistics.median(p.get(k, 0.0) for p in self.steps) * 1e3, 3) for k in names}


def tokens_per_s(llm: LLM, batch: int, context: int, new_tokens: int, repeats: int, warmup_tokens: int,
                 log: ChoiceLog | None = None, phases: PhaseLog | None = None) -> tuple[float, float, float]:
    """(output tokens/s of whole requests, tokens/s of the decode phase after the first token, mean acceptance rate
    over the runs).
    The decode figure leaves out the prefill step (time to first token), which speculation does not change but
    which weighs more against the faster decode."""
    prompts = [torch.randint(0, min(150000, llm.engine.vocab_size), (context,)).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))
    times, first, acc = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        first.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in (log, phases):
            if x is not None:
                x.on = True
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
        for x in (log, phases):
            if x is not None:
                x.on = False
        stats = llm.spec_stats(outs)
        acc.append(stats.acceptance_rate if stats.num_draft_tokens else 0.0)
    total, ttft = statistics.median(times), statistics.median(first)
    return batch * new_tokens / total, batch * (new_tokens - 1) / (total - ttft), statistics.mean(acc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b", help="a draft model's shape, or 'eagle3': an EAGLE-3 head for "
                    "the target's shape (gpu_shapes.eagle3_head_dir)")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--k", default="2,4,6")
    ap.add_argument("--rates", default="0.6,0.8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="tokens a request of each row's untimed warm-up (default: --new-tokens, a whole row)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed: the synthetic acceptance draws follow it")
    ap.add_argument("--small-m-rows", type=int, default=None,
                    help="EngineConfig.small_m_rows (0: cuBLAS products and separate norm/activation kernels)")
    ap.add_argument("--no-pdl", action="store_true", help="launch every kernel the ordinary way (no programmatic "
                    "dependent launch), as before it existed")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="restrict the draft's LM head to this many token ids (EngineConfig.draft_token_map)")
    ap.add_argument("--rule", action="store_true",
                    help="also run the draft length rule (num_speculative_tokens = the largest --k) and compare "
                         "it with the best fixed k")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV-cache memory of each model, GiB (a pair that "
                    "fills the GPU with weights, e.g. gpt-oss-120b + 20b, needs less)")
    ap.add_argument("--position-rate", action="store_true",
                    help="every draft position accepted with probability --rates at any k (a real draft's acceptance "
                         "does not depend on k), instead of the engine's synthetic mode, whose per-position rate is "
                         "solved per k so that accepted / drafted equals the rate at every k: judged there, a rule "
                         "that learns the acceptance per position at one k and predicts another is misled")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.async_scheduling of every engine (auto: the engine's default)")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_pdl(not args.no_pdl)
    if args.position_rate:
        per_position()
    batches = [int(b) for b in args.batch.split(",")]
    warmup = args.new_tokens if args.warmup_tokens is None else args.warmup_tokens
    common = dict(seed=args.seed, load_format="dummy", device="cuda",
                  max_model_len=args.context + args.new_tokens + 16, max_num_seqs=max(batches),
                  kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)), cuda_graph_batch_sizes=tuple(batches),
                  async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                  **({} if args.small_m_rows is None else {"small_m_rows": args.small_m_rows}))
    target = shape_dir(args.target)
    token_map = prefix_token_map(args.draft_vocab)
    t0 = time.perf_counter()
    llm = LLM(target, **common)
    base = {b: tokens_per_s(llm, b, args.context, args.new_tokens, args.repeats, warmup)[:2] for b in batches}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    rows = [{"k": 0, "rate": None, "batch": b, "tok_s": base[b][0], "speedup": 1.0, "decode_tok_s": base[b][1],
             "decode_speedup": 1.0} for b in batches]
    ks: list[int | str] = [int(x) for x in args.k.split(",") if int(x) > 0]
    for k in ks + (["rule"] if args.rule else []):
        rule = k == "rule"
        num = max(ks) if rule else k
        drafter = (dict(speculative_config={"method": "eagle3", "model": eagle3_head_dir(args.target),
                                            "num_speculative_tokens": num}) if args.draft == "eagle3"
                   else dict(draft_model=shape_dir(args.draft), num_speculative_tokens=num, draft_token_map=token_map))
        llm = LLM(target, rejection_sampling="synthetic", synthetic_acceptance_rate=0.8, adaptive_draft_length=rule,
                  **drafter, **common)
        # One of each a model pair (each wraps an engine method once), emptied before each row.
        log = ChoiceLog(llm) if rule else None
        phases = PhaseLog(llm)
        for rate in (float(r) for r in args.rates.split(",")):
            llm.engine.spec_config.synthetic_acceptance_rate = rate
            if rule:
                # A row is a server whose traffic accepts at this rate: the rule's acceptance counts start afresh,
                # not from the last rate's (they decay over a few hundred steps, longer than a row's warm-up).
                llm.engine.draft_lengths.rule.acceptance = Acceptance()
                llm.engine.draft_lengths.rule.per_request.requests.clear()
            for b in batches:
                phases.reset()
                if log is not None:
                    log.reset()
                tps, decode, acc = tokens_per_s(llm, b, args.context, args.new_tokens, args.repeats, warmup, log,
                                                 phases)
                print(f"k {k}, acceptance {rate}, batch {b}: {tps:.1f} tok/s ({tps / base[b][0]:.3f}x the target "
                      f"alone); decode step phases, median ms {phases.medians()}", flush=True)
                rows.append({"k": k, "rate": rate, "batch": b, "tok_s": tps, "speedup": tps / base[b][0],
                             "decode_tok_s": decode, "decode_speedup": decode / base[b][1],
                             "measured_acceptance": acc, "phases_ms": phases.medians(),
                             **({"choices": log.summary(b), "trace": log.trace} if log else {})})
                if log:
                    print(f"rule, acceptance {rate}, batch {b}: {log.summary(b)}", flush=True)
        del llm, log, phases  # the logs hold the engine: a model as large as the GPU must go before the next
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{args.target} + {args.draft} (synthetic), context {args.context}, {args.new_tokens} new tokens; "
          f"{time.perf_counter() - t0:.0f} s")
    print(markdown_table(rows, ["k", "rate", "batch", "tok_s", "speedup", "decode_tok_s", "decode_speedup",
                                "measured_acceptance"]))
    if args.rule:
        versus = []
        for r in (row for row in rows if row["k"] == "rule"):
            fixed = [x for x in rows if x["batch"] == r["batch"] and (x["k"] == 0 or (
                x["rate"] == r["rate"] and x["k"] != "rule"))]
            best = max(fixed, key=lambda x: x["tok_s"])
            versus.append({"rate": r["rate"], "batch": r["batch"], "best_fixed_k": best["k"],
                           "rule_vs_target": r["speedup"], "rule_vs_best": r["tok_s"] / best["tok_s"]})
        print(markdown_table(versus, ["rate", "batch", "best_fixed_k", "rule_vs_target", "rule_vs_best"]))
        rows += [{"summary": v} for v in versus]
    save_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
