"""Every option of `specserve serve`: the engine's, the speculation's and the serving layer's.

deploy.config.ServeConfig composes the three; flags, YAML keys, `serve run` arguments, KubeRay `args` and
docs/configuration.md all come from these fields (deploy/options.py). The engine's and the speculation's options
are the engine's config fields (engine/config.py, engine.config.engine_options), whose types and defaults they take;
here they get their help text, bounds and flag spellings. Flag names follow vLLM's where vLLM has the option
(`--max-num-seqs`, `--gpu-memory-utilization`, `-tp`, ...). To add an engine option, add its field to the engine's
config and a row here; a serving option, a field of ServingOptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy.options import engine_option, option, options_class, serving_option
from engine.config import REJECTION_MODES, SPECULATIVE_METHODS, option_default
from engine.quantization import QUANTIZE_AT_LOAD
from serving.engine_builders import DEFAULT_DRAFT_PLACEMENT, DRAFT_PLACEMENTS
from serving.openai.chat_options import load_chat_template
from serving.openai.reasoning_parser import REASONING_PARSERS
from serving.openai.tool_parsers import TOOL_PARSERS
from serving.router.request_stream import STREAM_INTERVAL_MS
from serving.serve_process_env import HTTP_PROXIES
from serving.serving_defaults import DRAIN_TIMEOUT_S, TENANT_TIMEOUT_S

DEFAULT_MODEL = option_default("model")
DEFAULT_DRAFT = "smollm2-135m-draft"  # the bundled distilled draft of DEFAULT_MODEL
AUTO = "auto"
# No fixed threshold by default: the draft length rule (engine/speculation/draft_length_rule.py) measures where
# speculation stops paying and sets k = 0 there; a threshold set by the user overrides the rule.
DEFAULT_SPEC_DISABLE_ABOVE_BATCH_SIZE = option_default("spec_disable_above_batch_size")
REQUEST_ROUTER_NAMES = ("power_of_two", "prefix_aware")  # serving.app.REQUEST_ROUTERS' keys


def _placement_option(name: str, text: str) -> tuple[str, Any, Any]:
    """A Ray placement mapping (resources or node labels) of the target's or the draft's ranks, given as YAML; unset
    by default."""
    hint = dict[str, float] | None if name.endswith("resources") else dict[str, str] | None
    return serving_option(name, hint, option(None, engine="extra", metavar="YAML", help=text))


# The engine's options take their types and defaults from the engine's config dataclasses (engine/config.py); what
# follows adds only how serving describes, bounds and spells them. engine="llm": engine.LLM's keyword argument,
# always passed to the engine builder; "extra": passed only when set to other than its default.
EngineOptions = options_class("EngineOptions", "The target model and how the engine runs it.", __name__, [
    engine_option("model", engine="llm", metavar="MODEL",
                  help="the model to serve: a bundled name, an HF directory or a .gguf file (also the first "
                       "positional argument, as in `vllm serve MODEL`)"),
    engine_option("tokenizer", engine="extra", help="the tokenizer's directory, when it is not the model's"),
    engine_option("trust_remote_code", engine="extra",
                  help="let a tokenizer run code its directory ships (specserve's own model code runs the supported "
                       "architectures; no model code is loaded)"),
    engine_option("dtype", engine="llm",
                  choices=("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16"),
                  help="weights' and activations' dtype; unset or auto: float32 on CPU, bfloat16 on GPU"),
    engine_option("kv_cache_dtype", engine="extra",
                  help="the KV cache's dtype: auto (the model's dtype) or that same dtype's name; quantized caches "
                       "(fp8) are refused"),
    engine_option("max_model_len", engine="llm", minimum=2,
                  help="context length served (prompt + output); unset: the model's, at most 4096"),
    engine_option("seed", engine="llm", help="the engine's random seed (sampling of requests without their own)"),
    engine_option("device", engine="llm",
                  help="where the models run: cpu or cuda; unset: cuda when the cluster has GPUs, else cpu"),
    engine_option("tensor_parallel_size", engine="llm", minimum=1, flags=("-tp",),
                  help="GPUs the target is split across (its worker actors)"),
    _placement_option(
        "target_resources",
        "Ray resources of each target rank, merged into its bundle (default CPU 1, plus GPU 1 on CUDA), e.g. "
        "'{specserve_target: 1}': a custom resource that only the target's nodes (a KubeRay worker group's "
        "rayStartParams) have places the target there"),
    _placement_option(
        "target_node_labels",
        "Ray node labels the target's ranks must be placed on, e.g. '{specserve/role: target}' (a worker "
        "group's rayStartParams labels)"),
    engine_option("enable_prefix_caching", engine="llm",
                  help="reuse the KV of full prompt blocks computed before, in the target's and the draft's caches"),
    engine_option("max_num_seqs", engine="extra", minimum=1,
                  help="requests in one batch at most (more wait for a slot)"),
    engine_option("max_num_batched_tokens", engine="extra", minimum=1,
                  help="tokens one step computes at most (long prompts are prefilled in chunks)"),
    engine_option("block_size", engine="extra", minimum=1, maximum=256, help="tokens per KV-cache block"),
    engine_option("gpu_memory_utilization", engine="extra", minimum=0.01, maximum=1.0,
                  on_cpu="no effect: on CPU each model's KV cache takes kv_cache_memory_bytes (1 GiB when unset)",
                  help="fraction of the GPU memory free after the weights load that each model's KV cache takes "
                       "(kv_cache_memory_bytes, when set, wins)"),
    engine_option("kv_cache_memory_bytes", engine="extra", minimum=1,
                  help="bytes of each model's KV cache; unset: from gpu_memory_utilization on GPU, 1 GiB on CPU"),
    engine_option("num_kv_blocks", engine="extra", minimum=1,
                  help="KV-cache blocks of each model, overriding the memory budget"),
    engine_option("enforce_eager", engine="extra", on_cpu="no effect: steps on CPU always run eagerly",
                  help="no CUDA graphs: every step runs eagerly (for debugging)"),
    engine_option("attention_backend", engine="extra", choices=("auto", "torch", "triton"),
                  help="auto: the Triton kernels on CUDA, the torch reference elsewhere"),
    engine_option("async_scheduling", engine="extra",
                  help="schedule step n+1 while step n runs; unset: on with the Ray executor, and on a GPU in "
                       "process for a target alone or a draft model (not an EAGLE-3 head, not speculation ahead)"),
    engine_option("load_format", engine="extra", choices=("auto", "dummy"),
                  help="auto: the checkpoint's weights; dummy: random weights of the config's shape (benchmarks)"),
    engine_option("quantization", engine="extra", choices=QUANTIZE_AT_LOAD, flags=("-q",),
                  help="quantize the target's weights at load (fp8: FP8 with a scale a row), where its checkpoint "
                       "holds its dtype; a checkpoint's own quantization_config (block FP8, compressed-tensors FP8) "
                       "needs none; unset: the weights as stored"),
    serving_option("engine_kwargs", dict[str, Any],
                   option(default_factory=dict, metavar="YAML",
                          help="further EngineConfig fields and engine-builder arguments, passed as given (they win "
                               "over the fields above)")),
    serving_option("engine_builder", str | None,
                   option(None, metavar="MODULE:FUNCTION",
                          help="the function that builds the engine; unset: target and draft on Ray worker actors")),
])

SpeculationOptions = options_class(
    "SpeculationOptions", "The draft and how it speculates (vLLM's --speculative-config JSON sets these too).",
    __name__, [
        # Served, an unset draft means the bundled draft of the default model (ServeConfig.resolved_draft); "none"
        # turns speculation off, as the engine's unset does.
        engine_option("draft_model", engine="llm", serving_default=AUTO,
                      help="the draft for speculative decoding (same forms as model); none: off; auto: the bundled "
                           "draft of the default model when installed"),
        engine_option("speculative_method", engine="extra", choices=SPECULATIVE_METHODS,
                      help="draft_model: the draft is a model of the target's vocabulary; eagle3: an EAGLE-3 head "
                           "over the target's hidden states, run in the target's processes unless draft_placement "
                           "is separate (vLLM's speculative_config method)"),
        engine_option("num_speculative_tokens", engine="llm", minimum=1, maximum=16, help="draft tokens per step, k"),
        engine_option("rejection_sampling", engine="llm", choices=REJECTION_MODES,
                      help="strict: greedy equality; probabilistic: lossless at any temperature; synthetic: a fixed "
                           "acceptance rate (benchmarks)"),
        engine_option("synthetic_acceptance_rate", engine="llm", minimum=0.0, maximum=1.0,
                      help="the acceptance rate with rejection_sampling synthetic"),
        # Also its text form, "B:K,..." (engine.draft_schedule.parse_schedule reads it).
        engine_option("draft_length_schedule", hint=list[tuple[int, int]] | str | None, engine="llm",
                      metavar="B:K,...",
                      help="a static draft length schedule: draft length K for steps of up to B requests, e.g. "
                           "4:4,16:2 (YAML: [[4, 4], [16, 2]]); set, it overrides adaptive_draft_length; unset: the "
                           "rule chooses k (or, with the rule off, num_speculative_tokens at every batch size)"),
        engine_option("spec_disable_above_batch_size", engine="llm", minimum=0, metavar="N",
                      help="no speculation for steps of more than N requests (verifying drafts for a large batch "
                           "costs more than it saves); set, it overrides adaptive_draft_length; none: no fixed "
                           "threshold"),
        engine_option("adaptive_draft_length", engine="extra",
                      help="choose each step's draft length k in 0..num_speculative_tokens from measured costs: the "
                           "draft's and the verify's step times at the current load and the acceptance per "
                           "position, for the most committed tokens a second (k = 0: the draft sits out until "
                           "speculation pays again); off while draft_length_schedule or "
                           "spec_disable_above_batch_size is set"),
        engine_option("draft_tensor_parallel_size", engine="llm", minimum=1, help="GPUs the draft is split across"),
        serving_option("draft_placement", str,
                       option(DEFAULT_DRAFT_PLACEMENT, engine="extra", choices=DRAFT_PLACEMENTS,
                              help="separate: the draft's ranks are actors of their own (an EAGLE-3 head's read "
                                   "the target's states from each result); colocated: inside the target's ranks, on "
                                   "their GPUs; auto: colocated where the draft could only share the target's GPUs, "
                                   "and for an EAGLE-3 head")),
        _placement_option(
            "draft_resources",
            "Ray resources of each draft rank (of a draft pool's replicas too), merged into its bundle, e.g. "
            "'{specserve_draft: 1}' to put the draft on the nodes that have that resource"),
        _placement_option(
            "draft_node_labels",
            "Ray node labels the draft's ranks (a draft pool's replicas too) must be placed on"),
        engine_option("speculation_ahead", engine="extra",
                      help="the draft drafts the next window while the target verifies this one; unset: on where "
                           "the draft has GPUs of its own"),
        engine_option("speculation_ahead_branches", engine="extra", minimum=1, maximum=18,
                      help="windows drafted ahead per request: 1 guesses all drafts accepted; more add the next "
                           "likeliest outcomes (at most num_speculative_tokens + 2)"),
        engine_option("speculation_ahead_tree_fanout", engine="extra", minimum=0, maximum=64,
                      help="tree mode of speculation ahead: one tree a request over every outcome of its verify, "
                           "with at most this many candidates for the target's token per outcome, drafted one "
                           "batched forward per depth; 0: the window mode (speculation_ahead_branches)"),
        engine_option("speculation_ahead_adaptive", engine="extra",
                      help="with several branches, draft only as many windows as measured to fit in the target's "
                           "verify; in tree mode, only as many tree nodes (down to one branch a request, or no tree "
                           "for the step); and at each load draft ahead only while it measures faster than not "
                           "drafting ahead"),
        engine_option("speculation_ahead_saguaro", engine="extra", minimum=0.0, maximum=1.0, metavar="C",
                      help="Saguaro sampling, with several branches or tree mode and probabilistic rejection: the "
                           "draft's two likeliest tokens at each draft (tree mode: fan-out + 1) are scaled by C (in "
                           "(0, 1)) before it draws, so a rejection's token more often has a window drafted ahead "
                           "(acceptance changes with it; still exact); unset or 1: off"),
        engine_option("draft_quantization", engine="extra", choices=QUANTIZE_AT_LOAD,
                      help="quantize the draft's weights at load, as quantization does the target's "
                           "(speculative_config's quantization key)"),
        engine_option("draft_token_map", engine="extra", metavar="FILE",
                      help="token ids (a JSON list or a torch tensor file) the draft's LM head is restricted to: a "
                           "faster draft step, still exact"),
    ])


@dataclass
class ServingOptions:
    """Endpoints, Serve deployments, reliability and security."""

    served_model_name: str | None = option(None, help="the model name clients send; unset: model")
    generation_config: str = option("auto", choices=("auto", "vllm"),
                                    help="auto: the model's generation_config.json gives the defaults of unset "
                                         "sampling fields (vLLM's default); vllm: OpenAI's defaults only")
    host: str = option("0.0.0.0", help="HTTP bind address (`specserve serve`; Serve's own config elsewhere)")
    port: int = option(8000, minimum=1, maximum=65535, help="HTTP port (`specserve serve`)")
    grpc_port: int = option(9000, minimum=1, maximum=65535, help="gRPC port (`specserve serve`)")
    num_replicas: int | None = option(1, help="engine replicas: each a router with its own target and draft "
                                              "worker groups")
    autoscaling_config: dict[str, Any] | None = option(
        None, metavar="YAML",
        help="scale engine replicas on load instead, e.g. '{min_replicas: 1, max_replicas: 4, "
             "target_ongoing_requests: 32}' (Serve's autoscaling_config; replaces num_replicas)")
    max_ongoing_requests: int = option(128, minimum=1,
                                       help="requests one engine replica holds (running + waiting) before Serve "
                                            "queues in front of it")
    router_actor_options: dict[str, Any] | None = option(None, metavar="YAML",
                                                         help="Ray actor options (resources) of each engine "
                                                              "replica's router")
    ingress_replicas: int | str = option(AUTO, metavar="N|auto",
                                         help="HTTP/gRPC replicas; auto: two per engine replica on GPUs (one "
                                              "streaming a GPU engine's tokens is the bottleneck at 16 streams), "
                                              "one on CPU")
    http_proxy: str = option(AUTO, choices=HTTP_PROXIES,
                             help="what takes client connections on a local cluster: haproxy (forwards each to an "
                                  "ingress replica), serve (Serve's Python proxy), auto: HAProxy for GPU engines when "
                                  "installed and host is every interface")
    direct_streaming: bool = option(False, help="the engine replicas answer HTTP and gRPC themselves: no ingress "
                                                "replicas, no handle hop (the HTTP proxy picks the replica)")
    stream_interval_ms: float = option(STREAM_INTERVAL_MS, minimum=0.0,
                                       help="after a stream's first tokens, an engine replica sends its tokens at "
                                            "most this often (the last ones at once): fewer, larger chunks through "
                                            "the handle, the ingress and the proxy under load; 0: every step's "
                                            "tokens as they come")
    ray_actor_options: dict[str, Any] | None = option(None, metavar="YAML",
                                                      help="Ray actor options of each HTTP/gRPC replica")
    request_router: str = option("power_of_two", choices=REQUEST_ROUTER_NAMES,
                                 help="how a request picks its engine replica: the shorter of two random queues, or "
                                      "the replica that served its longest prompt prefix")
    request_router_kwargs: dict[str, Any] | None = option(None, metavar="YAML",
                                                          help="options of the prefix_aware router "
                                                               "(serving/router/replica_router.py)")
    api_key: str | None = option(None, help="require `Authorization: Bearer KEY` (gRPC: metadata authorization); "
                                            "unset: $SPECSERVE_API_KEY if set, else no key")
    auth_health_metrics: bool = option(False, help="require the API key on /health and /metrics too")
    max_request_body_bytes: int | None = option(4 * 1024 * 1024, minimum=1,
                                                help="larger HTTP request bodies get 413; none: no limit")
    max_queued_requests: int | None = option(256, minimum=0,
                                             help="requests that may wait for a batch slot; more get 429 + "
                                                  "Retry-After; none: no bound")
    continue_without_draft: bool = option(False, help="if the draft's workers die, keep serving without "
                                                      "speculation while they restart")
    draft_replicas: int | None = option(None, minimum=1,
                                        help="a draft pool: this many draft replicas (each a draft group of its own "
                                             "GPUs and tensor parallelism) shared by the engine replicas, each engine "
                                             "attached to one; unset: every engine replica has a draft of its own")
    draft_autoscaling_config: dict[str, Any] | None = option(
        None, metavar="YAML",
        help="a draft pool whose replicas scale on the draft's load instead of draft_replicas, e.g. "
             "'{min_replicas: 1, max_replicas: 3}' (Serve's autoscaling_config; its policy: each replica's busy "
             "fraction, aimed at policy_kwargs.target_busy, 0.5 unless given; targets move to new replicas and off "
             "stopping ones)")
    draft_tenant_timeout_s: float = option(TENANT_TIMEOUT_S, minimum=1.0,
                                           help="with a draft pool: a draft replica frees the share of an engine "
                                                "replica it has not heard from for this long")
    drain_timeout_s: float = option(DRAIN_TIMEOUT_S, minimum=0.0,
                                    help="on shutdown, seconds the requests in flight may take to finish")
    # --- chat: tool calls, templates, reasoning (vLLM's flags; docs/tool_calling.md) ------------------
    enable_auto_tool_choice: bool = option(False, help="serve tool_choice auto (the default when tools are given): "
                                                       "the model may call a tool or answer; without it, a 400")
    tool_call_parser: str = option("hermes", choices=tuple(TOOL_PARSERS),
                                   help="the model family's tool-call markup, forced and parsed: hermes (Qwen, "
                                        "SmolLM), llama3_json, mistral, pythonic, openai (GPT-OSS's harmony, "
                                        "also chosen by a tokenizer with harmony's tokens)")
    chat_template: str | None = option(None, metavar="FILE|TEMPLATE",
                                       help="a Jinja chat template (a file path or the template itself) replacing "
                                            "the tokenizer's, for chat, /tokenize and gRPC")
    reasoning_parser: str | None = option(None, choices=tuple(REASONING_PARSERS),
                                          help="split <think>...</think> into reasoning_content, apart from content "
                                               "(openai_gptoss: GPT-OSS's harmony analysis channel)")

    def uses_draft_pool(self) -> bool:
        """Whether the draft runs as a pool of replicas of its own (draft_replicas or draft_autoscaling_config)."""
        return self.draft_replicas is not None or bool(self.draft_autoscaling_config)

    def chat_options(self) -> dict[str, Any]:
        """serving.openai.chat_options.ChatOptions.create's arguments; a template file is read here, where the path was
        given (the replicas may run on other nodes)."""
        return {"enable_auto_tool_choice": self.enable_auto_tool_choice, "tool_call_parser": self.tool_call_parser,
                "chat_template": load_chat_template(self.chat_template) if self.chat_template else None,
                "reasoning_parser": self.reasoning_parser}
