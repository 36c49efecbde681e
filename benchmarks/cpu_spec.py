"""Speculative decoding on the bundled SmolLM2-135M target at temperature 0: tokens/s with and without
speculation, acceptance rate, acceptance length and acceptance per position.

    python benchmarks/cpu_spec.py [--ks 2 4 6] [--batch-sizes 1] [--new-tokens 64]

Drafts: the target itself (acceptance upper bound), a small random-weight Llama with the target's
vocabulary (lower bound), and synthetic acceptance 0.6 / 0.8 with that small draft (speed at a chosen
acceptance). Median of 3 runs after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, markdown_table, median_seconds, save_json, save_random_model  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.source import resolve_model  # noqa: E402

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "What are three good habits for writing maintainable code?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]


def small_random_draft(target_path: str, out: Path) -> str:
    """2 layers, hidden 256: about 15M parameters besides the embedding, same vocabulary as the target."""
    t = AutoConfig.from_pretrained(target_path)
    cfg = LlamaConfig(vocab_size=t.vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=t.max_position_embeddings,
                      tie_word_embeddings=True, bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id)
    return save_random_model(cfg, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-json", default=None)
    args = ap.parse_args()

    target = str(resolve_model(args.model).path)
    tmp = Path(tempfile.mkdtemp())
    small = small_random_draft(target, tmp / "small-draft")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    base = LLM(model=target, max_model_len=512)
    tok = base.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in PROMPTS]
    rows = []
    for bs in args.batch_sizes:
        prompts = [chat[i % len(chat)] for i in range(bs)]
        n = bs * args.new_tokens
        t_base = median_seconds(lambda prompts=prompts: base.generate(prompts, params), args.repeats)
        rows.append({"batch": bs, "draft": "none", "k": 0, "tok_s": n / t_base, "speedup": 1.0})
        print(rows[-1], flush=True)
        variants = [("target itself", target, "strict", None), ("small random", small, "strict", None),
                    ("synthetic 0.6", small, "synthetic", 0.6), ("synthetic 0.8", small, "synthetic", 0.8)]
        for name, draft, mode, rate in variants:
            for k in args.ks:
                llm = LLM(model=target, draft_model=draft, num_speculative_tokens=k, rejection_sampling=mode,
                          synthetic_acceptance_rate=rate, max_model_len=512)
                outs: list = []

                def run(llm: LLM = llm, outs: list = outs, prompts: list = prompts) -> None:
                    outs[:] = llm.generate(prompts, params)
                t = median_seconds(run, args.repeats)
                s = llm.spec_stats(outs)
                per_pos = [c / s.num_drafts for c in s.accepted_per_position] if s.num_drafts else []
                rows.append({"batch": bs, "draft": name, "k": k, "tok_s": n / t, "speedup": t_base / t,
                             "acceptance_rate": s.acceptance_rate, "acceptance_length": s.acceptance_length,
                             "accepted_per_position": per_pos})
                print(rows[-1], flush=True)
    env = environment()
    print(f"\n{args.model}, temperature 0, {args.new_tokens} new tokens, {env}")
    print(markdown_table(rows, ["batch", "draft", "k", "tok_s", "speedup", "acceptance_rate", "acceptance_length",
                                "accepted_per_position"]))
    save_json(args.save_json, {"env": env, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
