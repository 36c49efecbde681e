"""Greedy decode throughput of the engine against HF transformers eager, same model, same run.

    python benchmarks/cpu_decode.py [--model smollm2-135m-instruct] [--batch-sizes 1 16] [--new-tokens 64]

Each measurement: a batch of identical-length prompts (no padding for HF), `--new-tokens` greedy tokens,
median of 3 runs after one warm-up; tokens/s = batch * new tokens / seconds (prefill included for both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, median_seconds, save_json  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.source import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-json", default=None)
    args = ap.parse_args()

    path = str(resolve_model(args.model).path)
    llm = LLM(model=path, max_model_len=args.prompt_len + args.new_tokens + 8)
    device = llm.engine_config.device
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=llm.engine_config.dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch_sizes:
        prompts = torch.randint(100, 20000, (bs, args.prompt_len), generator=g)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        ids = prompts.tolist()
        t_eng = median_seconds(lambda ids=ids, params=params: llm.generate(ids, params), args.repeats)
        x = prompts.to(device)

        def run_hf(x: torch.Tensor = x) -> None:
            with torch.no_grad():
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                            min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        t_hf = median_seconds(run_hf, args.repeats)
        n = bs * args.new_tokens
        rows.append({"batch": bs, "engine_tok_s": n / t_eng, "hf_eager_tok_s": n / t_hf,
                     "speedup": t_hf / t_eng, "engine_s": t_eng, "hf_s": t_hf})
        print(rows[-1], flush=True)
    env = environment()
    print(f"\n{args.model}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {env}")
    print(markdown_table(rows, ["batch", "engine_tok_s", "hf_eager_tok_s", "speedup"]))
    save_json(args.save_json, {"env": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
