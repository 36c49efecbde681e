"""A draft that accepts nothing and costs about 3/4 of a target step, with the engine's defaults: how close to the
target alone does the draft length rule (engine/speculation/draft_length_rule.py) keep it?

    python benchmarks/cpu_useless_draft.py [--batch 8] [--new-tokens 256] [--repeats 3]

The target is the bundled SmolLM2-135M; the draft is the same architecture with fewer layers (--draft-layers, 21 of
30 by default, so its forward costs ~3/4 of the target's) and random weights, so greedy verification accepts
(almost) nothing. Three engines at temperature 0: the target alone; the pair with the defaults (the rule on); the
pair with a fixed k (adaptive_draft_length=False, what every step did before the rule). Runs are interleaved and
the median of --repeats is taken, since a shared machine's speed drifts. Also reported: the draft alone's and the
target alone's tokens/s (their ratio is the draft's cost a step), and the k's the rule chose.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, save_json, save_random_model  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.source import resolve_model  # noqa: E402

PROMPT_TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def useless_draft(target_path: str, layers: int, out: Path) -> str:
    """The target's architecture with `layers` layers and random weights: same vocabulary, ~layers/30 the cost."""
    cfg = AutoConfig.from_pretrained(target_path)
    cfg.num_hidden_layers = layers
    return save_random_model(cfg, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-layers", type=int, default=21)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-fixed", action="store_true", help="leave out the fixed-k pair (the slowest to run)")
    ap.add_argument("--save-json", default=None)
    args = ap.parse_args()

    target = str(resolve_model(args.model).path)
    draft = useless_draft(target, args.draft_layers, Path(tempfile.mkdtemp()) / "useless-draft")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    kw = dict(max_model_len=512, kv_cache_memory_bytes=256 << 20)  # room for the batch; small pools load fast
    engines = {
        "target alone": LLM(model=target, **kw),
        "draft alone": LLM(model=draft, **kw),
        "pair, defaults (rule on)": LLM(model=target, draft_model=draft, **kw),
    }
    if not args.skip_fixed:
        engines["pair, fixed k"] = LLM(model=target, draft_model=draft, adaptive_draft_length=False, **kw)
    tok = engines["target alone"].tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    # Distinct prompts (a different last token each), so no request reads another's prefix.
    prompts = [prompt + [100 + i] for i in range(args.batch)]
    n = args.batch * args.new_tokens
    times: dict[str, list[float]] = collections.defaultdict(list)
    outs: dict[str, list] = {}
    print("engines loaded", flush=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(args.repeats):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs[name] = llm.generate(prompts, params)
            times[name].append(time.perf_counter() - t0)
            print(f"{name}: {n / times[name][-1]:.1f} tok/s", flush=True)
    tok_s = {name: n / statistics.median(ts) for name, ts in times.items()}
    base = tok_s["target alone"]
    rule = engines["pair, defaults (rule on)"].engine.draft_rule
    rows = []
    for name, rate in tok_s.items():
        spec = engines[name].spec_stats(outs[name]) if "pair" in name else None
        rows.append({"engine": name, "tok_s": round(rate, 1), "vs_target": round(rate / base, 3),
                     "acceptance_rate": None if spec is None else round(spec.acceptance_rate, 3)})
        print(rows[-1], flush=True)
    print(f"draft step / target step: {base / tok_s['draft alone']:.2f}")
    print(f"rule: {rule.steps} steps chosen, {rule.steps_at_zero} at k = 0, {rule.probe_steps} probing; estimates "
          f"{rule.estimates()}")
    save_json(args.save_json, {"env": environment(), "args": vars(args), "rows": rows,
                               "draft_cost": base / tok_s["draft alone"]})


if __name__ == "__main__":
    main()
