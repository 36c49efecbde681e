"""Prefix caching on a multi-turn chat workload: time to first token, tokens/s and hit rates, caching on and off.

    python benchmarks/prefix_cache.py [--device cpu|cuda] [--draft-model smollm2-135m-draft] [--sessions 4]
                                      [--turns 3] [--new-tokens 16] [--save-json out.json]
    python benchmarks/prefix_cache.py --device cuda --shape qwen3-8b [--draft-shape qwen3-0.6b]   # random weights

`--shape` runs a Qwen3 shape with random weights made on the device (load_format "dummy", no checkpoint to copy).
Its word-level tokenizer has no chat template, so there a conversation is kept as token ids: each turn's prompt is
the last prompt, the model's answer and the new user message (words hashed into the vocabulary), which keeps the
property the chat template gives, that a turn's prompt extends the one before.

Workload: `--sessions` users chat at once, each conversation opening with the same long system prompt; every round
sends one request per session (concurrently, as one batch), whose prompt is the system prompt plus the session's
whole history (earlier user turns and the model's greedy answers) plus a new user message, rendered with the
tokenizer's chat template. With caching, a round reuses the system prompt and each session's previous turns; without
it, every round prefills everything again. Greedy outputs of both modes are compared (on CPU, fp32: must be equal).

TTFT: from the round's submission to the step that gives the request its first token, through the engine's step
loop in this process (no HTTP). tokens/s: output tokens of the whole workload over its wall time. On a machine
other jobs share, wall time measures them too, so the same figures are also given in CPU seconds of this process
(`time.process_time`; meaningful with `--threads 1`, where the engine cannot use more than one core). Hit rates: per
model, prompt tokens found in its prefix cache over tokens looked up (the engine's counters, as vLLM counts them).
One warm-up round with another system prompt runs first, in each mode; then `--repeats` runs per mode, the modes
alternating, and the medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import environment, markdown_table, save_json  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.request import Request  # noqa: E402

SYSTEM = ("You are a careful, friendly assistant for a software company. Answer questions about programming, "
          "deployment and debugging. Keep answers short and concrete, prefer examples over theory, say so when "
          "you are unsure, never invent APIs, and ask for the error message when a user reports a failure. "
          "The company's stack is Python 3.11, PostgreSQL 15, Redis, Kubernetes on three cloud providers, and a "
          "React front end; its style guide asks for type hints, small functions, and tests for every change. ")
WARMUP_SYSTEM = "You are a helpful assistant. Answer briefly. "
QUESTIONS = [
    "How do I read a CSV file?", "Why is my Docker image so large?", "What does a 502 from the ingress mean?",
    "How should I name test functions?", "When is Redis a bad choice?", "How do I profile a slow endpoint?",
    "What is a database index?", "How do I roll back a deployment?",
]
FOLLOW_UPS = ["Can you give an example?", "What could go wrong?", "How would I test that?", "Anything faster?"]


def _round(llm: LLM, prompts: list[list[int]], params: SamplingParams,
           ids: list[int]) -> tuple[list, list[float], list[float]]:
    """Submit a round at once and step until done; returns the requests and their TTFTs, in wall seconds and in
    CPU seconds of this process."""
    engine = llm.engine
    reqs = []
    for p in prompts:
        reqs.append(Request(f"r{ids[0]}", p, params))
        ids[0] += 1
        engine.add_request(reqs[-1])
    t0, c0 = time.perf_counter(), time.process_time()
    ttft: dict[str, tuple[float, float]] = {}
    while engine.has_unfinished():
        engine.step()
        now, cpu = time.perf_counter(), time.process_time()
        for r in reqs:
            if r.output_token_ids and r.request_id not in ttft:
                ttft[r.request_id] = (now - t0, cpu - c0)
    return reqs, [ttft[r.request_id][0] for r in reqs], [ttft[r.request_id][1] for r in reqs]


def _word_ids(text: str, llm: LLM) -> list[int]:
    """Token ids of a text for a model without a usable tokenizer vocabulary: each word hashed to an id (3 and up:
    no special tokens)."""
    vocab = llm.engine.vocab_size
    return [3 + zlib.crc32(w.encode()) % (vocab - 3) for w in text.split()]


def run_workload(llm: LLM, system: str, sessions: int, turns: int, params: SamplingParams) -> dict:
    tok = llm.tokenizer
    histories = [[{"role": "system", "content": system}] for _ in range(sessions)]
    ids = [0]
    ttfts: list[float] = []
    cpu_ttfts: list[float] = []
    ttft_by_turn: list[float] = []
    outputs: list[list[int]] = []
    n_out = n_prompt = n_cached = 0
    stats0 = llm.engine.prefix_cache_stats()
    t0, c0 = time.perf_counter(), time.process_time()
    templated = getattr(tok, "chat_template", None) is not None
    id_histories = [_word_ids(f"system: {system}", llm) for _ in range(sessions)]  # without a chat template
    for turn in range(turns):
        prompts = []
        for s, h in enumerate(histories):
            q = QUESTIONS[s % len(QUESTIONS)] if turn == 0 else FOLLOW_UPS[(turn - 1 + s) % len(FOLLOW_UPS)]
            h.append({"role": "user", "content": q})
            if templated:
                prompts.append(list(tok.apply_chat_template(h, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"]))
            else:
                id_histories[s] = id_histories[s] + _word_ids(f"user: {q} assistant:", llm)
                prompts.append(id_histories[s])
        reqs, t, cpu_t = _round(llm, prompts, params, ids)
        if not templated:
            id_histories = [p + r.output_token_ids for p, r in zip(prompts, reqs)]
        ttfts += t
        cpu_ttfts += cpu_t
        ttft_by_turn.append(statistics.median(t))
        for h, r in zip(histories, reqs):
            h.append({"role": "assistant", "content": tok.decode(r.output_token_ids, skip_special_tokens=True)})
            outputs.append(list(r.output_token_ids))
            n_out += r.num_output_tokens
            n_prompt += r.num_prompt_tokens
            n_cached += r.num_cached_tokens or 0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = llm.engine.prefix_cache_stats()
    hit_rates = {}
    for model, (q, h) in stats.items():
        q0, h0 = stats0.get(model, (0, 0))
        hit_rates[model] = (h - h0) / (q - q0) if q > q0 else 0.0
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": n_out / wall, "tok_per_cpu_s": n_out / cpu,
            "ttft_cpu_median_s": statistics.median(cpu_ttfts), "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_median_by_turn_s": ttft_by_turn,
            "prompt_tokens": n_prompt, "cached_tokens": n_cached, "output_tokens": n_out,
            "hit_rate": hit_rates, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="workload runs per mode, alternating; medians reported "
                    "(an odd count: the median of two is their mean, and the first run of a mode may still compile "
                    "kernels for prompt lengths the warm-up round did not reach)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each model's KV budget; on CUDA 4 GiB by default, so both modes' engines fit at once")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--save-json", default=None)
    ap.add_argument("--shape", choices=["qwen3-8b", "qwen3-0.6b"], default=None,
                    help="a Qwen3 shape with random weights instead of --model")
    ap.add_argument("--draft-shape", choices=["qwen3-0.6b"], default=None, help="likewise for the draft")
    args = ap.parse_args()
    extra: dict = {}
    if args.shape:
        from sweep_models import QWEN3_0_6B, QWEN3_8B, shape_only
        from transformers import Qwen3Config

        shapes = {"qwen3-8b": QWEN3_8B, "qwen3-0.6b": QWEN3_0_6B}
        work = Path(tempfile.gettempdir()) / "specserve-prefix-shapes"
        def make(name: str) -> str:
            return shape_only(work / name, Qwen3Config(**shapes[name], architectures=["Qwen3ForCausalLM"]))

        args.model = make(args.shape)
        if args.draft_shape:
            args.draft_model = make(args.draft_shape)
        extra = {"load_format": "dummy"}
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else (4.0 if args.device.startswith("cuda") else None)
    if kv_gib is not None:
        extra["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if args.threads:
        torch.set_num_threads(args.threads)

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    engines = {}
    for caching in (False, True):
        llm = LLM(model=args.model, draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens,
                  device=args.device, max_model_len=2048, enable_prefix_caching=caching, **extra)
        run_workload(llm, WARMUP_SYSTEM, args.sessions, 1, params)
        engines["on" if caching else "off"] = llm
    # Alternate the modes, so a neighbour's load on a shared machine hits both alike. Each repeat starts from a
    # fresh system prompt (a new first word), so the cached run never finds the previous repeat's blocks.
    for rep in range(args.repeats):
        for mode in ("off", "on"):
            r = run_workload(engines[mode], f"[{rep}] " + SYSTEM, args.sessions, args.turns, params)
            runs[mode].append(r)
            print(mode, {k: v for k, v in r.items() if k != "outputs"}, flush=True)
    rows = []
    for mode, rs in runs.items():
        med = lambda key, rs=rs: statistics.median(r[key] for r in rs)  # noqa: E731
        rows.append({"prefix caching": mode, "TTFT median s": med("ttft_median_s"), "TTFT mean s": med("ttft_mean_s"),
                     "TTFT median by turn s": [statistics.median(r["ttft_median_by_turn_s"][t] for r in rs)
                                              for t in range(args.turns)],
                     "tok/s": med("tok_s"), "TTFT median CPU s": med("ttft_cpu_median_s"),
                     "tok per CPU s": med("tok_per_cpu_s"), "prompt tokens": rs[0]["prompt_tokens"],
                     "cached": rs[0]["cached_tokens"],
                     "hit rate": ", ".join(f"{m} {v:.2f}" for m, v in rs[0]["hit_rate"].items())})
    pairs = [(x, y) for a, b in zip(runs["on"], runs["off"]) for x, y in zip(a["outputs"], b["outputs"])]
    same = sum(x == y for x, y in pairs)
    print(markdown_table(rows, list(rows[0])))
    print(f"greedy outputs identical with and without caching: {same}/{len(pairs)}")
    env = environment()
    print(env)
    save_json(args.save_json, {"env": env, "args": vars(args), "rows": rows, "identical_outputs": [same, len(pairs)]})
    # fp32 on CPU is exact enough for equality (the tests assert it); in bf16 on a GPU a prefill split differently
    # (cached blocks, other chunks) may round differently and flip a near-tie, so there it is reported only.
    if same != len(pairs) and llm_device(args.device) == "cpu":
        raise SystemExit("outputs differ with prefix caching in fp32: a correctness bug")


def llm_device(device: str) -> str:
    return device.split(":")[0]


if __name__ == "__main__":
    main()
