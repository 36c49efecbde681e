"""Serving a model shape with random weights (load_format "dummy": a directory with config.json and a tokenizer,
no checkpoint), the way the GPU benchmarks serve Qwen3-8B shapes, through the real Serve app with worker actors.

The random weights are drawn per checkpoint tensor from the tensor's name, so the served model (here with a
tensor-parallel draft) is the same model as the in-process engine's: greedy text must match it exactly. /metrics
splits each step into the models' phases and the router's own (schedule, dispatch, commit). The router switches
threads as often as the workers, and the target builds its verify inputs while the draft proposes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import ray
from byte_models import make_byte_models
from serve_support import completion, router_call, running_server, scrape, serve_config

from engine import LLM, SamplingParams
from serving.thread_switch import DEFAULT_GIL_SWITCH_INTERVAL_S

PROMPTS = ["hello there", "the quick brown fox"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def shape_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The byte models' directories without their weights: config and tokenizer only."""
    root = tmp_path_factory.mktemp("shapes")
    dirs = []
    for src in make_byte_models(root / "full"):
        dst = root / Path(src).name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        dirs.append(str(dst))
    return dirs[0], dirs[1]


def test_served_random_weights_equal_the_offline_engine(shape_dirs: tuple[str, str]) -> None:
    target, draft = shape_dirs
    offline = LLM(target, load_format="dummy", device="cpu", max_model_len=128, block_size=4)
    expected = [o.text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                        ignore_eos=True))]
    config = serve_config(target, draft, draft_tensor_parallel_size=2, engine_kwargs={"load_format": "dummy"},
                          adaptive_draft_length=False)  # drafts every step: the verify inputs are built meanwhile
    with running_server(config) as server, server.http() as client:
        texts = []
        for prompt in PROMPTS:
            r = completion(server, client, prompt, max_tokens=MAX_TOKENS)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        metrics = scrape(client)
        # The router's step thread and the target's verify input built while the draft proposes.
        interval = router_call(lambda r: sys.getswitchinterval())
        targets = router_call(lambda r: r.engine.executor.target.workers)
        ahead = ray.get([w.__ray_call__.remote(lambda w: w.num_prepared_ahead) for w in targets])
    assert texts == expected
    assert interval == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_S)
    assert ahead[0] > 0
    # The draft has its own shape (3 layers to the target's 2), so it is really a second model here.
    assert metrics["specserve_spec_decode_num_draft_tokens_total"] > 0
    for phase in ("schedule", "propose", "handoff", "prepare", "verify", "sample", "dispatch", "commit"):
        assert metrics[f'specserve_step_duration_seconds_count{{phase="{phase}"}}'] > 0, phase
