"""Serving configuration: one set of field names for `specserve serve` flags, `--config` YAML files, the
`serve run deploy.app:build_app key=value` arguments and KubeRay's serveConfigV2 `args`, declared once in
deploy/serve_options.py.

Precedence: defaults < YAML file < command-line flags. Values may arrive as strings (`serve run` passes
`key=value` text); they are converted to the field's type, and unknown keys are errors that list the
known ones, so a typo in a config file does not silently fall back to a default. vLLM's `speculative_config`
mapping is read into the speculation fields (deploy/vllm_compat.py).
"""


from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy import options
from deploy.serve_options import (
    AUTO,
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    DEFAULT_SPEC_DISABLE_ABOVE_BATCH_SIZE,
    REQUEST_ROUTER_NAMES,
    EngineOptions,
    ServingOptions,
    SpeculationOptions,
)
from serving.engine_builders import NODE_PLACEMENT_OPTIONS
from serving.openai.chat_options import ChatOptions
from serving.serve_process_env import resolve_http_proxy

logger = logging.getLogger("specserve")

__all__ = ["AUTO", "DEFAULT_DRAFT", "DEFAULT_MODEL", "DEFAULT_SPEC_DISABLE_ABOVE_BATCH_SIZE", "REQUEST_ROUTER_NAMES",
           "ServeConfig", "coerce", "load_config", "load_yaml"]


@dataclass
class ServeConfig(ServingOptions, SpeculationOptions, EngineOptions):
    """The engine's, the speculation's and the serving layer's options in one flat set of fields."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServeConfig:
        return cls(**coerce(values))

    def updated(self, values: dict[str, Any]) -> ServeConfig:
        return dataclasses.replace(self, **coerce(values))

    def validate(self) -> None:
        """Raise ValueError for serving settings that cannot work: the declared bounds and choices, then the rules
        between fields (the engine checks the models: `preflight`)."""
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty: give a key, or leave it unset to serve without one")
        if self.num_replicas is not None and self.num_replicas < 1 and not self.autoscaling_config:
            raise ValueError(f"num_replicas must be >= 1 (engine replicas), got {self.num_replicas}")
        if self.ingress_replicas != AUTO and (not isinstance(self.ingress_replicas, int)
                                             or isinstance(self.ingress_replicas, bool) or self.ingress_replicas < 1):
            raise ValueError(f"ingress_replicas must be an integer >= 1 or 'auto', got {self.ingress_replicas!r}")
        options.check_bounds(self)
        from serving.workers.node_placement import check_node_placement

        check_node_placement({name: getattr(self, name) for name in NODE_PLACEMENT_OPTIONS})
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda (cuda:N), got {self.device!r}")
        if self.draft_replicas is not None and self.draft_autoscaling_config:
            raise ValueError("give draft_replicas (a fixed draft pool) or draft_autoscaling_config (a pool that "
                             "scales on load), not both")
        if self.draft_autoscaling_config:
            from serving.draft_pool.autoscaling import draft_autoscaling_config

            draft_autoscaling_config(self.draft_autoscaling_config)  # ValueError naming what Serve would refuse
        if self.uses_draft_pool() and self.resolved_draft() is None:
            raise ValueError("draft_replicas shares draft models between engine replicas: give a draft_model")
        if self.uses_draft_pool() and self.draft_placement == "colocated":
            raise ValueError("draft_replicas runs the draft in replicas of its own, so draft_placement 'colocated' "
                             "cannot apply; leave it auto or separate")
        if self.direct_streaming and self.request_router != "power_of_two":
            raise ValueError(f"direct_streaming: the HTTP proxy picks each request's engine replica, so request_router "
                             f"{self.request_router!r} cannot apply; use power_of_two")
        if self.direct_streaming and self.ingress_replicas != AUTO:
            raise ValueError(f"direct_streaming: the engine replicas are the ingress, so ingress_replicas "
                             f"({self.ingress_replicas}) cannot apply; leave it auto")
        ChatOptions.create(**self.chat_options())  # ValueError: a chat template file that does not exist

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
        """engine.LLM's keyword arguments (the engine builders'): its own always, EngineConfig's when set to other
        than their defaults, then engine_kwargs as given."""
        from engine.draft_schedule import parse_schedule, validate_schedule

        args: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            kind, value = f.metadata.get("engine"), getattr(self, f.name)
            if kind == "llm" or (kind == "extra" and value != options.default_of(f)):
                args[f.name] = value
        args["draft_model"] = self.resolved_draft()
        # The schedule in its list form, checked now, before Ray starts.
        args["draft_length_schedule"] = parse_schedule(self.draft_length_schedule)
        validate_schedule(args["draft_length_schedule"], self.spec_disable_above_batch_size,
                          self.num_speculative_tokens)
        if args.get("dtype") == "auto":
            args["dtype"] = None
        args.update(self.engine_kwargs)
        return args

    def cpu_notes(self) -> list[str]:
        """What GPU-only options that were set do where the engine runs on CPU."""
        notes = []
        for f in dataclasses.fields(self):
            note = f.metadata.get("on_cpu")
            if note and getattr(self, f.name) != options.default_of(f):
                notes.append(f"{options.flag_name(f.name)} {getattr(self, f.name)}: {note}")
        return notes

    def preflight(self, device: str) -> None:
        """Everything that can be checked before Ray starts, raising ValueError with the cause: the fields, the
        models (they resolve, GGUF files convert into the cache once), the draft against the target (vocabulary,
        context), the speculation settings and the engine's own checks, and the tokenizer."""
        import torch

        from engine.config import engine_options, resolve_dtype
        from engine.model_setup import configure_engine, split_launch

        self.validate()
        args = self.engine_args()
        dev = torch.device(device)
        # The engine's own options (builder-only ones, such as the Ray executor's, are the builder's to check).
        launch, opts = split_launch({k: v for k, v in args.items() if k in engine_options()}, "the engine options")
        _, config = configure_engine(launch.model, launch.draft_model, device=dev,
                                     dtype=resolve_dtype(launch.dtype, dev), max_model_len=launch.max_model_len,
                                     options=opts)
        # Tensor parallelism is the Ray executor's to check against the GPUs; the rest is the engine's.
        dataclasses.replace(config, tensor_parallel_size=1).validate()
        if self.tokenizer is not None:
            from transformers import AutoTokenizer

            try:
                AutoTokenizer.from_pretrained(self.tokenizer, trust_remote_code=self.trust_remote_code)
            except (OSError, ValueError) as e:
                raise ValueError(f"tokenizer {self.tokenizer!r} cannot be loaded: {e}") from e


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


def coerce(values: dict[str, Any]) -> dict[str, Any]:
    """Normalise keys (`num-replicas` -> `num_replicas`), read vLLM's speculative_config, reject unknown keys,
    convert strings to the fields' types."""
    from deploy.vllm_compat import expand_speculative_config

    return options.coerce(ServeConfig, expand_speculative_config(values), warn=logger.warning)
