"""The distillation data beyond the hand-written prompts: prompts the target writes itself through its chat
template, continuations saved in shards that a stopped run resumes from, and token-only generation
(`detokenize=False`) that keeps the same tokens."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TinyModel
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from deploy.cli import main
from engine import LLM, SamplingParams
from engine.distill.data import DistillSequence, encode_prompt, load_prompts, load_sequences, save_sequences
from engine.distill.self_prompts import chat_frame, synthesize_prompts
from engine.distill.teacher import generate_continuations

BUNDLED_DRAFT = Path(__file__).resolve().parent.parent / "engine/models/bundled/smollm2-135m-draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Llama with SmolLM2's real tokenizer and chat template (vocabulary 49152)."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_DRAFT / name, path / name)
    return path


def test_chat_frame_is_the_templates_own_tokens(chat_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(chat_model)
    frame = chat_frame(tok, 1, [2])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert frame.suffix[0] == end and end in frame.end_of_turn
    assert tok.decode(frame.suffix).endswith("<|im_start|>assistant\n")
    for text in ("What is the capital of France?", "Write a Python function that reverses a list.", "hi"):
        user = tok(text, add_special_tokens=False)["input_ids"]
        assert frame.wrap(user) == encode_prompt(text, tok, 49152), text


def test_chat_frame_without_template() -> None:
    frame = chat_frame(None, 1, [2])
    assert (frame.prefix, frame.suffix, frame.end_of_turn) == ([1], [], [2])
    with pytest.raises(ValueError, match="BOS"):
        chat_frame(None, None, [2])


def test_self_prompts_are_framed_distinct_and_exclude(tiny_models: dict[str, TinyModel]) -> None:
    """Every kept prompt is framed, ended by the model and new; excluding one removes it and nothing else (the
    same engine seed writes the same candidates)."""
    frame = chat_frame(None, 1, [2])

    def write(exclude: list[list[int]]) -> list[list[int]]:
        llm = LLM(model=tiny_models["llama"].path, seed=0, device="cpu")
        return synthesize_prompts(llm, frame, 96, max_tokens=32, min_tokens=2, exclude=exclude, chunk=48,
                                  progress=False)

    kept = write([])
    assert len(kept) >= 2, "the tiny model ended too few turns for this test to mean anything"
    assert len({tuple(p) for p in kept}) == len(kept)
    for p in kept:
        assert p[0] == 1 and 2 not in p and len(p) >= 3
    assert write([kept[0]]) == kept[1:]


def test_self_prompts_refuse_nonsense(tiny_models: dict[str, TinyModel]) -> None:
    llm = LLM(model=tiny_models["llama"].path, seed=0, device="cpu")
    with pytest.raises(ValueError, match="num_prompts"):
        synthesize_prompts(llm, chat_frame(None, 1, [2]), 0)


def test_detokenize_false_keeps_tokens(chat_model: Path) -> None:
    llm = LLM(model=str(chat_model), seed=0, device="cpu")
    prompt = encode_prompt("Tell me about the sea.", llm.tokenizer, 49152)
    with_text = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    ids_only = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False))[0]
    assert ids_only.token_ids == with_text.token_ids and len(ids_only.token_ids) == 12
    assert with_text.text and ids_only.text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="\n", detokenize=False)


def test_sequences_round_trip(tmp_path: Path) -> None:
    seqs = [DistillSequence([1, 5, 7, 9], 2), DistillSequence([1, 4, 49151], 1), DistillSequence([3] * 600, 10)]
    save_sequences(seqs, tmp_path / "d.pt")
    assert load_sequences(tmp_path / "d.pt") == seqs


class CountingLLM:
    """A real engine that counts its generate calls: how many chunks a resumed run made again."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.calls = llm, 0

    def generate(self, *args: object) -> list:
        self.calls += 1
        return self.llm.generate(*args)  # type: ignore[arg-type]


def test_continuations_resume_from_their_shards(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    prompts = [[1, 5 + i, 9, 17 + i] for i in range(6)]
    llm = CountingLLM(LLM(model=tiny_models["llama"].path, seed=0, device="cpu"))
    first = generate_continuations(llm, prompts, 6, samples_per_prompt=1, chunk=4, shard_dir=tmp_path,
                                   progress=False)  # type: ignore[arg-type]
    assert llm.calls == 3 and len(list(tmp_path.glob("*.pt"))) == 3  # 12 jobs in chunks of 4
    assert [s.token_ids[:s.prompt_len] for s in first[::2]] == prompts  # greedy, then the sample, per prompt
    llm.calls = 0
    assert generate_continuations(llm, prompts, 6, 1, chunk=4, shard_dir=tmp_path, progress=False) == first  # type: ignore[arg-type]
    assert llm.calls == 0
    sorted(tmp_path.glob("*.pt"))[-1].unlink()  # a run stopped before its last chunk
    again = generate_continuations(llm, prompts, 6, 1, chunk=4, shard_dir=tmp_path, progress=False)  # type: ignore[arg-type]
    assert llm.calls == 1 and again[:8] == first[:8] and len(again) == len(first)


def test_cli_distill_with_self_prompts_in_two_runs(tiny_models: dict[str, TinyModel], tmp_path: Path) -> None:
    """--data-only writes the data and no draft; --resume trains on it, self-written prompts included, with every
    n-th of them held out for validation like the hand-written ones."""
    work, out = tmp_path / "work", tmp_path / "draft"
    args = ["distill", "--target", tiny_models["llama"].path, "--out", str(out), "--work-dir", str(work),
            "--num-prompts", "8", "--max-new-tokens", "8", "--self-prompts", "96", "--self-prompt-max-tokens", "32",
            "--val-every", "2", "--steps", "4", "--batch-size", "4", "--eval-prompts", "0", "--teacher-topk", "0",
            "--device", "cpu", "--no-progress"]
    assert main([*args, "--data-only"]) == 0
    assert (work / "data.pt").is_file() and not (out / "model.safetensors").exists()
    written = torch.load(work / "self_prompts.pt")
    assert len(written) >= 2
    data = load_sequences(work / "data.pt")
    assert main([*args, "--resume"]) == 0
    assert (out / "model.safetensors").is_file()
    report = json.loads((work / "report.json").read_text())
    assert report["num_self_prompts"] == len(written)
    held = {tuple(p) for p in written[1::2]}
    held_seqs = sum(tuple(s.token_ids[:s.prompt_len]) in held for s in data)
    from_written = sum(tuple(s.token_ids[:s.prompt_len]) in {tuple(p) for p in written} for s in data)
    assert from_written > held_seqs > 0
    # Training saw every sequence but the held-out ones (hand-written prompts 1, 3, 5, 7 and odd written ones).
    hand_held = {tuple(encode_prompt(p, None, 128)) for p in load_prompts("train", 8)[1::2]}
    held_total = held_seqs + sum(tuple(s.token_ids[:s.prompt_len]) in hand_held for s in data)
    assert report["num_sequences"] == len(data) - held_total

