"""Engine configuration: what a model looks like (from its HF config) and how the engine runs it."""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

import torch

REJECTION_MODES = ("strict", "probabilistic", "synthetic")
# How the drafts are made: a separate draft model, or an EAGLE-3 head over the target's hidden states.
SPECULATIVE_METHODS = ("draft_model", "eagle3")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class LaunchConfig:
    """The models and where they run, as a user names them: LLM and the engine builders resolve these into
    ModelConfigs and EngineConfig's device, dtype and max_model_len."""

    model: str = DEFAULT_MODEL  # a bundled name, an HF directory or a .gguf file
    draft_model: str | None = None  # the same forms; None: no speculation
    device: str | None = None  # None: cuda when available, else cpu (resolve_device)
    dtype: str | None = None  # None or "auto": float32 on CPU, bfloat16 on GPU (resolve_dtype)
    max_model_len: int | None = None  # None: the model's context, at most model_setup.DEFAULT_MAX_MODEL_LEN


@dataclass
class SpeculativeConfig:
    draft_model: str
    num_speculative_tokens: int = 4
    rejection_sampling: str = "probabilistic"
    synthetic_acceptance_rate: float | None = None
    draft_tensor_parallel_size: int = 1
    # Load-adaptive speculation (engine/draft_schedule.py): the draft length of a step follows its batch size,
    # because verifying k drafts per request costs more the larger the batch, until speculation loses to
    # plain decoding. Pairs (max_batch_size, k), ascending; None: num_speculative_tokens at every size.
    draft_length_schedule: list[tuple[int, int]] | None = None
    # Steps whose batch is larger than this run without speculation (the draft does not run; it catches up
    # when the batch shrinks). None: never off.
    spec_disable_above_batch_size: int | None = None
    # "draft_model": draft_model is a model of the target's vocabulary; "eagle3": an EAGLE-3 head
    # (engine/models/eagle3.py) reading the target's hidden states, in the target's process. vLLM's "method".
    speculative_method: str = "draft_model"

    def validate(self) -> None:
        from engine.draft_schedule import validate_schedule

        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.speculative_method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        validate_schedule(self.draft_length_schedule, self.spec_disable_above_batch_size, k)
        if self.rejection_sampling not in REJECTION_MODES:
            raise ValueError(f"rejection_sampling must be one of {REJECTION_MODES}, "
                             f"got {self.rejection_sampling!r}")
        rate = self.synthetic_acceptance_rate
        if self.rejection_sampling == "synthetic":
            if rate is None or not 0.0 <= rate <= 1.0:
                raise ValueError(f"synthetic_acceptance_rate must be in [0, 1] with rejection_sampling="
                                 f"'synthetic', got {rate!r}")
        elif rate is not None:
            raise ValueError("synthetic_acceptance_rate is only used with rejection_sampling='synthetic'")

    def has_static_schedule(self) -> bool:
        """Whether the user set a static schedule (a schedule or a threshold): it overrides the draft length rule."""
        return self.draft_length_schedule is not None or self.spec_disable_above_batch_size is not None

    def draft_length(self, batch_size: int) -> int:
        """k for a step that runs `batch_size` requests (0: no speculation this step)."""
        from engine.draft_schedule import draft_length_for

        return draft_length_for(batch_size, self.num_speculative_tokens, self.draft_length_schedule,
                                self.spec_disable_above_batch_size)


@dataclass
class EngineConfig:
    """How the engine runs: device, dtype, cache and batching limits."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int = 16
    # Bytes for each model's KV cache. CPU default is modest; GPU runs size it from free memory.
    kv_cache_memory_bytes: int | None = None
    # Without kv_cache_memory_bytes, on GPU: the fraction of the memory free after the weights load that each
    # model's KV cache takes.
    gpu_memory_utilization: float = 0.5
    # "auto": the model's dtype. The caches hold the model's dtype only (no quantized KV): any other is refused.
    kv_cache_dtype: str = "auto"
    # The tokenizer's directory when it is not the model's; trust_remote_code lets it run code it ships (the models
    # are specserve's own implementations: no model code is loaded from a checkpoint).
    tokenizer: str | None = None
    trust_remote_code: bool = False
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use it to force preemption)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    tensor_parallel_size: int = 1
    # "auto": the Triton kernels (engine/kernels) on CUDA, the torch reference elsewhere.
    attention_backend: str = "auto"
    # Run every step eagerly (no CUDA graphs): for debugging, and the only mode off CUDA.
    enforce_eager: bool = False
    # Batch sizes to capture graphs for; None: 1, 2, 4, 8, then steps of 8 up to min(max_num_seqs, 64).
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Token counts to capture mixed-batch graphs for (a prefill chunk beside decodes, engine/runner/cuda_graphs.py);
    # None: powers of two from 32 up to 2048 (within the step's token budget); (): none, such steps run eagerly.
    cuda_graph_mixed_token_sizes: tuple[int, ...] | None = None
    # Draft tokens per step the runners size their buffers and graphs for (set from SpeculativeConfig).
    num_speculative_tokens: int = 0
    # "auto": the checkpoint's weights; "dummy": random weights (benchmarks of a shape from its config.json).
    load_format: str = "auto"
    # Quantize the target's weights at load ("fp8": FP8 weights with a float32 scale a row, engine/quantization),
    # where its checkpoint holds the model's dtype; a checkpoint's own quantization_config needs no option. None: as
    # the checkpoint holds them. draft_quantization: the same for the draft.
    quantization: str | None = None
    draft_quantization: str | None = None
    # Schedule step n+1 while step n runs (its tokens arrive one step later): the scheduler's hops and
    # bookkeeping leave the models' critical path, and a step the target runs alone is queued on the GPU before
    # step n's tokens are read (engine/decode_pipeline.py). None: on where the models run in other processes (the
    # Ray executor), and on a GPU in process for a target alone or a draft model with the draft length rule (its
    # k = 0 steps queue so); off in process with an EAGLE-3 head or speculation ahead and on CPU, where it would
    # only add a step of latency.
    async_scheduling: bool | None = None
    # Reuse the KV of full blocks whose token prefix was computed before (engine/kv_cache): both models' caches.
    enable_prefix_caching: bool = True
    # Speculation ahead (engine/speculation/ahead/proposer.py): the draft drafts the next window while the target
    # verifies this one. None: on where the draft has GPUs of its own (its forwards then overlap the verify),
    # off where it shares a device with the target, where the extra forwards would only queue behind it.
    speculation_ahead: bool | None = None
    # Windows drafted ahead per speculating request (engine/speculation/ahead/branches.py): 1 drafts only the
    # all-accepted outcome with the draft's argmax as the bonus token; more add the next likeliest outcomes (a second
    # bonus guess, a rejection after a accepted drafts with the draft's runner-up as the target's token), each in
    # scratch KV blocks the draft reserves for them. At most num_speculative_tokens + 2: the distinct outcomes guessed.
    speculation_ahead_branches: int = 1
    # Tree mode of speculation ahead (engine/speculation/ahead/tree.py): after each proposal the draft drafts one tree
    # per request covering every outcome of its verify (a = 0..k drafts accepted), with at most this many candidates
    # for the target's token per outcome (the draft's top-F there), each drafted k deep with one batched forward per
    # depth; a hit copies the branch's KV from scratch slots into the request's blocks. 0: the window path above.
    # Not combined with speculation_ahead_branches > 1. On the kernel path its forwards are CUDA graphs.
    speculation_ahead_tree_fanout: int = 0
    # Where the draft has GPUs of its own: with more than one branch, draft at most as many windows a request as
    # measured to fit in the target's verify (engine/speculation/ahead/budget.py), so a fan-out that would hold the next
    # step up is cut back; in tree mode, cap each step's tree nodes at what fits there (down to one branch a request,
    # or no tree for the step); and at each load (speculating requests a step, by powers of two) draft ahead only
    # while it measures faster than not drafting ahead (engine/speculation/ahead/gate.py). False: every step drafts
    # speculation_ahead_branches windows a request, or trees of speculation_ahead_tree_fanout (within
    # max_num_batched_tokens branches).
    speculation_ahead_adaptive: bool = True
    # The draft length of each step chosen from measured costs (engine/speculation/draft_length_rule.py): the k in
    # 0..num_speculative_tokens that commits the most tokens a second at the step's load, from the draft's and the
    # verify's measured times and the acceptance per position; k = 0 stops speculating until it pays again. A static
    # schedule (draft_length_schedule / spec_disable_above_batch_size) overrides it. False: every step drafts
    # num_speculative_tokens (or the schedule's k).
    adaptive_draft_length: bool = True
    # Saguaro sampling (engine/sample/saguaro.py) with speculation ahead's rejection windows: the draft draws each
    # draft token from its q with the two likeliest tokens there (a rejection window's root, the draft's runner-up,
    # is one of them; in tree mode the F + 1 likeliest, F = speculation_ahead_tree_fanout) scaled by this factor c
    # and renormalised, so the target's token after a rejection is more often
    # a root whose window was drafted ahead; acceptance changes with it (docs/ARCHITECTURE.md, "Saguaro sampling").
    # Still exact: the verify reads the scaled q each draft was drawn from. None or 1: off; otherwise c in (0, 1),
    # with speculation ahead, more than one branch or tree mode, and probabilistic rejection sampling (the only
    # mode whose replacement token reads q).
    speculation_ahead_saguaro: float | None = None
    # Benchmarks only, with synthetic rejection: the rate at which a lookup takes the target's token for the draft's
    # guess where a window was drafted for its outcome (the bonus token after all drafts accepted, or the token
    # at a rejection): random weights never agree on one.
    synthetic_bonus_agreement: float | None = None
    # Benchmarks only, with synthetic rejection, instead of synthetic_bonus_agreement: per verify outcome a (rows a =
    # 0..K-1 rejections, then the bonus outcome), P(the target's token is among the draft's top-f there), f = 1..,
    # measured on a real pair (benchmarks/tree_hit_rate.py --profile): a lookup with n candidates drafted ahead for
    # its outcome hits with the profile's top-n rate (engine/speculation/ahead/synthetic_agreement.py), so tree mode's
    # fan-out changes hits as on a real pair.
    synthetic_top_f_agreement: list[list[float]] | None = None
    # Forwards of at most this many tokens run each decoder layer's products through engine/kernels/small_m/linear.py,
    # norms, activation and residual adds folded in: fewer launches where a step is launch-bound (a batch-1 decode
    # or draft step, a draft's catch-up of two tokens, speculation-ahead branches). 4 by default, and 1 for layers
    # of hidden size 4096 and more (small_m_linear.rows_limit): beyond those the kernels were slower than cuBLAS on
    # an H100 (benchmarks/RESULTS.md). At most 64 (small_m_linear.MAX_ROWS): from 5 rows the wide path, aimed at a
    # tree's pre-drafting forwards and verifies of up to 64 tokens (tl.dot tiles, K split over the SMs where a
    # projection has too few column tiles; each norm's statistics written by the product before it, the activation
    # in gate_up's epilogue), measured no faster than cuBLAS there on an H200; beyond 64 cuBLAS. 0: never. Only on
    # the kernel devices (CUDA, or Triton's interpreter) and without tensor parallelism. Per GPU model, 1-4 rows of
    # some shapes take measured tiles, or cuBLAS, where that measured faster (small_m_tiles.FEW_ROWS_MEASURED), and
    # a wide layer whose whole wide path measured faster than cuBLAS (an 8B target's verify of 5-8 rows on an H200:
    # small_m_tiles.WIDE_LAYERS_MEASURED) takes it at those rows unless this is 0.
    small_m_rows: int = 4
    # Decode steps of at most this many requests of one token each (a draft's steps at batch 1-8) run every decoder
    # layer in one persistent launch (engine/kernels/persistent/decoder.py): one program per SM walks the layers,
    # meeting at grid barriers on the device, and streams the next stage's weights while it waits, instead of seven
    # launches a layer that each pay a ramp-up and a tail. Llama-family models (Llama, SmolLM2, Qwen2, Qwen3,
    # Mistral) of one KV-cache group, hidden size below 4096, without tensor parallelism, on CUDA; other steps and
    # models run the ordinary layers. 0: never. At most 8.
    persistent_decode_rows: int = 0
    # A file of token ids (a JSON list, or a 1-D integer tensor saved with torch.save) the draft's LM head is
    # restricted to (engine/runner/draft_vocabulary.py): a smaller head for a faster draft step; exact whatever the
    # map holds, as the draft's q gives every other token probability 0. None: the whole vocabulary.
    draft_token_map: str | None = None

    def validate(self) -> None:
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.speculation_ahead not in (None, True, False):
            raise ValueError(f"speculation_ahead must be true, false or null, got {self.speculation_ahead!r}")
        branches = self.speculation_ahead_branches
        if (not isinstance(branches, int) or isinstance(branches, bool)
                or not 1 <= branches <= self.num_speculative_tokens + 2):
            raise ValueError(f"speculation_ahead_branches must be an integer in [1, num_speculative_tokens + 2 = "
                             f"{self.num_speculative_tokens + 2}], got {branches!r}")
        fanout = self.speculation_ahead_tree_fanout
        if not isinstance(fanout, int) or isinstance(fanout, bool) or not 0 <= fanout <= 64:
            raise ValueError(f"speculation_ahead_tree_fanout must be an integer in [0, 64], got {fanout!r}")
        if fanout and branches > 1:
            raise ValueError("speculation_ahead_tree_fanout (a tree of every outcome) and speculation_ahead_branches "
                             f"> 1 (a window per outcome) are two modes of speculation ahead: set one, got fan-out "
                             f"{fanout} and {branches} branches")
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(f"adaptive_draft_length must be true or false, got {self.adaptive_draft_length!r}")
        if not isinstance(self.speculation_ahead_adaptive, bool):
            raise ValueError("speculation_ahead_adaptive must be true or false, got "
                             f"{self.speculation_ahead_adaptive!r}")
        self._validate_saguaro()
        rate = self.synthetic_bonus_agreement
        if rate is not None and not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
            raise ValueError(f"synthetic_bonus_agreement must be in [0, 1], got {rate!r}")
        if self.synthetic_top_f_agreement is not None:
            from engine.agreement_profile import AgreementProfile

            AgreementProfile.from_table(self.synthetic_top_f_agreement)
            if rate is not None:
                raise ValueError("synthetic_bonus_agreement (one rate) and synthetic_top_f_agreement (a measured "
                                 "profile) both set how a synthetic draft agrees: set one")
        if not 0 <= self.small_m_rows <= 64:  # small_m_linear.MAX_ROWS
            raise ValueError(f"small_m_rows must be in [0, 64], got {self.small_m_rows}")
        rows = self.persistent_decode_rows
        if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= 8:
            raise ValueError(f"persistent_decode_rows must be an integer in [0, 8], got {rows!r}")
        if self.draft_token_map is not None and not isinstance(self.draft_token_map, str):
            raise ValueError(f"draft_token_map must be the path of a token-id file, got {self.draft_token_map!r}")
        from engine.quantization import QUANTIZE_AT_LOAD

        for key in ("quantization", "draft_quantization"):
            if getattr(self, key) not in (None, *QUANTIZE_AT_LOAD):
                raise ValueError(f"{key} must be one of {list(QUANTIZE_AT_LOAD)} or unset, got {getattr(self, key)!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in ("auto", *_dtype_names(self.dtype)):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: the KV cache holds the "
                             f"model's dtype ({str(self.dtype).removeprefix('torch.')}); use auto")
        if self.tensor_parallel_size != 1:
            raise ValueError("the offline engine runs one process (tensor_parallel_size=1); use the Ray "
                             "serving layer for tensor parallelism")

    def _validate_saguaro(self) -> None:
        c = self.speculation_ahead_saguaro
        if c is None:
            return
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 < c <= 1.0:  # NaN fails too
            raise ValueError(f"speculation_ahead_saguaro must be a factor in (0, 1] (or null: off), got {c!r}")
        if c == 1.0:
            return
        if self.speculation_ahead is False:
            raise ValueError("speculation_ahead_saguaro scales the draft's q for windows drafted ahead: it needs "
                             "speculation_ahead (it is false)")
        if self.speculation_ahead_branches < 2 and not self.speculation_ahead_tree_fanout:
            raise ValueError("speculation_ahead_saguaro steers rejections onto the windows drafted for them: it needs "
                             "speculation_ahead_branches >= 2 or speculation_ahead_tree_fanout > 0 (with one window "
                             "only the all-accepted outcome is drafted)")


# EngineConfig's fields that are not options: LaunchConfig declares the first three as a user gives them (EngineConfig
# holds them resolved), and num_speculative_tokens is SpeculativeConfig's, copied for the runners.
_NOT_ENGINE_OPTIONS = ("device", "dtype", "max_model_len", "num_speculative_tokens")
# SpeculativeConfig's draft_model is LaunchConfig's (unset there: no speculation).
_NOT_SPEC_OPTIONS = ("draft_model",)


def engine_options() -> dict[str, tuple[type, Field]]:
    """Every engine option, by name, with the dataclass and field that declare it (its type, default and comment):
    LaunchConfig's fields, then SpeculativeConfig's, then EngineConfig's. The offline LLM's keyword arguments, the
    engine builders' and the serving options of the same names all follow these declarations."""
    out: dict[str, tuple[type, Field]] = {}
    for cls, skip in ((LaunchConfig, ()), (SpeculativeConfig, _NOT_SPEC_OPTIONS), (EngineConfig, _NOT_ENGINE_OPTIONS)):
        for f in fields(cls):
            if f.name not in skip:
                out[f.name] = (cls, f)
    return out


def option_default(name: str) -> Any:
    """The default of the engine option `name`, as its dataclass declares it."""
    _, f = engine_options()[name]
    if f.default_factory is not MISSING:
        return f.default_factory()
    if f.default is MISSING:
        raise ValueError(f"engine option {name!r} has no default")
    return f.default


def check_engine_options(names: Any, where: str) -> None:
    """TypeError naming every name in `names` that is not an engine option (`where`: who was given them)."""
    known = engine_options()
    unknown = sorted(str(n) for n in names if n not in known)
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {', '.join(map(repr, unknown))}; known: "
                        f"{', '.join(sorted(known))}")


def _dtype_names(dtype: torch.dtype) -> tuple[str, ...]:
    """The names resolve_dtype reads as `dtype`."""
    return tuple(name for name, dt in _DTYPES.items() if dt == dtype)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"auto" picks the Triton kernels on CUDA when triton is installed, the torch reference otherwise."""
    if name != "auto":
        return name
    import importlib.util

    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def graph_batch_sizes(cfg: EngineConfig) -> list[int]:
    """Batch-size buckets for CUDA graphs, ascending."""
    if cfg.cuda_graph_batch_sizes is not None:
        return sorted({b for b in cfg.cuda_graph_batch_sizes if 1 <= b <= cfg.max_num_seqs})
    cap = min(cfg.max_num_seqs, 64)
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    if cap not in sizes:
        sizes.append(cap)
    return sorted(set(sizes))


def mixed_graph_token_sizes(cfg: EngineConfig) -> list[int]:
    """Token-count buckets for mixed-batch CUDA graphs, ascending (the runner drops those its buffers cannot hold)."""
    if cfg.cuda_graph_mixed_token_sizes is not None:
        return sorted({t for t in cfg.cuda_graph_mixed_token_sizes if t >= 1})
    return [t for t in (32, 64, 128, 256, 512, 1024, 2048)
            if t <= max(32, cfg.max_num_batched_tokens + cfg.max_num_seqs)]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available on this machine")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact comparison with HF), bf16 on GPU, unless asked otherwise."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
