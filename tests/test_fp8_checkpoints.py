"""FP8 checkpoints (engine/quantization): each format's loader and dequantization against a reference written block by
block (tests/fp8_checkpoints.py), tensor-parallel shards of the scales, greedy output on each format against HF
transformers on the dequantized float32 weights, FP8 beside a float32 draft or target (speculation stays lossless),
the `quantization` option's round trip, and the errors a config this engine cannot run gets."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
from fp8_checkpoints import dequantize_blocks, quantize_blocks, quantize_rows, write_fp8_checkpoint
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.models.loader import build_model
from engine.parallel import TensorParallelGroup, get_tp_group, set_tp_group
from engine.quantization.fp8 import FP8_DTYPE, dequantize_rows

PROMPTS = random_prompts([3, 11], seed=5)
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
KW = dict(block_size=4, max_model_len=64)
# Blocks smaller than a release's 128 x 128, so that the tiny shapes have several, and partial ones at the edges
# (64 rows: 24 + 24 + 16; k's 32 rows: 24 + 8).
BLOCK = (24, 32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return root, {f: make_tiny_model(root, f, TINY_CONFIGS[f]) for f in ("qwen3", "llama")}


def _cpu_model(path, **kw):
    return build_model(ModelConfig.from_path(path), torch.device("cpu"), torch.float32, **kw)


def test_block_fp8_loads_as_fp8_and_dequantizes_to_the_reference(tiny):
    root, models = tiny
    m = models["qwen3"]
    write_fp8_checkpoint(m.hf, m.config, root / "blk", "fp8-block", BLOCK)
    model = _cpu_model(root / "blk")
    hf = m.hf.state_dict()
    for i, layer in enumerate(model.model.layers):
        parts = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                 "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",)}
        for ours, names in parts.items():
            mod = layer.get_submodule(ours)
            assert mod.weight.dtype == FP8_DTYPE and mod.weight_scale.dtype == torch.float32  # held as FP8
            where = ours.split(".")[0]
            ref = torch.cat([dequantize_blocks(*quantize_blocks(hf[f"model.layers.{i}.{where}.{n}.weight"], *BLOCK),
                                               *BLOCK) for n in names])
            assert torch.equal(dequantize_rows(mod.weight, mod.weight_scale, mod.scale_group_k), ref), ours
    assert model.lm_head.weight.dtype == torch.float32  # never quantized: stays in the model's dtype


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor"])
def test_compressed_tensors_dequantize_to_the_reference(tiny, fmt):
    root, models = tiny
    m = models["llama"]
    write_fp8_checkpoint(m.hf, m.config, root / fmt, fmt, ignore=["re:.*layers\\.1\\.mlp\\..*"])
    model = _cpu_model(root / fmt)
    hf = m.hf.state_dict()
    qkv = model.model.layers[0].self_attn.qkv_proj
    ref = torch.cat([(lambda q, s: q.float() * s)(*quantize_rows(hf[f"model.layers.0.self_attn.{n}.weight"],
                                                                 fmt == "ct-tensor")) for n in ("q_proj", "k_proj",
                                                                                                 "v_proj")])
    assert torch.equal(dequantize_rows(qkv.weight, qkv.weight_scale, qkv.scale_group_k), ref)
    assert qkv.quant_method.format == ("fp8 per-tensor" if fmt == "ct-tensor" else "fp8 per-channel")
    kept = model.model.layers[1].mlp.down_proj  # in `ignore`: the checkpoint's bf16, in the model's dtype
    assert kept.quant_method is None and kept.weight.dtype == torch.float32
    assert torch.equal(kept.weight, hf["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float())


def test_tensor_parallel_shards_keep_their_scales(tiny):
    root, models = tiny
    m = models["llama"]
    path = root / "tp"
    write_fp8_checkpoint(m.hf, m.config, path, "fp8-block", BLOCK)
    whole = _cpu_model(path)
    before = get_tp_group()
    try:
        ranks = []
        for r in range(2):
            set_tp_group(TensorParallelGroup(rank=r, size=2))
            ranks.append(_cpu_model(path))
        set_tp_group(TensorParallelGroup(rank=0, size=2))
        cfg = copy.deepcopy(m.config)
        cfg.intermediate_size = 96  # 48 input features a rank for down_proj: splits a 32-column block
        write_fp8_checkpoint(AutoModelForCausalLM.from_config(cfg), cfg, root / "odd", "fp8-block", BLOCK)
        with pytest.raises(ValueError, match="splits a 32-wide FP8 scale block"):
            _cpu_model(root / "odd")
    finally:
        set_tp_group(before)

    def deq(mod):
        return dequantize_rows(mod.weight, mod.weight_scale, mod.scale_group_k)

    w, shards = whole.model.layers[0], [rk.model.layers[0] for rk in ranks]
    q, kv = 64, 32  # q rows and k (= v) rows of the whole model
    full = deq(w.self_attn.qkv_proj)
    for r, s in enumerate(shards):
        mine = torch.cat([full[r * 32:(r + 1) * 32], full[q + r * 16:q + (r + 1) * 16],
                          full[q + kv + r * 16:q + kv + (r + 1) * 16]])
        assert torch.equal(deq(s.self_attn.qkv_proj), mine)
        assert torch.equal(deq(s.mlp.down_proj), deq(w.mlp.down_proj)[:, r * 64:(r + 1) * 64])
        assert torch.equal(deq(s.self_attn.o_proj), deq(w.self_attn.o_proj)[:, r * 32:(r + 1) * 32])


@pytest.mark.parametrize("family,fmt", [("qwen3", "fp8-block"), ("llama", "ct-channel"), ("qwen3", "ct-tensor")])
def test_greedy_on_fp8_checkpoint_equals_hf_on_its_dequantized_weights(tiny, family, fmt):
    root, models = tiny
    m = models[family]
    oracle = write_fp8_checkpoint(m.hf, m.config, root / f"g-{family}-{fmt}", fmt, BLOCK,
                                  ignore=["model.layers.2.mlp"])
    llm = LLM(str(root / f"g-{family}-{fmt}"), **KW)
    want = [hf_greedy(oracle, p, NEW) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_fp8_beside_a_float_model_speculates_losslessly(tiny):
    """An FP8 target with a float32 draft, and a float32 target with a draft quantized at load: each speculative run
    equals its target alone (greedy), with drafts accepted."""
    root, models = tiny
    m = models["llama"]
    target_fp8 = root / "t-fp8"
    write_fp8_checkpoint(m.hf, m.config, target_fp8, "fp8-block", BLOCK)
    alone = [o.token_ids for o in LLM(str(target_fp8), **KW).generate(PROMPTS, GREEDY)]
    spec = LLM(str(target_fp8), draft_model=m.path, num_speculative_tokens=3, rejection_sampling="strict", **KW)
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert spec.executor.draft.weights["format"] == "float32"
    plain = [o.token_ids for o in LLM(m.path, **KW).generate(PROMPTS, GREEDY)]
    spec = LLM(m.path, draft_model=str(target_fp8), num_speculative_tokens=3, rejection_sampling="strict",
               draft_quantization="fp8", adaptive_draft_length=False, **KW)  # a fixed k: acceptance is counted
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert spec.spec_stats(outs).num_accepted_tokens > 0  # the FP8 draft agrees with its float32 original
    assert spec.executor.target.weights["format"] == "float32"


def test_quantization_option_quantizes_per_channel_at_load(tiny):
    root, models = tiny
    m = models["qwen3"]
    llm = LLM(m.path, quantization="fp8", **KW)
    target = llm.executor.target
    qkv = target.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
    plain = LLM(m.path, **KW).executor.target.weights
    assert target.weights["format"] == "fp8 per-channel + float32"
    assert target.weights["bytes"] < 0.6 * plain["bytes"]  # the projections' 4 bytes a weight are 1 now
    # The oracle: HF on each projection quantized a row at a time, dequantized.
    oracle = copy.deepcopy(m.hf)
    with torch.no_grad():
        for name, mod in oracle.named_modules():
            if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"):
                q, s = quantize_rows(mod.weight, per_tensor=False)
                mod.weight.copy_(q.float() * s)
    want = [hf_greedy(oracle, p, NEW) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def _write_config(path, src, quantization_config):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "static activation scales"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
     "only 8-bit float weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "dynamic": False}}}}, "static activation scales"),
    ({"quant_method": "fp8", "weight_block_size": [24, 32], "modules_to_not_convert": ["self_attn.k_proj"]},
     "runs as one matmul"),
])
def test_a_bad_quantization_config_is_refused_by_name(tiny, tmp_path, qc, match):
    root, models = tiny
    src = root / "qwen3"
    for f in src.glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    _write_config(tmp_path, src, qc)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **KW)


def test_mismatched_weights_and_options_are_refused(tiny, tmp_path):
    root, models = tiny
    m = models["qwen3"]
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(m.path, quantization="int4", **KW)
    write_fp8_checkpoint(m.hf, m.config, tmp_path, "fp8-block", BLOCK)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.down_proj"]  # stored as FP8 though
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="down_proj.weight' is torch.float8_e4m3fn where the model holds"):
        LLM(str(tmp_path), **KW)


def test_quantization_flags_reach_both_models_and_health_says_what_they_hold(tiny):
    """`--quantization fp8` and speculative_config's "quantization" (vLLM's spellings) quantize the target and the
    draft at load; speculation over the two stays lossless against the FP8 target alone; a router's /health report
    and start-up line name each model's format and bytes."""
    import asyncio
    import gc

    from deploy.cli import _given, build_parser
    from deploy.config import ServeConfig
    from serving.router.router import Router

    _, models = tiny
    target, draft = models["llama"].path, models["qwen3"].path
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--model", target, "--quantization", "fp8", "--speculative-config",
        f'{{"model": "{draft}", "num_speculative_tokens": 2, "rejection_sampling": "strict", "quantization": "fp8"}}',
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--block-size", "4"])
    engine_args = ServeConfig.from_dict(_given(args)).engine_args()
    llm = LLM(**engine_args)
    assert (llm.engine_config.quantization, llm.engine_config.draft_quantization) == ("fp8", "fp8")
    ex = llm.executor
    assert ex.target_weights["format"] == ex.draft_weights["format"] == "fp8 per-channel + float32"
    alone = LLM(target, quantization="fp8", **KW).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in alone]

    router = Router(dict(model=target, draft_model=draft, draft_quantization="fp8", device="cpu", dtype="float32",
                         **KW), engine_builder="serving.engine_builders:build_local_engine")
    gc.unfreeze()  # a router freezes its process's heap once started: not the test process's
    weights = asyncio.run(router.health())["weights"]
    plain = LLM(target, **KW).executor.target_weights
    assert weights["target"] == plain and weights["draft"]["format"] == "fp8 per-channel + float32"
    assert weights["draft"]["bytes"] < 0.6 * LLM(draft, **KW).executor.target_weights["bytes"]
    assert "draft weights fp8 per-channel + float32" in router.summary()


def test_random_weights_of_an_fp8_shape_are_held_in_its_format(tiny, tmp_path):
    """load_format dummy (benchmarks of a shape from its config.json) on a block-FP8 config: random weights
    quantized to its blocks at load, held as FP8."""
    root, models = tiny
    m = models["qwen3"]
    write_fp8_checkpoint(m.hf, m.config, tmp_path, "fp8-block", BLOCK)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # a shape's directory holds its config.json only
    model = _cpu_model(tmp_path, load_format="dummy")
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.weight_scale.shape == (64, 4) and down.scale_group_k == 32
    assert down.quant_method.format == "fp8 block 24x32"
    assert dequantize_rows(down.weight, down.weight_scale, 32).std() > 0.01


def test_a_registered_quant_method_is_asked_for_every_linear(tiny, tmp_path, monkeypatch):
    """The seam other formats plug into: a quant_method registered by name is asked, for each linear, with the
    checkpoint names it loads (a fused module's parts together); the method it returns loads and runs the module."""
    import engine.quantization as q

    asked: dict[str, list[str]] = {}

    class Halved(q.QuantizedMethod):  # holds down_proj's weight halved, doubles the product back
        format = "halved"
        quantize_at_load = True

        def process_after_loading(self, layer):
            layer.weight.data.mul_(0.5)

        def apply(self, layer, x, bias):
            return 2.0 * torch.nn.functional.linear(x, layer.weight, bias)

    class Seam(q.QuantizationConfig):
        def method_for(self, prefix, module, checkpoint_names):
            asked[prefix] = checkpoint_names
            return Halved() if prefix.endswith("down_proj") else None

    monkeypatch.setitem(q._FACTORIES, "test-seam", lambda raw, load_format: Seam())
    root, models = tiny
    m = models["llama"]
    for f in (root / "llama").glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    _write_config(tmp_path, root / "llama", {"quant_method": "test-seam"})
    llm = LLM(str(tmp_path), **KW)
    assert asked["model.layers.0.self_attn.qkv_proj"] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert asked["model.layers.2.mlp.gate_up_proj"] == ["model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]
    assert len(asked) == 4 * m.config.num_hidden_layers
    assert llm.executor.target_weights["format"] == "halved + float32"
    plain = LLM(m.path, **KW).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain]
