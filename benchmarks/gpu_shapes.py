"""Model shapes the GPU benchmarks run with random weights (load_format "dummy": a directory with a config.json),
and the device's copy bandwidth, which sets the memory-bound floor of a decode step."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SHAPES = {
    # Qwen3-8B and Qwen3-0.6B (their published configs), SmolLM2-135M(-Instruct), Gemma 3 270M and 1B (five
    # 512-token sliding-window layers to one full-attention layer, one KV head of 256 dims), Qwen2.5-0.5B (a common
    # draft; hidden and intermediate sizes of 896 and 4864, no powers of two).
    "qwen3-8b": lambda: Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                    max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3-0.6b": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6),
    "smollm2-135m": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                        max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=1e5),
    "gemma3-270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            vocab_size=262144, sliding_window=512, max_position_embeddings=32768),
    "gemma3-1b": lambda: Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                          vocab_size=262144, sliding_window=512, max_position_embeddings=32768),
    "qwen2.5-0.5b": lambda: Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                        max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6),
    # Qwen3-32B and Qwen3-1.7B (the published configs): a larger dense pair.
    "qwen3-32b": lambda: Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                     num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3-1.7b": lambda: Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6),
    # gpt-oss-20b and gpt-oss-120b (the published configs): MoE with top-4 routing, attention sinks, 128-token
    # sliding windows alternating with full layers, the experts MXFP4 (everything else bf16), as released.
    "gpt-oss-20b": lambda: _gpt_oss(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": lambda: _gpt_oss(num_hidden_layers=36, num_local_experts=128),
    # Qwen3-30B-A3B (the published config): 128 bf16 experts of 768 features, top-8 normalized, every layer MoE.
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                            head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                            decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                                            max_position_embeddings=40960, tie_word_embeddings=False,
                                            rope_theta=1e6),
    # Llama-3.1-8B and Llama-3.2-1B (the published configs, llama3 RoPE scaling): the EAGLE-3 heads' first target.
    "llama-3.1-8b": lambda: LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        max_position_embeddings=131072, tie_word_embeddings=False,
                                        rope_theta=500000.0, rope_scaling=_llama3_rope(8.0)),
    "llama-3.2-1b": lambda: LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                        vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                                        rope_theta=500000.0, rope_scaling=_llama3_rope(32.0)),
}
ARCH = {"qwen3-32b": "Qwen3ForCausalLM", "qwen3-1.7b": "Qwen3ForCausalLM", "gpt-oss-20b": "GptOssForCausalLM",
        "gpt-oss-120b": "GptOssForCausalLM", "qwen3-8b": "Qwen3ForCausalLM",
        "qwen3-0.6b": "Qwen3ForCausalLM", "smollm2-135m": "LlamaForCausalLM",
        "gemma3-270m": "Gemma3ForCausalLM", "gemma3-1b": "Gemma3ForCausalLM", "qwen2.5-0.5b": "Qwen2ForCausalLM",
        "qwen3-30b-a3b": "Qwen3MoeForCausalLM", "llama-3.1-8b": "LlamaForCausalLM", "llama-3.2-1b": "LlamaForCausalLM"}


# A shape's name with this suffix is the shape's FP8 checkpoint: block-quantized 128 x 128 e4m3 weights with
# dynamic activation scales, as Qwen's and DeepSeek's FP8 releases write their quantization_config.
FP8_SUFFIX = "-fp8"
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _gpt_oss(**kw: int) -> GptOssConfig:
    layers = kw["num_hidden_layers"]
    cfg = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=64, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"] * (layers // 2), rope_theta=150000.0,
                       rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096},
                       max_position_embeddings=131072, tie_word_embeddings=False, **kw)
    cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return cfg


def hf_config(name: str):
    base = name.removesuffix(FP8_SUFFIX)
    cfg = SHAPES[base]()
    cfg.architectures = [ARCH[base]]
    if name.endswith(FP8_SUFFIX):
        cfg.quantization_config = dict(FP8_BLOCK)
    return cfg


def eagle3_head_dir(target: str, draft_vocab: int = 32000, root: str | Path | None = None) -> str:
    """A directory holding only an EAGLE-3 head's config.json for the `target` shape, in the flat EAGLE / SpecForge
    format: one Llama layer of the target's width and attention shape (the public heads for Qwen3-8B and gpt-oss
    are so), an MLP three times the width, a draft vocabulary of `draft_vocab` tokens, the default auxiliary layers;
    a gpt-oss head normalises the concatenated states before fc (norm_before_fc), as the public ones do."""
    cfg = hf_config(target)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": 3 * cfg.hidden_size, "num_hidden_layers": 1,
           "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
           "head_dim": head_dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": draft_vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": 1e6,
           "torch_dtype": "bfloat16", "norm_before_fc": target.startswith("gpt-oss")}
    path = Path(root if root is not None else Path(tempfile.gettempdir()) / "specserve-shapes") / f"{target}-eagle3"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def shape_dir(name: str, root: str | Path | None = None) -> str:
    """A directory holding only the shape's config.json (load with load_format='dummy')."""
    path = Path(root if root is not None else Path(tempfile.gettempdir()) / "specserve-shapes") / name
    hf_config(name).save_pretrained(path)
    return str(path)


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of `repeats`."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(name: str, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token of context takes in every layer (keys and values): what sizes the cache."""
    cfg = hf_config(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dtype_bytes


def kv_bytes_read(name: str, context: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one request's decode step reads at `context` tokens: every key and value of a full-attention
    layer, at most the window's in a sliding-window layer. What a step reads beyond the weights at long context."""
    cfg = hf_config(name)
    per_layer = kv_bytes_per_token(name, dtype_bytes) // cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return sum(per_layer * (min(context, window) if t == "sliding_attention" and window else context) for t in types)


def kv_memory_bytes(name: str, batch: int, max_len: int, least: int) -> int:
    """KV-cache memory for `batch` requests of `max_len` tokens (with a margin for partly filled blocks), at least
    `least` bytes."""
    return max(least, int(1.1 * batch * (max_len + 64) * kv_bytes_per_token(name)))


def prefill(runner, prompt: list[int], tables: list[list[int]]) -> None:
    """Write a prompt's KV through the runner in chunks its input buffers hold (a long context does not fit one
    forward's token buffers)."""
    from engine.runner.step_input import Chunk

    chunk = runner.buffers.max_num_tokens
    for start in range(0, len(prompt), chunk):
        runner.forward_chunks([Chunk(prompt[start:start + chunk], start, 0, tables)])


def step_bytes(model: torch.nn.Module, rows: int) -> int:
    """The weight bytes one forward of `rows` tokens reads in a model with routed experts: every weight but the
    experts', plus the experts that `rows` tokens are expected to route to (each token picks top_k of E distinct
    experts; over independent tokens E * (1 - (1 - top_k / E) ** rows) distinct ones), and the embedding table
    left out (a step reads one row of it) unless the LM head is tied to it. Dense models: weight_bytes."""
    from engine.models.moe import FusedExperts

    moe = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if not moe:
        return weight_bytes(model)
    total = weight_bytes(model)
    if not model.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    top_k = model.config.hf_config.num_experts_per_tok
    for m in moe:
        held = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        experts = m.num_experts
        touched = experts * (1 - (1 - top_k / experts) ** rows)
        total -= held * (1 - touched / experts)
    return int(total)
