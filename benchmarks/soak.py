"""Bounded soak test of a running specserve server: mixed traffic for a fixed time, then leak checks.

Client threads loop over a mix of requests: non-streaming and streaming completions, chat, gRPC streams,
streams the client abandons after a few chunks (HTTP close, gRPC cancel) and invalid requests. Every answer is
classified: a valid request must succeed (429 counts as back-pressure, not a failure), an invalid one must get
its 4xx; anything else (a 5xx, an in-band stream error, a 4xx for a valid request, a hang) is unexpected.
Meanwhile the resident memory of every Ray process of the server (router, replica, model workers, proxies)
is sampled. At the end the router must be idle with no KV block held by either model.

    # tiny byte-level models (the reliability tests' own), a local server, 3 minutes:
    .venv/bin/python benchmarks/soak.py --tiny --duration-s 180 --out benchmarks/out/soak.json
    # the bundled SmolLM2 pair:
    .venv/bin/python benchmarks/soak.py --duration-s 180

Requests go only to 127.0.0.1 (the server this script starts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # serve_support: the server set-up and tiny models of the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, save_json  # noqa: E402

from serving.proto import specserve_pb2 as pb  # noqa: E402
from serving.proto import specserve_pb2_grpc as pb_grpc  # noqa: E402

WORDS = ["the", "sea", "a", "river", "of", "light", "def", "fibonacci", "(n):", "once", "upon", "time", "42", "and"]
# (weight, kind): the traffic mix
MIX = [(30, "complete"), (20, "stream"), (12, "chat"), (10, "cancel"), (10, "grpc"), (6, "grpc_cancel"),
       (12, "invalid")]
INVALID = [({"max_tokens": 0}, 400), ({"temperature": 5}, 400), ({"top_p": 0}, 400), ({"n": 0}, 400),
           ({"model": "no-such-model"}, 404), ({"prompt": ""}, 400), ({"prompt": [10**9]}, 400),
           ({"logprobs": 50}, 400), ({"best_of": 2}, 400)]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter = field(default_factory=Counter)  # kind -> count
    outcomes: Counter = field(default_factory=Counter)  # "kind status" -> count
    unexpected: list[str] = field(default_factory=list)
    tokens: int = 0

    def add(self, kind: str, outcome: str, ok: bool, detail: str = "", tokens: int = 0) -> None:
        with self.lock:
            self.requests[kind] += 1
            self.outcomes[f"{kind} {outcome}"] += 1
            self.tokens += tokens
            if not ok:
                self.unexpected.append(f"{kind} {outcome}: {detail[:300]}")


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _sampling(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        return {"temperature": 0}
    return {"temperature": round(rng.uniform(0.3, 1.2), 2), "top_p": 0.9, "seed": rng.randint(0, 10**6)}


def _sse(text: str) -> tuple[bool, str]:
    """(well formed and error-free, why not)"""
    if not text.endswith("data: [DONE]\n\n"):
        return False, "stream did not end with [DONE]: " + text[-200:]
    for event in text.split("\n\n")[:-2]:
        if '"error"' in event and "error" in json.loads(event[len("data: "):]):
            return False, "in-band error: " + event
    return True, ""


def _one(kind: str, rng: random.Random, http: httpx.Client, grpc_target: str, model: str, tally: Tally,
         metadata: tuple) -> None:
    body = {"model": model, "prompt": _prompt(rng), "max_tokens": rng.randint(1, 48), **_sampling(rng)}
    try:
        if kind == "complete":
            r = http.post("/v1/completions", json=body)
            tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
            tally.add(kind, str(r.status_code), r.status_code in (200, 429), r.text, tokens)
        elif kind == "chat":
            chat = {k: v for k, v in body.items() if k != "prompt"}
            chat["messages"] = [{"role": "user", "content": _prompt(rng)}]
            r = http.post("/v1/chat/completions", json=chat)
            tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
            tally.add(kind, str(r.status_code), r.status_code in (200, 429), r.text, tokens)
        elif kind == "stream":
            r = http.post("/v1/completions", json={**body, "stream": True})
            ok, why = _sse(r.text) if r.status_code == 200 else (r.status_code == 429, r.text)
            tally.add(kind, str(r.status_code), ok, why)
        elif kind == "cancel":
            with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True,
                                                             "stream": True}) as r:
                if r.status_code == 200:
                    lines = r.iter_lines()
                    for _ in range(rng.randint(1, 3)):
                        next(lines, None)
                ok = r.status_code in (200, 429)
            tally.add(kind, str(r.status_code), ok, "" if ok else r.read().decode(errors="replace"))
        elif kind in ("grpc", "grpc_cancel"):
            with grpc.insecure_channel(grpc_target) as channel:
                req = pb.GenerateRequest(prompt=body["prompt"], max_tokens=200 if kind == "grpc_cancel" else
                                         body["max_tokens"], temperature=float(body["temperature"]),
                                         ignore_eos=kind == "grpc_cancel")
                call = pb_grpc.GenerationStub(channel).Generate(req, metadata=metadata, timeout=120)
                if kind == "grpc_cancel":
                    next(call)
                    call.cancel()
                    tally.add(kind, "cancelled", True)
                else:
                    out = list(call)
                    tally.add(kind, "OK", bool(out) and out[-1].finish_reason != "",
                              tokens=sum(len(o.token_ids) for o in out))
        elif kind == "invalid":
            change, want = rng.choice(INVALID)
            r = http.post("/v1/completions", json={**body, **change})
            tally.add(kind, str(r.status_code), r.status_code == want and "error" in r.json(), r.text)
    except grpc.RpcError as e:
        code = e.code()
        tally.add(kind, code.name, code == grpc.StatusCode.RESOURCE_EXHAUSTED, str(e.details()))
    except Exception as e:  # noqa: BLE001 - a hang (timeout), a dropped connection: all unexpected
        tally.add(kind, type(e).__name__, False, str(e))


def _server_processes() -> list[psutil.Process]:
    """The Ray processes this script's local cluster runs (its descendants, less itself)."""
    return psutil.Process().children(recursive=True)


def _rss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_soak(base_url: str, grpc_target: str, model: str, duration_s: float, concurrency: int = 6,
             seed: int = 0, headers: dict[str, str] | None = None, router_pid: int | None = None) -> dict[str, Any]:
    """Drive the server for `duration_s`; returns the tallies and memory samples (the caller checks leaks)."""
    tally = Tally()
    stop = time.monotonic() + duration_s
    metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
    kinds, weights = [k for _, k in MIX], [w for w, _ in MIX]

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=base_url, timeout=120, headers=headers or {}) as http:
            while time.monotonic() < stop:
                _one(rng.choices(kinds, weights)[0], rng, http, grpc_target, model, tally, metadata)

    samples: list[tuple[float, float, float]] = []  # (seconds, all server processes MB, router MB)
    t0 = time.monotonic()
    router = psutil.Process(router_pid) if router_pid else None

    def sample() -> None:
        while time.monotonic() < stop + 1:
            procs = _server_processes()
            samples.append((round(time.monotonic() - t0, 1), round(_rss_mb(procs), 1),
                            round(_rss_mb([router]), 1) if router else 0.0))
            time.sleep(2.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    # Memory after warm-up (the first fifth of the run: caches, first batches, graph buffers) vs the end.
    warm = [s for s in samples if s[0] >= duration_s / 5] or samples
    return {"duration_s": round(elapsed, 1), "concurrency": concurrency, "requests": dict(tally.requests),
            "total_requests": sum(tally.requests.values()), "outcomes": dict(sorted(tally.outcomes.items())),
            "unexpected": tally.unexpected, "generated_tokens": tally.tokens,
            "rss_mb": {"after_warmup": warm[0][1], "peak": max(s[1] for s in samples), "end": samples[-1][1],
                       "growth_after_warmup": round(samples[-1][1] - warm[0][1], 1)},
            "router_rss_mb": {"after_warmup": warm[0][2], "peak": max(s[2] for s in samples), "end": samples[-1][2],
                              "growth_after_warmup": round(samples[-1][2] - warm[0][2], 1)},
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny byte-level target and draft (fast steps)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--draft-model", default="smollm2-135m-draft")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)
    import tempfile

    from serve_support import make_byte_models, router_stats, running_server, serve_config, wait_idle

    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            target, draft = make_byte_models(Path(tmp))
            cfg = serve_config(target, draft, max_model_len=args.max_model_len,
                               engine_kwargs={"num_kv_blocks": 1024})
        else:
            cfg = {"model": args.model, "draft_model": args.draft_model, "max_model_len": args.max_model_len,
                   "device": "cpu", "num_speculative_tokens": 3}
        with running_server(cfg, num_cpus=8) as server:
            from serve_support import router_call

            router_pid = router_call(lambda r: os.getpid())
            result = run_soak(server.base, server.grpc_target, server.model, args.duration_s, args.concurrency,
                              args.seed, server.headers, router_pid)
            stats = wait_idle(timeout_s=60)
            result["after"] = {k: stats.get(k) for k in ("num_running", "num_waiting", "num_streams",
                                                         "kv_blocks_used", "healthy")}
            result["after"]["router"] = {k: v for k, v in router_stats().items() if k.startswith("num_")}
    result.update(environment(), command=" ".join(["python", "benchmarks/soak.py", *(argv or sys.argv[1:])]),
                  model="tiny byte-level pair" if args.tiny else f"{args.model} + {args.draft_model}")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    save_json(args.out, result)
    leaked = any(result["after"]["kv_blocks_used"].values()) or result["after"]["num_streams"]
    return 1 if result["unexpected"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
