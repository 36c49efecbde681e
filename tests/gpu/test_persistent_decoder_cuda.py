"""The persistent decoder on CUDA: the one-launch form (grid barriers, weights requested between arrival and wait)
against the torch reference and bit for bit against its own per-stage form, with the GPU's whole grid; replayed
from a CUDA graph; and the engine's greedy output with it equal to the ordinary layers', target alone and with a
draft (CUDA graphs, float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, make_tiny_model, random_prompts
from test_persistent_decoder import VARIANTS, make_case, reference, run

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_matches_reference_and_stages(variant, dtype):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (sms, 16):
        case = make_case("cuda", dtype, variant, seed=programs)
        want, want_cache = reference(case)
        staged_case = {**case, "caches": case["caches"].clone()}
        staged_case["weights"] = [type(w)(**{**w.__dict__, "key_cache": staged_case["caches"][i, 0],
                                             "value_cache": staged_case["caches"][i, 1]})
                                  for i, w in enumerate(case["weights"])]
        got, pd = run(case, programs)
        staged, _ = run(staged_case, programs, staged=True)
        torch.cuda.synchronize()
        assert int(pd.error) == 0
        assert torch.equal(got, staged)
        assert torch.equal(case["caches"], staged_case["caches"])
        tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=0.05)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(case["caches"].float(), want_cache.float(), **tol)


def test_graph_replays_follow_new_inputs():
    case = make_case("cuda", torch.float32, "qwen3")
    from engine.kernels.persistent.plan import PersistentDecoder

    pd = PersistentDecoder(case["shape"], case["weights"], case["cos"], case["sin"], max_rows=4)
    h = case["h"].clone()
    static = dict(h=h, pos=case["positions"].clone(), slots=case["slots"].clone(), seq=case["seq_lens"].clone())
    pd(h.clone(), static["pos"], static["slots"], static["seq"], case["block_table"])  # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pd(static["h"], static["pos"], static["slots"], static["seq"], case["block_table"])
    for extra in (0, 1):
        case2 = make_case("cuda", torch.float32, "qwen3")
        case2["seq_lens"] += extra
        case2["seq_lens"][2] = 0
        case2["positions"] = (case2["seq_lens"].long() - 1).clamp(min=0)
        bt, pos = case2["block_table"].long(), case2["positions"]
        slots = bt[torch.arange(3, device="cuda"), pos // 4] * 4 + pos % 4
        case2["slots"] = torch.where(case2["seq_lens"] > 0, slots, -1)
        want, _ = reference(case2)
        static["h"].copy_(case2["h"])
        static["pos"].copy_(case2["positions"])
        static["slots"].copy_(case2["slots"])
        static["seq"].copy_(case2["seq_lens"])
        # the graph's cache is case's: reset it to case2's starting cache
        case["caches"].copy_(case2["caches"])
        g.replay()
        torch.cuda.synchronize()
        assert int(pd.error) == 0
        torch.testing.assert_close(static["h"], want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_greedy_equal_with_and_without(tmp_path, family):
    target = make_tiny_model(tmp_path, family, TINY_CONFIGS[family])
    draft = make_tiny_model(tmp_path, family + "-draft", TINY_CONFIGS[family], scale=5.9)
    prompts = random_prompts([5, 19, 40, 3], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=128, max_num_seqs=4,
              cuda_graph_batch_sizes=(1, 2, 4), num_speculative_tokens=3)
    outs = {}
    for rows in (0, 4):
        for d in (None, draft.path):
            llm = LLM(target.path, draft_model=d, persistent_decode_rows=rows, **kw)
            outs[(rows, d)] = [o.token_ids for o in llm.generate(prompts, params)]
            del llm
    ref = outs[(0, None)]
    assert all(v == ref for v in outs.values()), outs
