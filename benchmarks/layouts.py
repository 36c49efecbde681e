"""The layouts of benchmarks/serve_layouts.py: the `Layout` a name such as `t2+d1/shared` stands for (its grammar
is documented there), and the `specserve serve` config that runs it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from agreement_profile import load_agreement
from sweep_models import Pair

# Layout options naming the served app's HTTP proxy -> ServeConfig.http_proxy.
PROXY_OPTIONS = {"hap": "haproxy", "sp": "serve"}

# Options of the served app alone: the offline engine is one engine in this process, with no HTTP in front.
SERVED_ONLY = "i<N>, r<N>, p<M>, hap, sp and ds"
# What a draft pool (`p<M>`) does not take: its draft replicas serve their targets through plain actor calls (the
# draft steps of targets waiting at once batched into one; the executor turns the compiled graph, the NCCL transport
# and the verify launched ahead off for a pooled draft), behind the ingress, and they hold GPUs of their own. It
# drafts ahead as a draft group of one target does (predraft / nopredraft, b<N>, f<N>, sg<C>, fixed), for all of
# its targets at once (serving/draft_pool/ahead.py).
POOL_EXCLUDES = ("plain", "shared", "colocated", "nccl", "ahead", "noahead", "ds")


def _numbered(text: str, opts: list[str], prefix: str) -> tuple[int | None, list[str]]:
    """The N of a `<prefix><N>` option (N >= 1, at most one), and the options without it."""
    found = [o for o in opts if o.startswith(prefix) and o[len(prefix):].isdigit()]
    if len(found) > 1 or (found and int(found[0][len(prefix):]) < 1):
        raise ValueError(f"layout {text!r}: one {prefix}<N> option, N >= 1")
    return (int(found[0][len(prefix):]) if found else None), [o for o in opts if o not in found]


def _saguaro(text: str, opts: list[str]) -> tuple[float | None, list[str]]:
    """The C of an `sg<C>` option (0 < C < 1, at most one), and the options without it."""
    found = []
    for o in opts:
        if o.startswith("sg"):
            try:
                found.append((o, float(o[2:])))
            except ValueError:
                continue
    if len(found) > 1 or (found and not 0.0 < found[0][1] < 1.0):
        raise ValueError(f"layout {text!r}: one sg<C> option, 0 < C < 1 (1 would turn Saguaro sampling off)")
    return (found[0][1] if found else None), [o for o in opts if o not in {f for f, _ in found}]


@dataclass(frozen=True)
class Layout:
    name: str
    offline: bool
    target_tp: int
    draft_tp: int  # 0: no draft
    plain: bool = False
    shared: bool = False
    colocated: bool = False  # the draft in the target's worker processes (draft_placement "colocated")
    nccl: bool = False
    ahead: bool | None = None  # launch_verify_ahead forced on / off; None: the executor's default
    sync: bool = False  # async_scheduling off
    speculation_ahead: bool | None = None  # speculation_ahead forced on / off; None: the executor's default
    branches: int | None = None  # speculation_ahead_branches (`b<N>`); None: the engine's default
    fixed: bool = False  # `fixed`: every step drafts all b<N> windows / f<N> trees (speculation_ahead_adaptive off:
    # no fan-out budget, no on/off gate by load)
    ingress: int | None = None  # ingress_replicas (`i<N>`): HTTP shims in front of the engine; None: the default
    proxy: str | None = None  # http_proxy (`hap`: HAProxy, `sp`: Serve's proxy); None: the default ("auto")
    direct: bool = False  # direct_streaming (`ds`): the engine replica is the HTTP server, no ingress replicas
    fanout: int | None = None  # speculation_ahead_tree_fanout (`f<N>`): tree mode; None: the window mode
    saguaro: float | None = None  # speculation_ahead_saguaro (`sg<C>`); None: off
    replicas: int | None = None  # num_replicas (`r<N>`): engine replicas, each with the layout's GPUs; None: one
    pool: int | None = None  # draft_replicas (`p<M>`): a draft pool shared by the engine replicas; None: none

    @staticmethod
    def parse(text: str) -> Layout:
        head, *opts = text.split("/")
        offline = head in ("offline", "offline+d")
        # `b<N>`: speculation ahead drafts up to N windows a request (the likeliest verify outcomes).
        branches, opts = _numbered(text, opts, "b")
        # `f<N>`: speculation ahead's tree mode, one tree a request with up to N candidates per outcome.
        fanout, opts = _numbered(text, opts, "f")
        if fanout is not None and fanout > 64:
            raise ValueError(f"layout {text!r}: f<N> is at most 64 (the engine's bound on the tree fan-out)")
        saguaro, opts = _saguaro(text, opts)
        # `i<N>`: N ingress replicas (tokenize, template, stream back) in front of the engine replica.
        ingress, opts = _numbered(text, opts, "i")
        # `r<N>`: N engine replicas; `p<M>`: their drafts from a pool of M draft replicas.
        replicas, opts = _numbered(text, opts, "r")
        pool, opts = _numbered(text, opts, "p")
        # `hap` / `sp`: HAProxy or Serve's Python proxy takes the client connections.
        proxy_opts = [o for o in opts if o in PROXY_OPTIONS]
        if len(proxy_opts) > 1:
            raise ValueError(f"layout {text!r}: hap or sp, not both")
        proxy = PROXY_OPTIONS[proxy_opts[0]] if proxy_opts else None
        opts = [o for o in opts if o not in proxy_opts]
        direct = "ds" in opts
        if offline and (ingress is not None or replicas is not None or pool is not None or proxy is not None
                        or direct):
            raise ValueError(f"layout {text!r}: {SERVED_ONLY} set up the served app (its ingress, engine and draft "
                             "replicas, HTTP proxy); the offline engine has none: it is one engine in this process")
        if direct and ingress is not None:
            raise ValueError(f"layout {text!r}: ds makes the served engine replica its own ingress: neither the "
                             "offline engine nor i<N> go with it")
        if branches is not None and fanout is not None:
            raise ValueError(f"layout {text!r}: b<N> (a window per outcome) and f<N> (a tree of every outcome) are "
                             "two modes of speculation ahead: give one")
        if (branches is not None or fanout is not None) and "nopredraft" in opts:
            raise ValueError(f"layout {text!r}: b<N> and f<N> set speculation ahead's branches, which nopredraft "
                             "turns off")
        fixed = "fixed" in opts
        if fixed and branches is None and fanout is None:
            raise ValueError(f"layout {text!r}: fixed keeps every step at the b<N> windows (or f<N> trees) a "
                             "request; give b<N> or f<N>")
        if saguaro is not None and not (fanout is not None or (branches or 0) >= 2):
            raise ValueError(f"layout {text!r}: sg<C> steers rejections onto the windows drafted for them: it needs "
                             "f<N> or b<N> with N >= 2")
        opts = [o for o in opts if o not in ("fixed", "ds")]
        unknown = set(opts) - {"plain", "shared", "colocated", "nccl", "ahead", "noahead", "sync", "predraft",
                               "nopredraft"}
        if unknown:
            raise ValueError(f"layout {text!r}: unknown options {sorted(unknown)}")
        if "predraft" in opts and "nopredraft" in opts:
            raise ValueError(f"layout {text!r}: predraft or nopredraft, not both")
        ahead_mode = branches is not None or fanout is not None
        # b<N> and f<N> turn speculation ahead on: where it is off by default (in process, a shared GPU) a branch
        # budget alone would change nothing and the layout's name would say otherwise.
        spec_ahead = True if "predraft" in opts or ahead_mode else False if "nopredraft" in opts else None
        if offline:
            if set(opts) - ({"predraft", "sync"} if head == "offline+d" else {"sync"}):
                raise ValueError(f"layout {text!r}: the offline engine takes no options but sync, predraft, b<N>, "
                                 "f<N>, sg<C> and fixed (with a draft)")
            if ahead_mode and head != "offline+d":
                raise ValueError(f"layout {text!r}: b<N> and f<N> need a draft")
            return Layout(text, True, 1, int(head.endswith("+d")), sync="sync" in opts, speculation_ahead=spec_ahead,
                          branches=branches, fixed=fixed, fanout=fanout, saguaro=saguaro)
        parts = head.split("+")
        try:
            if not parts[0].startswith("t") or (len(parts) == 2 and not parts[1].startswith("d")) or len(parts) > 2:
                raise ValueError
            t, d = int(parts[0][1:]), int(parts[1][1:]) if len(parts) == 2 else 0
        except ValueError:
            raise ValueError(f"layout {text!r} is not t<T>[+d<D>][/plain][/shared|/colocated][/nccl][/ahead|/noahead]"
                             "[/sync][/predraft|/nopredraft][/b<N>|/f<N>[/sg<C>][/fixed]][/r<N>[/p<M>]][/i<N>]"
                             "[/hap|/sp][/ds]") from None
        if t < 1 or (len(parts) == 2 and d < 1):
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        if (set(opts) & {"shared", "colocated", "nccl", "ahead", "noahead", "predraft", "nopredraft"}
                or ahead_mode or pool is not None) and not d:
            raise ValueError(f"layout {text!r}: shared, colocated, nccl, ahead, noahead, predraft, nopredraft, "
                             "b<N>, f<N> and p<M> need a draft")
        if "colocated" in opts and (d != t or set(opts) & {"shared", "nccl", "ahead", "noahead"}):
            raise ValueError(f"layout {text!r}: colocated needs the target's size for the draft, and takes neither "
                             "shared, nccl, ahead nor noahead (no proposal leaves the target's process)")
        if "ahead" in opts and "noahead" in opts:
            raise ValueError(f"layout {text!r}: ahead or noahead, not both")
        if pool is not None:
            clash = sorted(set(opts + ["ds"] * direct) & set(POOL_EXCLUDES))
            if clash:
                raise ValueError(
                    f"layout {text!r}: p<M> takes none of {', '.join(clash)}: the pool's draft replicas have GPUs of "
                    "their own and answer their targets through plain actor calls behind the ingress")
            if pool > (replicas or 1):
                raise ValueError(f"layout {text!r}: p{pool} is more draft replicas than the {replicas or 1} engine "
                                 "replicas (r<N>) they would serve: the extra ones would hold GPUs and serve none")
        ahead = True if "ahead" in opts else False if "noahead" in opts else None
        return Layout(text, False, t, d, "plain" in opts, "shared" in opts, "colocated" in opts, "nccl" in opts,
                      ahead, "sync" in opts, spec_ahead, branches, fixed, ingress, proxy, direct, fanout, saguaro,
                      replicas, pool)

    @property
    def target_replicas(self) -> int:
        """Target engines serving requests: one offline, else num_replicas."""
        return self.replicas or 1

    @property
    def num_gpus(self) -> int:
        """GPUs the layout runs on: each engine replica's target ranks, and its draft's where the draft has GPUs of
        its own (not `shared`, not `colocated`, not offline); with a pool, the pool's draft replicas instead."""
        if self.offline:
            return 1
        own_draft = 0 if (self.shared or self.colocated or self.pool is not None) else self.draft_tp
        return self.target_replicas * (self.target_tp + own_draft) + (self.pool or 0) * self.draft_tp

    def reference_key(self, lossless: bool) -> bool:
        """Layouts with equal keys must give equal greedy outputs: all of them when rejection is lossless, else
        those with a draft apart from those without (synthetic acceptance changes the tokens)."""
        return not lossless and self.draft_tp > 0

    @property
    def is_reference(self) -> bool:
        # `shared` and `colocated` only place the draft, so a one-GPU run can take either as its reference.
        return not self.offline and self.target_tp == 1 and self.draft_tp <= 1 and self.ahead is None and not (
            self.plain or self.nccl) and not self.speculation_ahead and self.branches is None and (
            self.ingress is None) and (
            self.proxy is None and not self.direct) and self.fanout is None and self.replicas is None and (
            self.pool is None)


def serve_config(pair: Pair, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """The `specserve serve` config fields that run `layout` of `pair` (the offline engine reads the same)."""
    # Speculation ahead's branches of a request are rows of the draft loop, which max_num_seqs sizes: at
    # --concurrency 1 alone a b<N> layout would otherwise find one row and draft one branch (skipped_branches).
    max_seqs = getattr(args, "max_num_seqs", None) or max(args.concurrency)
    engine_kwargs: dict[str, Any] = {"max_num_seqs": max_seqs, **pair.engine_kwargs}
    if args.smoke:
        engine_kwargs.update(num_kv_blocks=512, max_num_batched_tokens=512)
    if args.device == "cuda" and layout.shared:
        engine_kwargs.update(target_resources={"GPU": 0.75}, draft_resources={"GPU": 0.25})
    if layout.colocated:
        engine_kwargs["draft_placement"] = "colocated"
    elif layout.draft_tp and not layout.offline:
        # Named, not left to the engine's default: a layout without `colocated` means the draft in processes of
        # its own, whatever placement the engine would pick for the GPUs it finds. (The offline engine has no
        # worker processes and takes no placement.)
        engine_kwargs["draft_placement"] = "separate"
    if layout.plain:
        engine_kwargs["use_compiled_graph"] = False
    if args.eager:
        engine_kwargs["enforce_eager"] = True
    if layout.nccl:
        engine_kwargs["draft_tensor_transport"] = "nccl"
    if layout.ahead is not None:
        engine_kwargs["launch_verify_ahead"] = layout.ahead
    if layout.sync:
        engine_kwargs["async_scheduling"] = False
    if layout.speculation_ahead is not None:
        engine_kwargs["speculation_ahead"] = layout.speculation_ahead
    if layout.branches is not None:
        engine_kwargs["speculation_ahead_branches"] = layout.branches
    if layout.fanout is not None:
        engine_kwargs["speculation_ahead_tree_fanout"] = layout.fanout
    if layout.saguaro is not None:
        if pair.rejection_sampling != "probabilistic":
            # Checked here, not by the engine at start-up: a layout that cannot run should not cost one.
            raise ValueError(f"layout {layout.name!r}: sg<C> scales the draft's q, which only probabilistic "
                             f"rejection reads; {pair.name} uses {pair.rejection_sampling!r} (use --pair smollm2)")
        engine_kwargs["speculation_ahead_saguaro"] = layout.saguaro
    if layout.fixed:
        engine_kwargs["speculation_ahead_adaptive"] = False
    if args.bonus_agreement is not None and layout.draft_tp and pair.synthetic_acceptance_rate is not None:
        engine_kwargs["synthetic_bonus_agreement"] = args.bonus_agreement
    profile = getattr(args, "agreement_profile", None)
    if profile is not None and layout.draft_tp and pair.synthetic_acceptance_rate is not None:
        # Benchmark-only, as the single rate above: a measured pair's top-f agreement per outcome.
        engine_kwargs["synthetic_top_f_agreement"] = load_agreement(profile)
    extra: dict[str, Any] = {} if layout.ingress is None else {"ingress_replicas": layout.ingress}
    if layout.proxy is not None:
        extra["http_proxy"] = layout.proxy
    if layout.direct:
        extra["direct_streaming"] = True
    if getattr(args, "stream_interval_ms", None) is not None:  # else the served default
        extra["stream_interval_ms"] = args.stream_interval_ms
    # Serve's fields, not the engine's: each engine replica takes whole GPUs of its own (every rank's bundle is one
    # GPU on CUDA unless `shared` splits it), and the pool's draft replicas one per draft rank.
    if layout.replicas is not None:
        extra["num_replicas"] = layout.replicas
    if layout.pool is not None:
        extra["draft_replicas"] = layout.pool
    return {**extra, "model": pair.target, "draft_model": pair.draft if layout.draft_tp else None,
            "num_speculative_tokens": args.k, "rejection_sampling": pair.rejection_sampling,
            "synthetic_acceptance_rate": pair.synthetic_acceptance_rate if layout.draft_tp else None,
            "tensor_parallel_size": layout.target_tp, "draft_tensor_parallel_size": max(1, layout.draft_tp),
            "max_model_len": args.max_model_len, "device": args.device, "dtype": args.dtype,
            "served_model_name": "bench", "engine_kwargs": engine_kwargs, "spec_disable_above_batch_size": None,
            "max_queued_requests": None}


def check_layouts(pair: Pair, layouts: list[Layout], args: argparse.Namespace) -> None:
    """Exit with the reason if a layout cannot run on the pair (sg<C> on a synthetic pair): before any starts, so
    that it fails at once rather than after the layouts before it ran."""
    for lay in layouts:
        try:
            serve_config(pair, lay, args)
        except ValueError as e:
            raise SystemExit(str(e)) from None
