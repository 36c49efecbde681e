"""Tiny random GPT-OSS and Qwen3-MoE checkpoints (HF transformers is the oracle) and the engine's logits at every
position of a prefill and of single-token decode steps, shared by tests/test_gpt_oss.py, tests/test_qwen3_moe.py and
tests/test_mxfp4.py (the logits by tests/test_models_vs_hf.py too)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import VOCAB, TinyModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from engine.config import EngineConfig
from engine.kv_cache.manager import KVCacheManager
from engine.model_config import ModelConfig
from engine.quantization import mxfp4
from engine.runner.model_runner import ModelRunner
from engine.runner.step_input import Chunk, build_step_input

# fp32 on CPU: the same math in another order (fused QKV, routed rows sorted by expert, paged gather); rounding-level.
ATOL, RTOL = 2e-4, 1e-4
BLOCK_SIZE = 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gpt_oss_config(**kw: object) -> GptOssConfig:
    """Sliding (window 3, under a KV block of 4) and full layers alternating; intermediate size equal to the hidden
    size as in gpt-oss, so the experts' [E, in, out] checkpoint layout could not pass for [E, out, in] by shape; YaRN
    RoPE as gpt-oss configures it (the config's default)."""
    base = dict(_COMMON, intermediate_size=64, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=131072,
                sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    base.update(kw)
    return GptOssConfig(**base)


def qwen3_moe_config(**kw: object) -> Qwen3MoeConfig:
    """Four layers, layer 1 dense by mlp_only_layers (tests/test_qwen3_moe.py also runs decoder_sparse_step 2)."""
    base = dict(_COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def qwen3_dense_config() -> Qwen3Config:
    return Qwen3Config(**_COMMON, intermediate_size=64, num_hidden_layers=1)


def make_model(root: Path, name: str, config: PretrainedConfig, seed: int = 0) -> TinyModel:
    """Random weights scaled so that each part of the model shows in the logits: matrices x 6 (peaked next-token
    distributions, as tests/conftest.py's tiny models), the experts' weights to std 0.5 (GPT-OSS's gate and up then
    pass its clamp at 7 on some rows), biases and attention sinks nonzero."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n and p.dim() >= 2:
                p.normal_(0, 0.5)
            elif p.dim() == 2:
                p.mul_(6.0)
            elif n.endswith("bias"):
                p.normal_(0, 0.1 if ".experts." not in n else 1.0)
            elif n.endswith("sinks"):
                p.normal_(0, 2.0)
    path = root / name
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return TinyModel(name, str(path), model, config)


def runner(path: str, num_blocks: int = 128) -> ModelRunner:
    mc = ModelConfig.from_path(path)
    mc.max_model_len = 256
    ec = EngineConfig(device=torch.device("cpu"), dtype=torch.float32, max_model_len=256, block_size=BLOCK_SIZE,
                      num_kv_blocks=num_blocks)
    return ModelRunner(mc, ec)


def engine_logits(r: ModelRunner, prompts: list[list[int]], decode_tokens: list[list[int]]
                  ) -> list[torch.Tensor]:
    """[the prefill's logits at every position of every prompt, then each decode step's logits (one token a
    prompt)]: one batched forward per step through the paged KV cache."""
    kv = KVCacheManager(r.kv_groups, r.num_blocks, block_size=BLOCK_SIZE)
    for i, p in enumerate(prompts):
        kv.allocate(str(i), 0, len(p))

    def tables(i: int) -> list[list[int]]:
        return [kv.block_table(str(i), g.group_id) for g in r.kv_groups]

    step = build_step_input([Chunk(p, 0, len(p), tables(i)) for i, p in enumerate(prompts)], r.kv_groups,
                            torch.device("cpu"))
    out = [r.execute(step)]
    seqs = [list(p) for p in prompts]
    for tokens in decode_tokens:
        for i, s in enumerate(seqs):
            kv.allocate(str(i), len(s), len(s) + 1)
        out.append(r.forward_chunks([Chunk([t], len(s), 1, tables(i)) for i, (s, t) in enumerate(zip(seqs, tokens))]))
        for s, t in zip(seqs, tokens):
            s.append(t)
    return out


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, prompts: list[list[int]], decode_tokens: list[list[int]]) -> list[torch.Tensor]:
    """What engine_logits returns, from the HF model run on each whole sequence."""
    out = [torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])]
    seqs = [list(p) for p in prompts]
    for tokens in decode_tokens:
        for s, t in zip(seqs, tokens):
            s.append(t)
        out.append(torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs]))
    return out


def decode_tokens(steps: int, batch: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (steps, batch), generator=g).tolist()


RELEASE_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def save_packed_copy(m: TinyModel, root: Path) -> tuple[str, str]:
    """A GPT-OSS model's experts quantized to MXFP4 and saved in the release layout (gate_up_proj_blocks
    [E, 2I, H / 32, 16], out x in, gate and up interleaved as in the unquantized [E, H, 2I]; down_proj_blocks
    [E, H, I / 32, 16]; biases unquantized; quantization_config mxfp4), and the dequantized copy (HF loads it).
    Loads the dequantized weights into m.hf. Returns (packed dir, dequantized dir)."""
    state = {n: t.detach().clone() for n, t in m.hf.state_dict().items()}
    packed_state: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(t.transpose(1, 2))  # [E, in, out] -> out x in
            packed_state[f"{n}_blocks"], packed_state[f"{n}_scales"] = blocks, scales
            state[n] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous()  # the dequantized copy
        else:
            packed_state[n] = t.contiguous()
    m.hf.load_state_dict(state)
    m.hf.save_pretrained(root / "dequantized")
    packed = root / "packed"
    packed.mkdir()
    save_file(packed_state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "dequantized" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(RELEASE_NOT_CONVERTED)}
    (packed / "config.json").write_text(json.dumps(cfg))
    return str(packed), str(root / "dequantized")
