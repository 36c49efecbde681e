"""`specserve distill` (engine/distill): a tiny random Llama target distilled end to end in seconds, the draft it
writes loads through the engine and speculates losslessly, training resumes where it stopped, and the bundled
SmolLM2 draft (slow) loads and accepts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TinyModel, random_prompts
from safetensors import safe_open

from deploy.cli import main
from engine import LLM, SamplingParams
from engine.distill.data import DistillSequence, collate, encode_prompt, load_prompts
from engine.distill.export import export_draft
from engine.distill.pipeline import DistillConfig, DistillReport, run_distill
from engine.distill.student import StudentSpec, build_student, source_layers, student_config
from engine.distill.teacher import load_teacher, precompute_topk
from engine.distill.trainer import CHECKPOINT_NAME, TrainConfig, Trainer
from engine.model_config import ModelConfig
from engine.models.loader import SHARED_FROM_KEY

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread avoids thread start-up and, on a shared CI runner, oversubscription
    (measured here: 20-100x slower steps with 2 threads on 2 busy cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def distilled(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> DistillReport:
    """The tiny Llama target (untied head, no tokenizer) distilled into a 2-layer draft: live teacher, a few steps,
    every 4th prompt held out for validation."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = DistillConfig(target=tiny_models["llama"].path, out=tmp_path_factory.mktemp("distill") / "draft",
                            train=TrainConfig(steps=30, batch_size=8, lr=3e-3, checkpoint_every=10),
                            max_new_tokens=12, num_prompts=16, val_every=4, eval_prompts=0, teacher_topk=0,
                            progress=False)
        return run_distill(cfg)
    finally:
        torch.set_num_threads(n)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


# ------------------------------------------------------------------------------------------------ data, shapes


def test_prompt_splits_are_disjoint() -> None:
    train, evals = load_prompts("train"), load_prompts("eval")
    assert len(evals) == 60 and 300 <= len(train) + len(evals) <= 600
    assert not set(train) & set(evals)


def test_character_fallback_tokenisation_stays_in_vocab() -> None:
    ids = encode_prompt("Write a haiku. Ünïcode too!", None, 128)
    assert ids and all(3 <= t < 128 for t in ids)


def test_collate_scores_only_continuation_positions() -> None:
    b = collate([DistillSequence([5, 6, 7, 8, 9], 3), DistillSequence([5, 6, 7], 2)], pad_id=0, max_len=16)
    # position t predicts token t + 1: continuation tokens 8, 9 are predicted at 2, 3; token 7 at 1
    assert b.loss_mask.tolist() == [[False, False, True, True, False], [False, True, False, False, False]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_source_layers_evenly_spaced_from_first() -> None:
    assert source_layers(30, 2) == [0, 15]
    assert source_layers(30, 3) == [0, 10, 20]
    assert source_layers(3, 1) == [0]


# ------------------------------------------------------------------------------------------------ end to end


def test_loss_decreases(distilled: DistillReport) -> None:
    losses = distilled.train.losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert distilled.train.validation and distilled.train.best_step is not None


def test_draft_dir_shares_embeddings(distilled: DistillReport, tiny_models: dict[str, TinyModel]) -> None:
    out = distilled.out
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # The tiny target's head is untied: the draft shares both its embedding table and its head.
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert any(n.startswith("model.layers.1.") for n in names)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[SHARED_FROM_KEY] == str(Path(tiny_models["llama"].path).resolve())
    assert cfg["num_hidden_layers"] == 2
    assert not (out / CHECKPOINT_NAME).exists()  # checkpoints and data stay in the work directory
    # It loads on its own (the loader fills in the shared tensors) and as a draft.
    assert len(_greedy(LLM(model=str(out)), random_prompts([5]))[0]) == 24


def test_distilled_draft_is_lossless(distilled: DistillReport, tiny_models: dict[str, TinyModel]) -> None:
    target = tiny_models["llama"].path
    prompts = random_prompts([5, 9, 14], seed=3)
    want = _greedy(LLM(model=target), prompts)
    llm = LLM(model=target, draft_model=str(distilled.out), num_speculative_tokens=4, adaptive_draft_length=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    stats = llm.spec_stats(outs)
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == 4


def test_cli_distill_and_resume(tiny_models: dict[str, TinyModel], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    args = ["distill", "--target", tiny_models["llama"].path, "--out", str(tmp_path / "d"), "--layers", "1",
            "--num-prompts", "6", "--max-new-tokens", "8", "--steps", "4", "--batch-size", "4",
            "--checkpoint-every", "2", "--eval-prompts", "3", "--eval-max-tokens", "8", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train: steps 0->4" in out and "accept len" in out
    assert (tmp_path / "d" / "distill_work" / CHECKPOINT_NAME).is_file()
    # --resume reuses the generated data and the checkpoint: nothing left to train.
    assert main(args + ["--resume", "--eval-prompts", "0"]) == 0
    assert "train: steps 4->4" in capsys.readouterr().out


def test_resume_continues_at_saved_step(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    """A run stopped at step 5 and resumed matches the uninterrupted run step for step."""
    teacher = load_teacher(tiny_models["llama"].path, CPU)
    seqs = [DistillSequence(p + c, len(p)) for p, c in zip(random_prompts([4, 6, 5, 7, 3, 8], seed=1),
                                                           random_prompts([9, 7, 8, 6, 9, 5], seed=2))]
    cfg = TrainConfig(steps=10, batch_size=3, lr=3e-3, checkpoint_every=100)

    def trainer(ckpt: Path | None) -> Trainer:
        student = build_student(teacher, StudentSpec(num_layers=1), seed=0)
        return Trainer(student, seqs, TrainConfig(**vars(cfg)), CPU, 0, teacher=teacher, checkpoint_dir=ckpt,
                       progress=False)

    whole = trainer(None).train().losses
    first = trainer(tmp_path)
    assert first.train(stop_at=5).losses == pytest.approx(whole[:5], rel=1e-5)
    second = trainer(tmp_path)
    assert second.load_checkpoint() and second.step == 5
    result = second.train()
    assert result.start_step == 5 and len(result.losses) == 10
    assert result.losses == pytest.approx(whole, rel=1e-4)
    with pytest.raises(ValueError, match="same settings"):
        other = build_student(teacher, StudentSpec(num_layers=1))
        Trainer(other, seqs, TrainConfig(steps=10, batch_size=2), CPU, 0, teacher=teacher,
                checkpoint_dir=tmp_path, progress=False).load_checkpoint()


def test_topk_teacher_trains(tiny_models: dict[str, TinyModel]) -> None:
    teacher = load_teacher(tiny_models["llama"].path, CPU)
    seqs = [DistillSequence(p + c, len(p)) for p, c in zip(random_prompts([4, 6, 5, 7], seed=1),
                                                           random_prompts([9, 7, 8, 6], seed=2))]
    topk = precompute_topk(teacher, seqs, k=16, batch_size=2, max_len=64, pad_id=0, device=CPU, progress=False)
    assert [t.logprobs.shape[0] for t in topk] == [s.num_targets for s in seqs]
    student = build_student(teacher, StudentSpec(num_layers=1))
    losses = Trainer(student, seqs, TrainConfig(steps=15, batch_size=4, lr=3e-3, max_seq_len=64), CPU, 0,
                     topk=topk, progress=False).train().losses
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------------ other shapes


@pytest.mark.parametrize("family,spec,groups", [
    # Llama target, hybrid sliding/full layers: a Qwen2 student (zero q/k/v biases), two KV-cache groups.
    ("llama", StudentSpec(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6), 2),
    # Another width: no sharing possible, the draft stores its own (projected) embeddings.
    ("llama", StudentSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64), 1),
    # Gemma 3 target: a Gemma 3 student, with the source layers' sliding/full types.
    ("gemma3", StudentSpec(num_layers=2), 2),
])
def test_student_shapes_load_as_lossless_drafts(tiny_models: dict[str, TinyModel], tmp_path: Path, family: str,
                                                spec: StudentSpec, groups: int) -> None:
    target = tiny_models[family].path
    teacher = load_teacher(target, CPU)
    student = build_student(teacher, spec)
    shared_from = str(Path(target).resolve()) if student.shared else None
    export_draft(student, tmp_path, Path(target), shared_from, torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert ("model.embed_tokens.weight" in set(f.keys())) == (not student.shared)
    cfg = ModelConfig.from_path(tmp_path)
    if spec.layer_types:
        assert cfg.architecture == "Qwen2ForCausalLM" and cfg.layer_sliding_windows == [6, None]
    prompts = random_prompts([6, 11], seed=4)
    llm = LLM(model=target, draft_model=str(tmp_path), num_speculative_tokens=3)
    assert len(llm.executor.draft_kv_groups) == groups
    assert _greedy(llm, prompts, 16) == _greedy(LLM(model=target), prompts, 16)


def test_student_copies_target_layers(tiny_models: dict[str, TinyModel]) -> None:
    """At the start a 3-layer student of the 3-layer target is the target (same layers, shared embeddings)."""
    teacher = load_teacher(tiny_models["llama"].path, CPU)
    student = build_student(teacher, StudentSpec(num_layers=3))
    assert student.source_layers == [0, 1, 2]
    x = torch.tensor([random_prompts([10])[0]])
    with torch.no_grad():
        assert torch.allclose(student.model(x).logits, teacher(x).logits, atol=1e-5)
    assert not student.model.get_input_embeddings().weight.requires_grad


def test_bad_student_specs_are_refused(tiny_models: dict[str, TinyModel]) -> None:
    teacher = load_teacher(tiny_models["llama"].path, CPU)
    with pytest.raises(ValueError, match="layer_types lists 1"):
        student_config(teacher.config, StudentSpec(num_layers=2, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="unknown layer types"):
        student_config(teacher.config, StudentSpec(num_layers=1, layer_types=["local"]))
    with pytest.raises(ValueError, match="sliding window"):
        student_config(teacher.config, StudentSpec(num_layers=1, layer_types=["sliding_attention"]))


# ------------------------------------------------------------------------------------------------ bundled draft


@pytest.mark.slow
def test_bundled_draft_is_lossless_and_accepts() -> None:
    llm = LLM(model="smollm2-135m-instruct", draft_model="smollm2-135m-draft", num_speculative_tokens=4,
              adaptive_draft_length=False)  # a fixed k: the acceptance length is measured
    target = LLM(model="smollm2-135m-instruct")
    prompts = [encode_prompt(p, llm.tokenizer, 49152) for p in load_prompts("eval", 3)]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in target.generate(prompts, params)]
    stats = llm.spec_stats(outs)
    # Measured 2.51-2.55 on the whole eval split (MODEL_CARD.md); an untrained draft accepts ~nothing (1.0).
    assert stats.acceptance_length > 2.0, stats  # 2.61 on these 3 prompts x 48 tokens, fp32 CPU
