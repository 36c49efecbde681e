"""What answers HTTP and gRPC in a replica: the tokenizer and RouterClient, the security settings, the FastAPI app
and the gRPC method. The ingress replicas (serving/app.py) hold one around a handle to the engine replicas; with
direct streaming (serving/engine_ingress.py) each engine replica holds one around its own router."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from serving import grpc_service
from serving.openai.api import create_openai_app
from serving.openai.chat_options import ChatOptions
from serving.openai.generation_config import load_generation_defaults
from serving.openai.protocol import SUPPORTED_DEFAULTS
from serving.router.client import RouterClient


class FrontEnd:
    """engine: what RouterClient streams from (a DeploymentHandle of the engine replicas, or a ReplicaEngine).
    security: `api_key` (None: the SPECSERVE_API_KEY environment variable, else no key), `max_request_body_bytes`,
    `auth_health_metrics` (see deploy.config.ServeConfig). generation_config: "auto" (the model's
    generation_config.json gives sampling defaults) or "vllm" (OpenAI's defaults). tokenizer: `tokenizer_source`'s
    mapping (the engine's --tokenizer and --trust-remote-code). chat: ChatOptions.create's arguments (tool-call
    and reasoning parsers, auto tool choice, a chat template replacing the model's)."""

    def __init__(self, engine: Any, model: str, served_model_name: str | None, max_model_len: int,
                 security: dict[str, Any] | None = None, generation_config: str = "auto",
                 tokenizer: dict[str, Any] | None = None, chat: dict[str, Any] | None = None) -> None:
        from engine.llm import load_tokenizer
        from engine.models.source import resolve_model

        # The first engine replica resolved (and, for a GGUF, converted) the model before it answered: on its node
        # this is a cache hit; elsewhere it converts once, under the source's file lock. Only the tokenizer is read
        # here: a directory of random weights (load_format "dummy") holds none.
        model_dir = str(resolve_model(model, require_weights=False).path)
        source = tokenizer or {}
        tokenizer = load_tokenizer(source.get("tokenizer") or model_dir, bool(source.get("trust_remote_code")))
        if tokenizer is None:
            raise ValueError(f"model {model} has no tokenizer: the HTTP and gRPC APIs need one for text")
        self.chat_options = ChatOptions.create(**(chat or {}))
        if self.chat_options.chat_template is not None:  # chat, /tokenize and gRPC's chat all render with it
            tokenizer.chat_template = self.chat_options.chat_template
        self.client = RouterClient(engine, served_model_name or model, tokenizer, max_model_len,
                                   load_generation_defaults(model_dir, SUPPORTED_DEFAULTS)
                                   if generation_config == "auto" else {})
        security = dict(security or {})
        # A key from the environment (a Kubernetes Secret) stays out of Serve's stored config.
        self.api_key: str | None = security.get("api_key") or os.environ.get("SPECSERVE_API_KEY") or None
        self.max_body_bytes: int | None = security.get("max_request_body_bytes")
        self.auth_health_metrics = bool(security.get("auth_health_metrics", False))

    def asgi_app(self) -> Any:
        return create_openai_app(self.client, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                                 auth_health_metrics=self.auth_health_metrics, chat_options=self.chat_options)

    def grpc_generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        return grpc_service.generate(self.client, request, grpc_context, self.api_key)


def tokenizer_source(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Where the front end loads its tokenizer from: the engine's own tokenizer options."""
    return {"tokenizer": engine_args.get("tokenizer"), "trust_remote_code": bool(engine_args.get("trust_remote_code"))}
