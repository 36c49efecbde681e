"""Serving configuration: one set of field names for `specserve serve` flags, `--config` YAML files, the
`serve run deploy.app:build_app key=value` arguments and KubeRay's serveConfigV2 `args`.

Precedence: defaults < YAML file < command-line flags. Values may arrive as strings (`serve run` passes
`key=value` text); they are converted to the field's type, and unknown keys are errors that list the
known ones, so a typo in a config file does not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from serving.engine_builders import DRAFT_PLACEMENTS
from serving.serve_process_env import HTTP_PROXIES, resolve_http_proxy

logger = logging.getLogger("specserve")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-draft"  # the bundled distilled draft of DEFAULT_MODEL
AUTO = "auto"
# A server's batch grows with its load; past this size the draft's extra work outweighs what it saves on the
# models measured so far (benchmarks/RESULTS.md), so speculation is off. Tune with benchmarks/serve_sweep.py.
DEFAULT_SPEC_DISABLE_ABOVE_BATCH_SIZE = 32
REQUEST_ROUTER_NAMES = ("power_of_two", "prefix_aware")  # serving.app.REQUEST_ROUTERS' keys


@dataclass
class ServeConfig:
    # --- models and speculation (engine.LLM's arguments) ---------------------------------------------
    model: str = DEFAULT_MODEL
    draft_model: str | None = AUTO  # "auto": the bundled draft for the default model if installed; none = off
    num_speculative_tokens: int = 4
    rejection_sampling: str = "probabilistic"
    synthetic_acceptance_rate: float | None = None
    # Load-adaptive speculation (engine/draft_schedule.py): k per step from the batch size, "4:4,16:2" or
    # [[4, 4], [16, 2]]; none: num_speculative_tokens at every batch size.
    draft_length_schedule: list[Any] | str | None = None
    # No speculation for steps of more requests than this (verifying drafts for a large batch costs more than
    # it saves); none: speculate at every batch size.
    spec_disable_above_batch_size: int | None = DEFAULT_SPEC_DISABLE_ABOVE_BATCH_SIZE
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    # Where the draft runs: "separate" (its ranks are Ray actors of their own), "colocated" (inside the target's
    # ranks, on their GPUs) or "auto" (colocated where the draft could only share the target's GPUs).
    draft_placement: str = "auto"
    max_model_len: int | None = None
    device: str | None = None  # None: cuda when the cluster has GPUs, else cpu
    dtype: str | None = None
    seed: int = 0
    enable_prefix_caching: bool = True  # reuse the KV of full prompt blocks computed before (both models)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig extras (max_num_seqs, ...)
    engine_builder: str | None = None  # "module:function" building the EngineCore; None = the default
    served_model_name: str | None = None  # the name clients send as `model`; default: `model`
    # "auto": the model's generation_config.json gives the defaults of unset sampling fields (vLLM's default);
    # "vllm": OpenAI's defaults only. Its extra EOS ids apply either way (the engine reads them).
    generation_config: str = "auto"
    # --- endpoints (the CLI's serve.start; `serve run`/KubeRay set these in their own config) --------
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 9000
    # --- Serve deployments: engine replicas (a router + its target/draft worker groups) and the ingress ---
    num_replicas: int | None = 1  # engine replicas
    # Engine replicas on load, passed to Serve as is (min_replicas, max_replicas, target_ongoing_requests,
    # upscale_delay_s, downscale_delay_s, ...); replaces num_replicas.
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = 128  # requests one engine replica holds (running + waiting) before Serve queues
    router_actor_options: dict[str, Any] | None = None  # of each engine replica's router (resources)
    # HTTP/gRPC replicas (tokenize, template, route, stream back). "auto": on GPUs two per engine replica (at the
    # engines' largest count; Ray Serve LLM's ratio), since one replica streaming a GPU engine's tokens is the
    # bottleneck at 16 concurrent streams (benchmarks/RESULTS.md); on CPU one.
    ingress_replicas: int | str = AUTO
    # What takes the clients' connections: "haproxy" (HAProxy forwards each straight to an ingress replica's own
    # server), "serve" (Serve's Python proxy actor relays every request and streamed chunk), or "auto": HAProxy for
    # GPU engines when its binary is installed and `host` is every interface, else Serve's (serving/
    # serve_process_env.py says why). Applies to the local cluster `specserve serve` starts; on a cluster its pods'
    # RAY_SERVE_ENABLE_HA_PROXY decides.
    http_proxy: str = AUTO
    # The engine replicas answer HTTP and gRPC themselves (serving/engine_ingress.py): no ingress replicas and no
    # handle hop between them and the engine; the HTTP proxy picks the replica (no prefix affinity).
    direct_streaming: bool = False
    ray_actor_options: dict[str, Any] | None = None  # of each HTTP/gRPC replica
    # How the ingress picks an engine replica: "power_of_two" (Serve's default: the shorter of two random
    # replicas' queues) or "prefix_aware" (requests sharing a long prompt prefix go to one replica).
    request_router: str = "power_of_two"
    request_router_kwargs: dict[str, Any] | None = None  # options of serving/replica_router.py's router
    # --- reliability and security --------------------------------------------------------------------
    api_key: str | None = None  # clients send `Authorization: Bearer KEY`; None: $SPECSERVE_API_KEY, else open
    auth_health_metrics: bool = False  # also require the key on /health and /metrics (open by default)
    max_request_body_bytes: int | None = 4 * 1024 * 1024  # larger HTTP bodies get 413; None: no limit
    max_queued_requests: int | None = 256  # requests waiting for a batch slot; more get 429; None: no bound
    continue_without_draft: bool = False  # a dead draft group: serve without speculation while it restarts
    drain_timeout_s: float = 30.0  # on shutdown, how long requests in flight may take to finish
    # --- chat: tool calls, templates, reasoning (vLLM's flags; docs/tool_calling.md) ------------------
    enable_auto_tool_choice: bool = False  # serve tool_choice "auto" (the default with tools); else it is a 400
    tool_call_parser: str = "hermes"  # call markup: hermes (Qwen, SmolLM), llama3_json, mistral, pythonic
    chat_template: str | None = None  # a Jinja file path or inline template replacing the model's
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think>...</think> as reasoning_content

    def chat_options(self) -> dict[str, Any]:
        """serving.chat_options.ChatOptions.create's arguments; a template file is read here, where the path was
        given (the replicas may run on other nodes)."""
        from serving.chat_options import load_chat_template

        return {"enable_auto_tool_choice": self.enable_auto_tool_choice, "tool_call_parser": self.tool_call_parser,
                "chat_template": load_chat_template(self.chat_template) if self.chat_template else None,
                "reasoning_parser": self.reasoning_parser}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServeConfig:
        return cls(**coerce(values))

    def updated(self, values: dict[str, Any]) -> ServeConfig:
        return dataclasses.replace(self, **coerce(values))

    def validate(self) -> None:
        """Raise ValueError for serving settings that cannot work (the engine checks its own)."""
        from serving.chat_options import ChatOptions

        ChatOptions.create(**self.chat_options())  # ValueError: a parser or a template file that does not exist
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty: give a key, or leave it unset to serve without one")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1 (or none: no limit), "
                             f"got {self.max_request_body_bytes}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 (or none: no bound), got {self.max_queued_requests}")
        if self.draft_placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {list(DRAFT_PLACEMENTS)}, got {self.draft_placement!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.num_replicas is not None and self.num_replicas < 1 and not self.autoscaling_config:
            raise ValueError(f"num_replicas must be >= 1 (engine replicas), got {self.num_replicas}")
        if self.ingress_replicas != AUTO and (not isinstance(self.ingress_replicas, int) or self.ingress_replicas < 1):
            raise ValueError(f"ingress_replicas must be an integer >= 1 or 'auto', got {self.ingress_replicas!r}")
        if self.http_proxy not in HTTP_PROXIES:
            raise ValueError(f"http_proxy must be one of {list(HTTP_PROXIES)}, got {self.http_proxy!r}")
        if self.request_router not in REQUEST_ROUTER_NAMES:
            raise ValueError(f"request_router must be one of {list(REQUEST_ROUTER_NAMES)}, got {self.request_router!r}")
        if self.direct_streaming and self.request_router != "power_of_two":
            raise ValueError(f"direct_streaming: the HTTP proxy picks each request's engine replica, so request_router "
                             f"{self.request_router!r} cannot apply; use power_of_two")
        if self.direct_streaming and self.ingress_replicas != AUTO:
            raise ValueError(f"direct_streaming: the engine replicas are the ingress, so ingress_replicas "
                             f"({self.ingress_replicas}) cannot apply; leave it auto")

    def max_engine_replicas(self) -> int:
        """Engine replicas at their largest: num_replicas, or autoscaling's max_replicas."""
        return int((self.autoscaling_config or {}).get("max_replicas") or self.num_replicas or 1)

    def resolved_ingress_replicas(self, device: str) -> int:
        """`ingress_replicas` with "auto" decided for engines on `device` ("cuda..." or "cpu")."""
        if self.ingress_replicas != AUTO:
            return int(self.ingress_replicas)
        return 2 * self.max_engine_replicas() if str(device).startswith("cuda") else 1

    def resolved_http_proxy(self, device: str) -> str:
        """`http_proxy` with "auto" decided for engines on `device` and this config's `host`: "haproxy" or "serve".
        Raises ValueError for "haproxy" without its binary."""
        return resolve_http_proxy(self.http_proxy, device, all_interfaces=self.host in ("0.0.0.0", "::", ""))

    def resolved_draft(self) -> str | None:
        """`draft_model` with "auto" decided: the bundled draft of the default model, when it resolves here."""
        if self.draft_model != AUTO:
            return self.draft_model
        if self.model != DEFAULT_MODEL:
            return None
        from engine.models.source import BUNDLED_MODELS, resolve_model

        try:
            if DEFAULT_DRAFT not in BUNDLED_MODELS:
                raise ValueError("not a bundled name in this version")
            resolve_model(DEFAULT_DRAFT)  # a directory check for the bundled draft: cheap
        except ValueError as e:
            logger.warning("no bundled draft model %r (%s): serving %s without speculative decoding",
                           DEFAULT_DRAFT, e, self.model)
            return None
        return DEFAULT_DRAFT

    def engine_args(self) -> dict[str, Any]:
        """engine.LLM's keyword arguments."""
        args = {"model": self.model, "draft_model": self.resolved_draft(),
                "num_speculative_tokens": self.num_speculative_tokens, "rejection_sampling": self.rejection_sampling,
                "synthetic_acceptance_rate": self.synthetic_acceptance_rate,
                "tensor_parallel_size": self.tensor_parallel_size,
                "draft_tensor_parallel_size": self.draft_tensor_parallel_size, "max_model_len": self.max_model_len,
                "device": self.device, "dtype": self.dtype, "seed": self.seed,
                "enable_prefix_caching": self.enable_prefix_caching,
                **self._adaptive_spec_args()}
        if self.draft_placement != "auto":  # "auto" is the builders' default: a builder of one's own need not know it
            args["draft_placement"] = self.draft_placement
        args.update(self.engine_kwargs)
        return args


    def _adaptive_spec_args(self) -> dict[str, Any]:
        """The schedule in its list form (checked now, before Ray starts) and the threshold."""
        from engine.draft_schedule import parse_schedule, validate_schedule

        schedule = parse_schedule(self.draft_length_schedule)
        validate_schedule(schedule, self.spec_disable_above_batch_size, self.num_speculative_tokens)
        return {"draft_length_schedule": schedule, "spec_disable_above_batch_size": self.spec_disable_above_batch_size}


def load_yaml(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of field: value, not {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """Defaults, then the YAML file, then `overrides` (the flags given on the command line)."""
    cfg = ServeConfig()
    if path is not None:
        cfg = cfg.updated(load_yaml(path))
    return cfg.updated(overrides or {})


# --- type coercion ---------------------------------------------------------------------------------------
_NONE = {"none", "null", "~", ""}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def coerce(values: dict[str, Any]) -> dict[str, Any]:
    """Normalise keys (`num-replicas` -> `num_replicas`), reject unknown ones, convert strings to types."""
    hints = typing.get_type_hints(ServeConfig)
    out = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            known = ", ".join(ServeConfig.field_names())
            raise ValueError(f"unknown config field {key!r}; known fields: {known}")
        out[name] = _convert(name, value, hints[name])
    return out


def _convert(name: str, value: Any, hint: Any) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and typing.get_origin(hint) is not dict \
        else hint
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in _NONE):
        if not optional:
            raise ValueError(f"config field {name} cannot be empty")
        return None
    origin = typing.get_origin(base) or base
    try:
        if origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value)  # `serve run ... autoscaling_config='{min_replicas: 1}'`
            if not isinstance(value, dict):
                raise ValueError("expected a mapping")
            return value
        if origin is bool:
            if isinstance(value, str):
                v = value.strip().lower()
                if v not in _TRUE | _FALSE:
                    raise ValueError("expected true or false")
                return v in _TRUE
            return bool(value)
        if origin is int and str in args and isinstance(value, str) and not value.strip().lstrip("-").isdigit():
            return value.strip()  # `int | str` fields: a word ("auto") stays one; validate() judges it
        if origin is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if origin is float:
            return float(value)
        if origin is str:
            return str(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config field {name}: cannot use {value!r} ({e})") from e
    return value
