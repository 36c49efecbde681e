"""Model pairs of benchmarks/serve_sweep.py: the real SmolLM2 pair, and random-weight models with the shapes of
real pairs (Qwen3-8B / Qwen3-0.6B) for synthetic-acceptance runs: a directory with the config.json and a tokenizer
of the vocabulary (the server needs one; random prompts go as token ids, so any tokenizer of the right size
works), loaded with load_format "dummy" (random weights made on the device, no 16 GB checkpoint to write).
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

logger = logging.getLogger("specserve")


@dataclass
class Pair:
    name: str
    target: str  # bundled name or directory
    draft: str
    rejection_sampling: str
    synthetic_acceptance_rate: float | None = None
    dataset: dict[str, Any] = field(default_factory=dict)  # how the bench builds its requests
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig extras (load_format)


# Qwen3-8B and Qwen3-0.6B as published (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-0.6B).
QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=151643,
                    eos_token_id=151645, attention_bias=False)
QWEN3_8B = dict(QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, tie_word_embeddings=False)
QWEN3_0_6B = dict(QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, tie_word_embeddings=True)
# CPU smoke shapes: same families, a few million parameters.
TINY_COMMON = dict(vocab_size=512, head_dim=16, num_key_value_heads=2, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_TARGET = dict(TINY_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)
TINY_DRAFT = dict(TINY_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with `vocab_size` entries ("<pad>", "<s>", "</s>", then "w3", "w4", ...): every id
    decodes, which is all a server of random weights needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def random_checkpoint(path: Path, config: PretrainedConfig, dtype: torch.dtype, device: str, seed: int) -> str:
    """Save a random-weight checkpoint of `config` (HF's own initialisation) with a tokenizer; reuse one that a
    previous run left at `path` with the same config."""
    stamp = path / "specserve_random.json"
    want = {"config": config.to_dict(), "dtype": str(dtype), "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == json.loads(json.dumps(want)):
        return str(path)
    logger.warning("writing random weights of %s to %s", config.model_type, path)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    stamp.write_text(json.dumps(want))
    return str(path)


def shape_only(path: Path, config: PretrainedConfig) -> str:
    """A directory with `config`'s config.json and a tokenizer: enough for load_format "dummy"."""
    config.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


def model_pairs(work_dir: Path, smoke: bool, device: str, acceptance: float) -> dict[str, Pair]:
    """The pairs by name; random checkpoints are written lazily by `materialize`."""
    eval_prompts = str(Path(__file__).resolve().parent.parent / "engine" / "distill" / "prompts" / "eval.jsonl")
    chat = {"dataset_name": "jsonl", "dataset_path": eval_prompts, "endpoint": "/v1/chat/completions"}
    random_ids = {"dataset_name": "random", "endpoint": "/v1/completions"}
    dummy = {"load_format": "dummy"}
    if smoke:
        return {
            "smollm2": Pair("tiny-llama (smoke)", str(work_dir / "tiny-llama-target"),
                            str(work_dir / "tiny-llama-draft"), "probabilistic", dataset=random_ids),
            "qwen3-8b-0.6b": Pair(f"tiny-qwen3 synthetic {acceptance} (smoke)", str(work_dir / "tiny-qwen3-target"),
                                  str(work_dir / "tiny-qwen3-draft"), "synthetic", acceptance, dataset=random_ids,
                                  engine_kwargs=dummy),
        }
    return {
        "smollm2": Pair("SmolLM2-135M-Instruct + smollm2-135m-draft", "smollm2-135m-instruct", "smollm2-135m-draft",
                        "probabilistic", dataset=chat),
        "qwen3-8b-0.6b": Pair(f"Qwen3-8B / Qwen3-0.6B shapes, random weights, synthetic acceptance {acceptance}",
                              str(work_dir / "qwen3-8b-shape"), str(work_dir / "qwen3-0.6b-shape"), "synthetic",
                              acceptance, dataset=random_ids, engine_kwargs=dummy),
    }


def materialize(pair_key: str, pair: Pair, work_dir: Path, smoke: bool, device: str) -> None:
    """Write the directories a pair names (nothing for bundled models): a random checkpoint for the smoke
    stand-in of SmolLM2 (the real pair loads weights), configs alone for the Qwen3 shapes."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if pair_key == "smollm2":
        if smoke:
            random_checkpoint(Path(pair.target), LlamaConfig(**TINY_TARGET), dtype, device, seed=0)
            random_checkpoint(Path(pair.draft), LlamaConfig(**TINY_DRAFT), dtype, device, seed=1)
        return
    target, draft = (TINY_TARGET, TINY_DRAFT) if smoke else (QWEN3_8B, QWEN3_0_6B)
    shape_only(Path(pair.target), Qwen3Config(**{**target, "architectures": ["Qwen3ForCausalLM"]}))
    shape_only(Path(pair.draft), Qwen3Config(**{**draft, "architectures": ["Qwen3ForCausalLM"]}))


def prepare_pair(args: Any, layouts: list[Any]) -> Pair:
    """The pair `args.pair` names, its directories written under --work-dir, once the layouts are known to fit the
    GPUs here (each layout's `num_gpus`)."""
    if args.device == "cuda":
        have = torch.cuda.device_count()
        too_big = [lay.name for lay in layouts if lay.num_gpus > have]
        if too_big:
            raise SystemExit(f"layouts {too_big} need more than the {have} GPUs here")
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / "specserve-sweep")
    work.mkdir(parents=True, exist_ok=True)
    pair = model_pairs(work, args.smoke, args.device, args.acceptance)[args.pair]
    materialize(args.pair, pair, work, args.smoke, args.device)
    return pair


def warmup_count(args: Any, concurrency: int) -> int:
    """Warm-up requests before each concurrency's measured run (0 with --warmup 0): at least one full batch at
    that concurrency. The first use of a batch size pays one-off costs (Triton specializations, allocator growth);
    warmed at the first concurrency only, they landed in the first engine's later points and not in the engines
    measured after it, which share the process's compiled kernels: a bias between variants, not a difference."""
    return max(args.warmup, concurrency) if args.warmup else 0


def bench_workloads(pair: Pair, args: Any, base_url: str, progress: bool = False) -> Iterator[tuple[int, list, Any]]:
    """(concurrency, requests, BenchConfig) for each of args.concurrency: max(args.min_prompts, c *
    args.prompts_per_concurrency) requests of the pair's dataset (args.input_len / args.output_len for random
    prompts), greedy, fixed output lengths (EOS ignored), all sent at once."""
    from deploy.bench.datasets import build_requests, load_tokenizer
    from deploy.bench.runner import BenchConfig

    ds = pair.dataset
    tokenizer = load_tokenizer(pair.target)
    chat = ds["endpoint"].endswith("chat/completions")
    for c in args.concurrency:
        n = max(args.min_prompts, c * args.prompts_per_concurrency)
        requests = build_requests(ds["dataset_name"], n, args.seed, tokenizer, chat, path=ds.get("dataset_path"),
                                  input_len=args.input_len, output_len=args.output_len)
        yield c, requests, BenchConfig(base_url=base_url, model="bench", endpoint=ds["endpoint"], max_concurrency=c,
                                       temperature=0.0, ignore_eos=True, seed=args.seed, progress=progress)
