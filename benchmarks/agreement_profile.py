"""Top-f agreement profiles: per verify outcome a, P(the target's token at position a is among the draft's top-f
tokens there | a), f = 1..8, measured on a real pair by benchmarks/tree_hit_rate.py (`--profile FILE`), and read by
the synthetic-pair benchmarks (`--agreement-profile FILE`: serve_layouts.py, load_sweep.py) into the engine's
benchmark-only option synthetic_top_f_agreement (engine/speculation/ahead/synthetic_agreement.py), so random weights
hit ahead-drafted candidates as often as that pair's draft would, fan-out by fan-out.

The file: {"benchmark": "top_f_agreement", "target", "draft", "k", "command", "environment", "profiles": [{"T",
"lookups", "acceptance_length", "P(a)", "top_f_agreement": [k + 1][8] (rows a = 0..k-1 rejections, then the bonus
outcome)}, ...]}, one profile per simulated temperature. The benchmarks are greedy: they read T = 0 unless told.
The bundled profiles/smollm2_top_f_agreement.json holds the SmolLM2 pair's (k = 4, 20 eval prompts, T = 0 and
0.7; its `command` says how it was made).

Against the single knob (--bonus-agreement R, synthetic_bonus_agreement): R credits every outcome's first window at
the same rate, which matches the profile for the window mode's default (one window, the argmax bonus) at R = the
bonus row's top-1 (SmolLM2, T=0: 0.749); the rejection rows' top-1 (0.28-0.44 there) and every f > 1 have no
counterpart in it, so for b<N> >= 2 and for tree layouts (f<N>) only the profile gives a real pair's hits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BUNDLED = Path(__file__).resolve().parent / "profiles" / "smollm2_top_f_agreement.json"


def profile_doc(payload: dict[str, Any]) -> dict[str, Any]:
    """The profile file's content from a tree_hit_rate.py run (its JSON payload)."""
    args = payload["args"]
    profiles = [{"T": res["T"], "lookups": res["lookups"], "acceptance_length": res.get("acceptance_length"),
                 "P(a)": [p["P(a)"] for p in res["positions"]],
                 "top_f_agreement": [p["top_f_agreement"] for p in res["positions"]]}
                for res in payload["results"]]
    return {"benchmark": "top_f_agreement", "target": args["target"], "draft": args["draft"], "k": args["k"],
            "prompts": payload["prompts_used"], "max_new_tokens": args["max_new_tokens"],
            "environment": payload["environment"], "profiles": profiles}


def load_agreement(path: str | Path, temperature: float = 0.0) -> list[list[float]]:
    """The top_f_agreement table of `path`'s profile at `temperature` (ValueError if it has none)."""
    doc = json.loads(Path(path).read_text())
    for prof in doc.get("profiles", []):
        if abs(float(prof["T"]) - temperature) < 1e-9:
            return [list(map(float, row)) for row in prof["top_f_agreement"]]
    raise ValueError(f"{path}: no top-f agreement profile at T={temperature} (it has "
                     f"{[p['T'] for p in doc.get('profiles', [])]})")


def add_agreement_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic-pair benchmarks' two ways to set how often a synthetic draft agrees with its target."""
    ap.add_argument("--bonus-agreement", type=float, default=None,
                    help="benchmark-only: rate at which a synthetic pair's bonus token counts as the draft's guess")
    ap.add_argument("--agreement-profile", default=None, metavar="FILE",
                    help="benchmark-only, synthetic pairs, instead of --bonus-agreement: a real pair's measured "
                         "top-f agreement per verify outcome (benchmarks/agreement_profile.py; the SmolLM2 pair's: "
                         "benchmarks/profiles/smollm2_top_f_agreement.json), so candidates drafted ahead hit as "
                         "often as that pair's draft would, tree fan-out included")


def check_agreement_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error for a profile given with the single rate, or for a pair that is not synthetic."""
    if args.agreement_profile is not None and (args.bonus_agreement is not None or args.pair != "qwen3-8b-0.6b"):
        ap.error("--agreement-profile sets a synthetic pair's agreement (qwen3-8b-0.6b): not with --bonus-agreement")
