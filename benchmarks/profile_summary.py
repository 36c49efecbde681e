"""Where the host's time goes, per process: a summary of py-spy's raw (collapsed-stack) output, small enough to read
where the raw file is not (a served run's is over 100 MB).

    py-spy record --subprocesses --nonblocking --format raw -o prof.txt -- python3 benchmarks/serve_layouts.py ...
    python3 benchmarks/profile_summary.py prof.txt --top 25 [--within EngineCore.step]

For each process with samples: its share, the functions most often on its stacks (inclusive), the frames most often
at the top (self), and how many samples were inside Triton's compiler (a kernel compiled while serving stalls that
step for a second or more).
"""

from __future__ import annotations

import argparse
import collections
import re

_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """`fn (file.py:123)` -> `fn (file.py)`: one entry per function, whatever line was running."""
    return _LINE.sub(")", frame)


def summarize(path: str, top: int, min_share: float, within: str | None = None) -> str:
    per_process: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    compiling: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            process, *frames = stack.split(";")
            if within is not None and not any(within in fr for fr in frames):
                continue
            process = process[:110]
            totals[process] += n
            for name in {frame_name(fr) for fr in frames}:
                per_process[process][name] += n
            if frames:
                leaves[process][frame_name(frames[-1])] += n
            if any("triton/compiler" in fr for fr in frames):
                compiling[process] += n
    out = []
    grand = sum(totals.values()) or 1
    for process, n in totals.most_common():
        if n / grand < min_share:
            continue
        out.append(f"\n== {process}\n   {n} samples ({n / grand:.1%}), {compiling[process]} in Triton's compiler")
        out.append("   inclusive:")
        out += [f"   {c:7d} {c / n:6.1%}  {name[:140]}" for name, c in per_process[process].most_common(top)]
        out.append("   self:")
        out += [f"   {c:7d} {c / n:6.1%}  {name[:140]}" for name, c in leaves[process].most_common(top // 2)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-share", type=float, default=0.02, help="skip processes with fewer samples than this")
    ap.add_argument("--within", default=None, help="only stacks with a frame containing this, e.g. EngineCore.step")
    args = ap.parse_args()
    for path in args.paths:
        print(f"# {path}")
        print(summarize(path, args.top, args.min_share, args.within))


if __name__ == "__main__":
    main()
