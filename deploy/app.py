"""The application builder that `serve run` and KubeRay import.

    serve run deploy.app:build_app model=smollm2-135m-instruct draft_model=smollm2-135m-instruct \
        num_speculative_tokens=3 max_model_len=1024

KubeRay (serveConfigV2):

    applications:
      - name: specserve
        import_path: deploy.app:build_app
        route_prefix: /
        args: {model: smollm2-135m-instruct, draft_model: smollm2-135m-draft, num_speculative_tokens: 4,
               autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 32},
               request_router: prefix_aware}
    grpcOptions:
      port: 9000
      grpcServicerFunctions: [serving.grpc_service.add_servicer]

`args` take deploy.config.ServeConfig's fields; host/port/grpc_port are ignored here (Serve's http/grpc
options own the endpoints).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from deploy.config import ServeConfig

logger = logging.getLogger("specserve")


def default_device() -> str:
    """cuda when the cluster (not necessarily this process's node: KubeRay builds apps on the head) has
    GPUs, so the router asks Ray for one."""
    import ray

    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_local_cluster_env(config: ServeConfig | dict[str, Any]) -> dict[str, str]:
    """Before a local cluster for `config` (ServeConfig or its fields) starts: the Serve process environment its
    processes inherit (serving/serve_process_env.py), with the HTTP proxy it resolves to. Returns what is set."""
    from serving import serve_process_env

    cfg = config if isinstance(config, ServeConfig) else ServeConfig.from_dict(dict(config))
    return serve_process_env.apply(cfg.resolved_http_proxy(cfg.device or default_device()))


def build_app_from_config(cfg: ServeConfig) -> serve.Application:
    from serving.app import build_application
    from serving.engine_builders import DEFAULT_ENGINE_BUILDER

    cfg.validate()
    engine_args = cfg.engine_args()
    if engine_args["device"] is None:
        engine_args["device"] = default_device()
    logger.info("specserve app: %s", engine_args)
    return build_application(engine_args, cfg, engine_builder=cfg.engine_builder or DEFAULT_ENGINE_BUILDER,
                             ingress_replicas=cfg.resolved_ingress_replicas(engine_args["device"]))


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """`serve run deploy.app:build_app key=value ...` / KubeRay `args`: ServeConfig fields."""
    return build_app_from_config(ServeConfig.from_dict(dict(args or {})))
