"""The layouts of benchmarks/serve_layouts.py: the `Layout` a name such as `t2+d1/shared` stands for (its grammar
is documented there), and the `specserve serve` config that runs it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sweep_models import Pair

# Layout options naming the served app's HTTP proxy -> ServeConfig.http_proxy.
PROXY_OPTIONS = {"hap": "haproxy", "sp": "serve"}

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
    predraft: bool | None = None  # speculation_ahead forced on / off; None: the executor's default
    branches: int | None = None  # speculation_ahead_branches (`b<N>`); None: the engine's default
    fixed: bool = False  # `fixed`: every step drafts all b<N> windows (speculation_ahead_adaptive off)
    ingress: int | None = None  # ingress_replicas (`i<N>`): HTTP shims in front of the engine; None: the default
    proxy: str | None = None  # http_proxy (`hap`: HAProxy, `sp`: Serve's proxy); None: the default ("auto")
    direct: bool = False  # direct_streaming (`ds`): the engine replica is the HTTP server, no ingress replicas

    @staticmethod
    def parse(text: str) -> Layout:
        head, *opts = text.split("/")
        # `b<N>`: speculation ahead drafts up to N windows a request (the likeliest verify outcomes).
        branch_opts = [o for o in opts if len(o) > 1 and o[0] == "b" and o[1:].isdigit()]
        if len(branch_opts) > 1 or (branch_opts and int(branch_opts[0][1:]) < 1):
            raise ValueError(f"layout {text!r}: one b<N> option, N >= 1")
        branches = int(branch_opts[0][1:]) if branch_opts else None
        # `i<N>`: N ingress replicas (tokenize, template, stream back) in front of the engine replica.
        ingress_opts = [o for o in opts if len(o) > 1 and o[0] == "i" and o[1:].isdigit()]
        if len(ingress_opts) > 1 or (ingress_opts and int(ingress_opts[0][1:]) < 1):
            raise ValueError(f"layout {text!r}: one i<N> option, N >= 1")
        ingress = int(ingress_opts[0][1:]) if ingress_opts else None
        if ingress is not None and head in ("offline", "offline+d"):
            raise ValueError(f"layout {text!r}: i<N> sets the served app's ingress replicas; the offline engine "
                             "has none")
        opts = [o for o in opts if o not in ingress_opts]
        # `hap` / `sp`: HAProxy or Serve's Python proxy takes the client connections.
        proxy_opts = [o for o in opts if o in PROXY_OPTIONS]
        if len(proxy_opts) > 1:
            raise ValueError(f"layout {text!r}: hap or sp, not both")
        proxy = PROXY_OPTIONS[proxy_opts[0]] if proxy_opts else None
        if proxy is not None and head in ("offline", "offline+d"):
            raise ValueError(f"layout {text!r}: hap and sp pick the served app's HTTP proxy; the offline engine "
                             "has none")
        opts = [o for o in opts if o not in proxy_opts]
        direct = "ds" in opts
        if direct and (head in ("offline", "offline+d") or ingress is not None):
            raise ValueError(f"layout {text!r}: ds makes the served engine replica its own ingress: neither the "
                             "offline engine nor i<N> go with it")
        opts = [o for o in opts if o != "ds"]
        if branches is not None and "nopredraft" in opts:
            raise ValueError(f"layout {text!r}: b<N> sets speculation ahead's branches, which nopredraft turns off")
        opts = [o for o in opts if o not in branch_opts]
        fixed = "fixed" in opts
        if fixed and branches is None:
            raise ValueError(f"layout {text!r}: fixed keeps every step at the b<N> windows a request; give b<N>")
        opts = [o for o in opts if o != "fixed"]
        unknown = set(opts) - {"plain", "shared", "colocated", "nccl", "ahead", "noahead", "sync", "predraft",
                               "nopredraft"}
        if unknown:
            raise ValueError(f"layout {text!r}: unknown options {sorted(unknown)}")
        if "predraft" in opts and "nopredraft" in opts:
            raise ValueError(f"layout {text!r}: predraft or nopredraft, not both")
        # b<N> turns speculation ahead on: where it is off by default (in process, a shared GPU) a branch budget
        # alone would change nothing and the layout's name would say otherwise.
        predraft = True if "predraft" in opts or branches is not None else False if "nopredraft" in opts else None
        if head in ("offline", "offline+d"):
            if set(opts) - ({"predraft", "sync"} if head == "offline+d" else {"sync"}):
                raise ValueError(f"layout {text!r}: the offline engine takes no options but sync and predraft "
                                 "(with a draft)")
            if branches is not None and head != "offline+d":
                raise ValueError(f"layout {text!r}: b<N> needs a draft")
            return Layout(text, True, 1, int(head.endswith("+d")), sync="sync" in opts, predraft=predraft,
                          branches=branches, fixed=fixed)
        parts = head.split("+")
        try:
            if not parts[0].startswith("t") or (len(parts) == 2 and not parts[1].startswith("d")) or len(parts) > 2:
                raise ValueError
            t, d = int(parts[0][1:]), int(parts[1][1:]) if len(parts) == 2 else 0
        except ValueError:
            raise ValueError(f"layout {text!r} is not t<T>[+d<D>][/plain][/shared|/colocated][/nccl][/ahead|/noahead]"
                             "[/sync][/predraft|/nopredraft][/b<N>[/fixed]][/i<N>][/hap|/sp][/ds]") from None
        if t < 1 or (len(parts) == 2 and d < 1):
            raise ValueError(f"layout {text!r}: sizes must be >= 1")
        if (set(opts) & {"shared", "colocated", "nccl", "ahead", "noahead", "predraft", "nopredraft"}
                or branches is not None) and not d:
            raise ValueError(f"layout {text!r}: shared, colocated, nccl, ahead, noahead, predraft, nopredraft "
                             "and b<N> need a draft")
        if "colocated" in opts and (d != t or set(opts) & {"shared", "nccl", "ahead", "noahead"}):
            raise ValueError(f"layout {text!r}: colocated needs the target's size for the draft, and takes neither "
                             "shared, nccl, ahead nor noahead (no proposal leaves the target's process)")
        if "ahead" in opts and "noahead" in opts:
            raise ValueError(f"layout {text!r}: ahead or noahead, not both")
        ahead = True if "ahead" in opts else False if "noahead" in opts else None
        return Layout(text, False, t, d, "plain" in opts, "shared" in opts, "colocated" in opts, "nccl" in opts,
                      ahead, "sync" in opts, predraft, branches, fixed, ingress, proxy, direct)

    @property
    def num_gpus(self) -> int:
        return self.target_tp if (self.offline or self.shared or self.colocated) else self.target_tp + self.draft_tp

    def reference_key(self, lossless: bool) -> bool:
        """Layouts with equal keys must give equal greedy outputs: all of them when rejection is lossless, else
        those with a draft apart from those without (synthetic acceptance changes the tokens)."""
        return not lossless and self.draft_tp > 0

    @property
    def is_reference(self) -> bool:
        # `shared` and `colocated` only place the draft, so a one-GPU run can take either as its reference.
        return not self.offline and self.target_tp == 1 and self.draft_tp <= 1 and self.ahead is None and not (
            self.plain or self.nccl) and not self.predraft and self.branches is None and self.ingress is None and (
            self.proxy is None and not self.direct)


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
    if layout.predraft is not None:
        engine_kwargs["speculation_ahead"] = layout.predraft
    if layout.branches is not None:
        engine_kwargs["speculation_ahead_branches"] = layout.branches
    if layout.fixed:
        engine_kwargs["speculation_ahead_adaptive"] = False
    if args.bonus_agreement is not None and layout.draft_tp and pair.synthetic_acceptance_rate is not None:
        engine_kwargs["synthetic_bonus_agreement"] = args.bonus_agreement
    extra: dict[str, Any] = {} if layout.ingress is None else {"ingress_replicas": layout.ingress}
    if layout.proxy is not None:
        extra["http_proxy"] = layout.proxy
    if layout.direct:
        extra["direct_streaming"] = True
    return {**extra, "model": pair.target, "draft_model": pair.draft if layout.draft_tp else None,
            "num_speculative_tokens": args.k, "rejection_sampling": pair.rejection_sampling,
            "synthetic_acceptance_rate": pair.synthetic_acceptance_rate if layout.draft_tp else None,
            "tensor_parallel_size": layout.target_tp, "draft_tensor_parallel_size": max(1, layout.draft_tp),
            "max_model_len": args.max_model_len, "device": args.device, "dtype": args.dtype,
            "served_model_name": "bench", "engine_kwargs": engine_kwargs, "spec_disable_above_batch_size": None,
            "max_queued_requests": None}
