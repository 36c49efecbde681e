"""What a tree of pre-drafts would hit on a real pair: for every verify outcome a (a of k drafts accepted), is the
target's token t_a among the draft's top-F_a candidates there (d_{a+1} left out for a < k), the roots that
engine/speculation/ahead/tree_roots.py top_f_roots gives a tree? By outcome, for uniform fan-outs F and for the schedule
F_a with the most hits under a cap on branches, at each temperature.

    python benchmarks/tree_hit_rate.py [--target smollm2-135m-instruct] [--draft smollm2-135m-draft] [--k 4]
        [--temperature 0 0.7] [--fanout 1,2,4,8] [--caps 8,16] [--prompts 60] [--max-new-tokens 128]
        [--device cpu|cuda] [--threads N] [--reach 0.8] [--json FILE] [--from-json EARLIER.json]
        [--profile PROFILE.json]

An offline simulation of speculative decoding with the engine's own models (loaded in HF transformers, fp32, one
request at a time, each with its KV cache): per step the draft proposes k tokens after the committed context (its
argmax at T=0, else a sample of its q), the target scores the k + 1 positions, and the engine's rejection sampler
(engine/speculation/rejection_sampler.py rejection_sample_from_noise: strict at T=0, probabilistic otherwise, a
seeded generator per prompt) decides a and t_a; the context then grows by d_1..d_a and t_a. Pre-drafting changes no
output, so one run scores every schedule: a lookup is a verify the request goes on from (not its last), and a tree
of schedule F_a drafts sum_a F_a branches `k` deep (sum_a F_a x k tokens per lookup), of which a hit proposes one.
The eval split, chat template, up to --max-new-tokens new tokens and EOS stops: as benchmarks/draft_acceptance.py.
The schedules under a cap are fitted on the even-numbered prompts and also scored on the odd ones (held out);
--reach gives the smallest tree (fewest branches, best schedule) whose hit rate reaches it. The JSON keeps every
lookup's (prompt, a, rank), so --from-json scores other fan-outs and caps without simulating again. --profile writes
the per-outcome top-f agreement alone (benchmarks/agreement_profile.py), which the synthetic-pair benchmarks read
(`--agreement-profile`) to make a random draft agree with the target as this pair's draft does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_profile import profile_doc  # noqa: E402
from common import environment, markdown_table, save_json  # noqa: E402
from tree_hit_stats import NO_RANK, HitTable, Lookup, ngram_candidates, root_rank  # noqa: E402

from engine.distill.data import encode_prompt, load_prompts  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.models.loader import SHARED_FROM_KEY, model_weights  # noqa: E402
from engine.models.source import resolve_model  # noqa: E402
from engine.speculation.rejection_sampler import rejection_sample_from_noise  # noqa: E402

MAX_FANOUT = 8  # the cumulative agreement table's columns, and the most roots a capped schedule gives one outcome
REACH_FANOUT, REACH_BRANCHES = 64, 320  # the search for the smallest tree that reaches --reach
QUANTILES = (0.5, 0.8, 0.9)
NGRAM_ROOTS = (1, 2, 4)  # prompt-lookup roots added per outcome (tree_hit_stats.ngram_candidates)


def load_model(name: str, device: str) -> torch.nn.Module:
    """A bundled name or directory as an HF model in fp32; a draft that shares its embedding table with its target
    (the bundled draft) gets it as the engine's loader does (engine/models/loader.py model_weights)."""
    path = resolve_model(name).path
    cfg = ModelConfig.from_path(path)
    shared = bool(getattr(cfg.hf_config, SHARED_FROM_KEY, None))
    verbosity = hf_logging.get_verbosity()
    if shared:
        hf_logging.set_verbosity_error()  # its report of the embedding table missing: loaded just below
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    if shared:
        weights = dict(model_weights(cfg))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if cfg.hf_config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{name}: weights missing {missing}, unexpected {unexpected}")
        if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for v in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        ids |= set(v) if isinstance(v, (list, tuple)) else ({v} if v is not None else set())
    return ids


class Request:
    """One prompt's speculative decode: the committed tokens and both models' KV caches, which always hold every
    committed token but the last (the next forward feeds it)."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], device: str) -> None:
        self.target, self.draft, self.device = target, draft, device
        self.tokens = list(prompt)
        self.caches = [DynamicCache(), DynamicCache()]
        if len(prompt) > 1:
            x = torch.tensor([prompt[:-1]], device=device)
            for model, cache in zip((target, draft), self.caches):
                model(input_ids=x, cache=cache, use_cache=True)

    def _forward(self, which: int, tokens: list[int]) -> torch.Tensor:
        model = (self.target, self.draft)[which]
        x = torch.tensor([tokens], device=self.device)
        return model(input_ids=x, cache=self.caches[which], use_cache=True).logits[0].float()

    def step(self, k: int, temperature: float, gen: torch.Generator) -> tuple[int, int, int, int, tuple[int, ...]]:
        """One propose + verify: (a, t_a, rank of t_a among the draft's roots for outcome a, its place among the
        n-gram candidates there, and those candidates' ranks among the draft's roots)."""
        vocab = self.target.config.vocab_size
        drafts: list[int] = []
        draft_logits = []  # k + 1 rows: the draft's logits at positions len(tokens) .. len(tokens) + k
        probs = []  # k rows: q each draft was drawn from
        feed = self.tokens[-1]
        for j in range(k + 1):
            logits = self._forward(1, [feed])[-1]
            draft_logits.append(logits)
            if j == k:
                break  # the bonus position's logits, for its roots only
            if temperature == 0.0:
                feed = int(logits.argmax())
            else:
                q = torch.softmax(logits / temperature, dim=-1)
                probs.append(q)
                noise = torch.empty(vocab, device=self.device).exponential_(generator=gen)
                feed = int((q / noise).argmax())  # the engine's exponential race (engine/sample/sampler.py)
            drafts.append(feed)
        target_logits = self._forward(0, [self.tokens[-1]] + drafts)  # [k + 1, V]
        ids = torch.tensor([drafts], device=self.device)
        n = torch.tensor([k], device=self.device)
        if temperature == 0.0:
            out = rejection_sample_from_noise(ids, n, None, target_logits[None], "strict", None, None, None)
        else:
            target_probs = torch.softmax(target_logits / temperature, dim=-1)
            uniforms = torch.rand((1, k), generator=gen, device=self.device)
            noise = torch.empty((1, 1, vocab), device=self.device).exponential_(generator=gen)
            out = rejection_sample_from_noise(ids, n, torch.stack(probs)[None], target_probs[None], "probabilistic",
                                              None, uniforms, noise)
        a = int(out.num_accepted[0])  # SYNC: offline simulation
        token = int(out.output_token_ids[0, a])
        excluded = drafts[a] if a < k else None
        rank = root_rank(draft_logits[a], excluded, token)
        cands = ngram_candidates(self.tokens + drafts[:a], excluded)
        ngram_rank = cands.index(token) if token in cands else NO_RANK
        ngram_draft_ranks = tuple(root_rank(draft_logits[a], excluded, c) for c in cands)
        self.tokens += drafts[:a] + [token]
        for cache in self.caches:
            extra = cache.get_seq_length() - (len(self.tokens) - 1)
            if extra:
                cache.crop(-extra)  # this transformers' crop takes the tokens to remove, negated
        return a, token, rank, ngram_rank, ngram_draft_ranks


def kept_tokens(step_tokens: list[int], stop: set[int], room: int) -> tuple[int, bool]:
    """Of one step's a + 1 new tokens, how many the request keeps (up to and including a stop token, at most
    `room`), and whether it finishes with them."""
    stop_at = next((j for j, t in enumerate(step_tokens) if t in stop), None)
    take = min(len(step_tokens) if stop_at is None else stop_at + 1, room)
    return take, stop_at is not None or take >= room


def simulate(target: torch.nn.Module, draft: torch.nn.Module, prompts: Sequence[list[int]], k: int,
             temperature: float, max_new_tokens: int, device: str, ignore_eos: bool = False) -> dict:
    """Every prompt decoded speculatively; returns the HitTable of the lookups, the steps' acceptance and each
    prompt's new tokens (at T=0 the target's own greedy continuation: speculation is lossless)."""
    stop = set() if ignore_eos else eos_ids(target)
    lookups: list[Lookup] = []
    outputs: list[list[int]] = []
    steps = emitted = 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            gen = torch.Generator(device=device).manual_seed(i)
            req = Request(target, draft, prompt, device)
            new = 0
            while True:
                a, _, rank, ngram_rank, ngram_draft_ranks = req.step(k, temperature, gen)
                take, finished = kept_tokens(req.tokens[len(req.tokens) - a - 1:], stop, max_new_tokens - new)
                steps += 1
                emitted += take
                new += take
                if finished:
                    break  # the request ends here: no next proposal looks this outcome up
                lookups.append(Lookup(i, a, rank, ngram_rank, ngram_draft_ranks))
            outputs.append(req.tokens[len(prompt):len(prompt) + new])
    return {"table": HitTable(k, lookups), "steps": steps, "acceptance_length": emitted / max(steps, 1),
            "outputs": outputs}


def report(table: HitTable, temperature: float, fanouts: Sequence[int], caps: Sequence[int], reach: float) -> dict:
    """The numbers of one temperature: uniform fan-outs, per-position agreement, capped schedules, and the smallest
    tree whose hit rate reaches `reach`."""
    k = table.k
    p_a = table.outcome_distribution()
    uniform = []
    for f in fanouts:
        sched = [f] * (k + 1)
        uniform.append({"T": temperature, "F": f, "schedule": sched, "branches": sum(sched),
                        "drafted_ahead_per_lookup": table.drafted_ahead_per_lookup(sched, k),
                        "hit_rate": table.hit_rate(sched), "hit_rate_by_outcome": table.hit_rate_by_outcome(sched),
                        "unused_share": table.unused_share(sched, k)})
    cum = table.cumulative_agreement(MAX_FANOUT)
    positions = [{"T": temperature, "a": a, "P(a)": p_a[a], "lookups": table.count_by_outcome()[a],
                  "top_f_agreement": cum[a], "rank_percentiles": dict(zip(
                      [f"p{round(q * 100)}" for q in QUANTILES], table.rank_percentiles(a, QUANTILES)))}
                 for a in range(k + 1)]
    even = {x.prompt for x in table.lookups if x.prompt % 2 == 0}
    odd = {x.prompt for x in table.lookups if x.prompt % 2 == 1}
    capped = []
    for cap in caps:
        sched = table.best_schedule(cap, MAX_FANOUT)
        fitted = table.subset(even).best_schedule(cap, MAX_FANOUT)
        capped.append({"T": temperature, "cap": cap, "schedule": sched, "branches": sum(sched),
                       "drafted_ahead_per_lookup": table.drafted_ahead_per_lookup(sched, k),
                       "hit_rate": table.hit_rate(sched), "hit_rate_by_outcome": table.hit_rate_by_outcome(sched),
                       "unused_share": table.unused_share(sched, k), "schedule_fit_on_even_prompts": fitted,
                       "held_out_hit_rate": table.subset(odd).hit_rate(fitted) if odd else None})
    ngram = [{"T": temperature, "F": f, "ngram_roots": g, "hit_rate": table.hit_rate_with_ngram([f] * (k + 1), g),
              "draft_only_hit_rate": table.hit_rate([f] * (k + 1)),
              "added_roots_per_lookup": table.ngram_roots_per_lookup([f] * (k + 1), g)}
             for f in fanouts for g in NGRAM_ROOTS]
    smallest = table.smallest_tree(reach, REACH_FANOUT, REACH_BRANCHES)
    return {"T": temperature, "lookups": len(table.lookups), "uniform": uniform, "positions": positions,
            "capped": capped, "ngram": ngram,
            "reach": {"rate": reach, "schedule": smallest, "branches": sum(smallest or [0]) or None,
                      "max_fanout": REACH_FANOUT, "max_branches": REACH_BRANCHES}}


def print_tables(results: list[dict], k: int) -> None:
    uniform = [dict(r, **{f"a={a}": h for a, h in enumerate(r["hit_rate_by_outcome"])},
                    unused=f"{100 * r['unused_share']:.1f}%")
               for res in results for r in res["uniform"]]
    by_a = [f"a={a}" for a in range(k + 1)]
    print("\nUniform fan-out F (every outcome F roots, each branch k deep):")
    print(markdown_table(uniform, ["T", "F", "branches", "drafted_ahead_per_lookup", "hit_rate", *by_a, "unused"]))
    cols = [f"top{f}" for f in range(1, MAX_FANOUT + 1)]
    positions = [dict(p, **dict(zip(cols, p["top_f_agreement"])), **p["rank_percentiles"])
                 for res in results for p in res["positions"]]
    print("\nPer outcome a: P(a), and P(t_a in the draft's top-f there | a), f = 1..8; rank percentiles of t_a:")
    print(markdown_table(positions, ["T", "a", "P(a)", "lookups", *cols,
                                     *[f"p{round(q * 100)}" for q in QUANTILES]]))
    capped = [dict(r, unused=f"{100 * r['unused_share']:.1f}%") for res in results for r in res["capped"]]
    print("\nThe schedule F_0..F_k with the most hits under a cap on branches (at most 8 roots an outcome):")
    print(markdown_table(capped, ["T", "cap", "schedule", "drafted_ahead_per_lookup", "hit_rate", "hit_rate_by_outcome",
                                  "unused", "schedule_fit_on_even_prompts", "held_out_hit_rate"]))
    ngram = [r for res in results for r in res.get("ngram", [])]
    if ngram:
        print("\nThe draft's top-F roots plus the first G prompt-lookup (n-gram) candidates of each outcome:")
        print(markdown_table(ngram, ["T", "F", "ngram_roots", "draft_only_hit_rate", "hit_rate",
                                     "added_roots_per_lookup"]))
    for res in results:
        r = res["reach"]
        print(f"\nT={res['T']}: the smallest tree with hit rate >= {r['rate']}: "
              + (f"F = {r['schedule']}, {r['branches']} branches" if r["schedule"] else
                 f"none within {r['max_branches']} branches of at most {r['max_fanout']} roots an outcome"))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--k", type=int, default=4, help="drafts per window (the engine's num_speculative_tokens)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--fanout", type=_ints, default=[1, 2, 4, 8], help="uniform fan-outs F, e.g. 1,2,4,8")
    ap.add_argument("--caps", type=_ints, default=[8, 16], help="branch caps of the fitted schedules, e.g. 8,16")
    ap.add_argument("--prompts", type=int, default=None, help="eval prompts (default: all 60)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens whatever the tokens")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--reach", type=float, default=0.8, help="report the smallest tree with this hit rate")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--profile", default=None,
                    help="write the per-outcome top-f agreement profile here (benchmarks/agreement_profile.py): what "
                         "the synthetic-pair benchmarks' --agreement-profile reads")
    ap.add_argument("--from-json", default=None,
                    help="score the lookups an earlier run's JSON holds instead of simulating (its models, k, "
                         "temperatures and prompts; the fan-outs, caps and --reach of this command)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.k < 1 or any(f < 1 for f in args.fanout) or any(c < 1 for c in args.caps):
        ap.error("--k, --fanout and --caps must be positive")

    if args.from_json:
        payload = rescore(args)
    else:
        payload = {"environment": environment(), "args": vars(args), "results": []}
        payload["prompts_used"] = run(args, payload["results"])
    run_args, env = payload["args"], payload["environment"]
    print(f"tree pre-drafting hit rates, draft {run_args['draft']} for {run_args['target']}, k={run_args['k']}, "
          f"eval split: {payload['prompts_used']} prompts x up to {run_args['max_new_tokens']} new tokens, offline "
          f"simulation (HF transformers, fp32, {run_args['device']})")
    print(f"{env['date']}, {env['device']}, {env['threads']} threads, torch {env['torch']}")
    print(markdown_table(payload["results"], ["T", "steps", "lookups", "acceptance_length", "seconds"]))
    print_tables(payload["results"], run_args["k"])
    save_json(args.json, payload)
    if args.profile:
        save_json(args.profile, profile_doc(payload))
    return payload


def run(args: argparse.Namespace, results: list[dict]) -> int:
    """Simulate every temperature, appending its report to `results`; returns the number of prompts."""
    target = load_model(args.target, args.device)
    draft = load_model(args.draft, args.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError("the draft and the target need one vocabulary")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.target).path))
    except (OSError, ValueError):
        tokenizer = None  # random-weight test targets: encode_prompt's character fallback
    prompts = [encode_prompt(p, tokenizer, target.config.vocab_size) for p in load_prompts("eval", args.prompts)]
    for t in args.temperature:
        start = time.perf_counter()
        sim = simulate(target, draft, prompts, args.k, t, args.max_new_tokens, args.device, args.ignore_eos)
        res = report(sim["table"], t, args.fanout, args.caps, args.reach)
        res.update(steps=sim["steps"], acceptance_length=sim["acceptance_length"],
                   seconds=time.perf_counter() - start,
                   # every lookup as [prompt, a, rank, n-gram rank, n-gram candidates' draft ranks]: any other
                   # schedule can be scored from the JSON alone
                   lookup_ranks=[[x.prompt, x.outcome, x.rank, x.ngram_rank, list(x.ngram_draft_ranks)]
                                 for x in sim["table"].lookups])
        results.append(res)
        print(f"T={t}: {len(prompts)} prompts, {sim['steps']} verifies, acceptance length "
              f"{sim['acceptance_length']:.2f}, {res['seconds']:.0f} s", file=sys.stderr, flush=True)
    return len(prompts)


def rescore(args: argparse.Namespace) -> dict:
    """An earlier run's lookups under this command's fan-outs, caps and --reach."""
    old = json.loads(Path(args.from_json).read_text())
    k = old["args"]["k"]
    results = []
    for res in old["results"]:
        table = HitTable(k, [Lookup(*x[:4], tuple(x[4])) if len(x) > 4 else Lookup(*x) for x in res["lookup_ranks"]])
        new = report(table, res["T"], args.fanout, args.caps, args.reach)
        new.update({key: res[key] for key in ("steps", "acceptance_length", "seconds", "lookup_ranks")})
        results.append(new)
    return {"environment": old["environment"], "args": old["args"], "prompts_used": old["prompts_used"],
            "rescored_with": {"fanout": args.fanout, "caps": args.caps, "reach": args.reach}, "results": results}


if __name__ == "__main__":
    main()
