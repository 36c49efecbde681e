"""Host time a committed token spends in detokenization (engine/detokenizer.py): the window of two `decode` calls a
token against the tokenizers library's streaming decoder, with the real tokenizers the project bundles (SmolLM2's
byte-level BPE; Gemma 3's SentencePiece with byte fallback), on text of mixed scripts and on random ids. Every
committed token of every request pays this in the step's commit phase, on the scheduler's thread.

    python benchmarks/cpu_detokenize.py --tokens 2000 --repeats 5

Prints microseconds a token (median of --repeats runs) and whether both give the same pieces.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import environment, markdown_table, save_json

from engine.detokenizer import IncrementalDetokenizer
from engine.llm import load_tokenizer
from engine.models.source import resolve_model

TEXT = ("Speculative decoding drafts a few tokens and verifies them in one pass; café, naïve — 日本語のテキスト 🚀 "
        "with code: `for i in range(10): print(i)` and numbers 3.14159, 2026-12-06.\n")


def us_per_token(make, tok, prompt: list[int], ids: list[int], repeats: int  # noqa: ANN001
                 ) -> tuple[float, list[str]]:
    """Median us a token of make(tok, prompt).add over ids, and the pieces it gave."""
    times, pieces = [], []
    for _ in range(repeats):
        det = make(tok, prompt)
        t0 = time.perf_counter()
        pieces = [det.add(t) for t in ids]
        times.append((time.perf_counter() - t0) / len(ids) * 1e6)
    return statistics.median(times), pieces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        tok = load_tokenizer(str(resolve_model(name).path))
        text_ids = (tok.encode(TEXT * (args.tokens // 20 + 1), add_special_tokens=False))[:args.tokens]
        rng = random.Random(0)
        random_ids = [rng.randrange(len(tok)) for _ in range(args.tokens)]
        for kind, ids in (("text", text_ids), ("random ids", random_ids)):
            prompt, out = ids[:8], ids[8:]
            window, a = us_per_token(IncrementalDetokenizer, tok, prompt, out, args.repeats)
            stream, b = us_per_token(IncrementalDetokenizer.for_tokenizer, tok, prompt, out, args.repeats)
            kind_of = type(IncrementalDetokenizer.for_tokenizer(tok, prompt)).__name__
            rows.append({"tokenizer": name, "ids": kind, "window_us": round(window, 2), "engine_us": round(stream, 2),
                         "engine_takes": kind_of, "same_pieces": a == b})
    print(markdown_table(rows, list(rows[0])))
    save_json(args.out, {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
