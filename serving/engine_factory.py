"""One call from model names to a running EngineCore whose models live on Ray worker actors.

The router (serving/router/router.py) owns the returned EngineCore: it adds requests and calls `step()`. The
workers belong to `engine.executor` (a RayExecutor): call `engine.shutdown()` when done. The
tokenizer, when the model has one, is `engine.output.tokenizer`.
"""

from __future__ import annotations

import dataclasses
import logging

import ray
import torch

from engine.config import LaunchConfig, resolve_dtype
from engine.engine_core import EngineCore
from engine.llm import load_tokenizer
from engine.model_setup import configure_engine, split_launch
from serving.engine_builders import DEFAULT_DRAFT_PLACEMENT
from serving.workers.ray_executor import RayExecutor

logger = logging.getLogger("specserve")


def build_ray_engine(model: str = LaunchConfig.model, draft_model: str | None = LaunchConfig.draft_model, *,
                     use_compiled_graph: bool = True, target_resources: dict[str, float] | None = None,
                     draft_resources: dict[str, float] | None = None, draft_tensor_transport: str | None = None,
                     launch_verify_ahead: bool | None = None, draft_placement: str = DEFAULT_DRAFT_PLACEMENT,
                     step_timeout_s: float = 300.0, draft_pool: str | None = None,
                     target_node_labels: dict[str, str] | None = None,
                     draft_node_labels: dict[str, str] | None = None, **options: object) -> EngineCore:
    """Build the target (and draft) worker groups and the EngineCore that drives them.

    model, draft_model and `options` mean what they mean for `engine.LLM`: the engine options
    (engine.config.engine_options: device, dtype, max_model_len, the speculation's num_speculative_tokens,
    rejection_sampling, draft_tensor_parallel_size, ..., EngineConfig's seed, tensor_parallel_size, block_size, ...);
    other names are a TypeError naming them.
    launch_verify_ahead: see RayExecutor (None: where no GPU is shared between target and draft).
    draft_placement: "separate" (the draft's ranks are actors of their own), "colocated" (the draft runs inside
    each target rank's process, at the target's tensor-parallel size) or "auto" (colocated where the draft could
    only share the target's GPUs, else separate; see RayExecutor).
    device: "cuda" or "cpu" for the workers; None picks CUDA when the Ray cluster has GPUs (the router
    itself may run on a CPU-only node). draft_pool: attach to a shared draft group of that pool
    (serving/draft_pool/pool.py) instead of starting one. Ray is initialised (`ray.init()`) if it is not yet.
    """
    launch, options = split_launch({"model": model, "draft_model": draft_model, **options}, "build_ray_engine()")
    if not ray.is_initialized():
        ray.init()
    device = launch.device
    if device is None:
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    # Resolved here, once: a GGUF is converted into the cache on this node and the workers load the
    # directory. Workers on other nodes need that cache on a shared disk (SPECSERVE_CACHE_DIR).
    pair, config = configure_engine(launch.model, launch.draft_model, device=dev,
                                    dtype=resolve_dtype(launch.dtype, dev), max_model_len=launch.max_model_len,
                                    options=options)
    spec = pair.spec
    # EngineConfig.validate() refuses tensor parallelism (the offline engine is one process); here the
    # sizes are checked against the models by RayExecutor, so validate everything else.
    dataclasses.replace(config, tensor_parallel_size=1).validate()
    draft_path = str(pair.draft.path) if pair.draft is not None else None
    executor = RayExecutor(str(pair.target.path), config, draft_path,
                           rejection_sampling=spec.rejection_sampling if spec else None,
                           tensor_parallel_size=config.tensor_parallel_size,
                           draft_tensor_parallel_size=spec.draft_tensor_parallel_size if spec else 1,
                           use_compiled_graph=use_compiled_graph, target_resources=target_resources,
                           draft_resources=draft_resources, draft_tensor_transport=draft_tensor_transport,
                           launch_verify_ahead=launch_verify_ahead, draft_placement=draft_placement,
                           step_timeout_s=step_timeout_s, draft_pool=draft_pool,
                           target_node_labels=target_node_labels, draft_node_labels=draft_node_labels)
    try:
        tokenizer = load_tokenizer(config.tokenizer or str(pair.target.path), config.trust_remote_code)
        return EngineCore(executor, config, tokenizer, pair.target.eos_token_ids, spec)
    except BaseException:
        executor.shutdown()
        raise
