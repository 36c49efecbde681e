"""The requests a benchmark sends: random token sequences of chosen lengths, a JSONL file of prompts, or the
first turns of ShareGPT conversations (as vLLM's `bench serve` reads them)."""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("specserve")

DATASETS = ("random", "jsonl", "sharegpt")


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (the random dataset: an exact input length)
    prompt_len: int | None  # tokens, when a tokenizer counted them; the server's usage is authoritative
    output_len: int  # max_tokens to ask for


def load_tokenizer(name: str | None) -> Any | None:
    """The tokenizer of a bundled model name, an HF directory or a .gguf path; None when there is none."""
    if not name:
        return None
    try:
        from engine.llm import load_tokenizer as load
        from engine.models.source import resolve_model

        if Path(name).is_dir():  # any HF directory with tokenizer files, weights or not
            return load(name)
        return load(str(resolve_model(name).path))
    except (ValueError, OSError) as e:
        logger.warning("no tokenizer for %r (%s)", name, e)
        return None


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    tokenizer: Any | None = None, vocab_size: int | None = None,
                    as_text: bool = False, length_sigma: float = 0.0,
                    max_len: int | None = None) -> list[BenchRequest]:
    """`num` prompts of random tokens. Lengths are uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]
    (vLLM's random dataset), or with `length_sigma` > 0 long-tailed: log-normal with median `len` and shape
    `length_sigma` (`lognormal_length`). Token ids avoid the tokenizer's special tokens; without a tokenizer
    they are drawn from [0, vocab_size). Prompts go as token ids (exact lengths) unless `as_text` (chat
    endpoints)."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be >= 1, got {input_len}, {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if length_sigma < 0 or (length_sigma and range_ratio):
        raise ValueError(f"--random-length-sigma must be >= 0 and goes without --random-range-ratio, got "
                         f"{length_sigma} with {range_ratio}")
    if tokenizer is None and (vocab_size is None or as_text):
        raise ValueError("the random dataset needs a tokenizer (--tokenizer, or a --model this machine can load) to "
                         "pick token ids" + (" and turn them into chat text" if as_text else
                                             ", or --random-vocab-size to draw ids from [0, N)"))
    rng = random.Random(seed)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = [i for i in range(len(tokenizer)) if i not in special]
    else:
        vocab = list(range(vocab_size))  # type: ignore[arg-type]
    out = []
    for _ in range(num):
        if length_sigma:
            n_in = lognormal_length(rng, input_len, length_sigma, max_len)
            n_out = lognormal_length(rng, output_len, length_sigma, max_len)
        else:
            n_in = _length(rng, input_len, range_ratio)
            n_out = _length(rng, output_len, range_ratio)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        prompt: str | list[int] = tokenizer.decode(ids) if as_text else ids
        out.append(BenchRequest(prompt, n_in, n_out))
    return out


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def lognormal_length(rng: random.Random, median: int, sigma: float, max_len: int | None = None) -> int:
    """A long-tailed length: log-normal with median `median` and shape `sigma` (sigma 1: the p99 is about 10x
    the median, as in chat traces), rounded and clipped to [1, max_len] (default 8 x the median), so one draw
    cannot outgrow the model's context."""
    cap = max_len if max_len is not None else 8 * median
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def jsonl_requests(path: str | Path, num: int, output_len: int | None, seed: int, tokenizer: Any | None = None,
                   shuffle: bool = False) -> list[BenchRequest]:
    """One prompt per line: {"prompt": "..."} (or "text"), optionally with "max_tokens" or "output_len"; a bare
    JSON string also works. `output_len` (--output-len) overrides the file's lengths; the default is 128.
    Prompts are used in file order (or shuffled with `seed`), repeated when the file has fewer than `num`."""
    items = []
    for lineno, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e}); each line must be a JSON object with \"prompt\"") \
                from None
        if isinstance(obj, str):
            obj = {"prompt": obj}
        prompt = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{lineno}: each line needs a non-empty string \"prompt\" (or \"text\")")
        n_out = output_len or obj.get("max_tokens") or obj.get("output_len") or 128
        items.append(BenchRequest(prompt, _count(tokenizer, prompt), int(n_out)))
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return _take(items, num, seed, shuffle)


def sharegpt_requests(path: str | Path, num: int, output_len: int | None, seed: int,
                      tokenizer: Any | None = None, max_prompt_len: int = 1024,
                      max_total_len: int = 2048) -> list[BenchRequest]:
    """ShareGPT conversations (a JSON list, or JSONL, of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}): the first turn is the prompt and the reply's token count the output
    length (or `output_len`). As vLLM does, pairs shorter than 4 tokens or longer than max_prompt_len /
    max_total_len are skipped; the rest are shuffled with `seed`."""
    if tokenizer is None and output_len is None:
        raise ValueError("ShareGPT output lengths are the replies' token counts: give --tokenizer (or a --model "
                         "this machine can load), or fix the lengths with --output-len")
    text = _read(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    items = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") if isinstance(conv, dict) else None
        if not turns or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value") or "", turns[1].get("value") or ""
        if not prompt:
            continue
        n_in = _count(tokenizer, prompt)
        n_out = output_len if output_len is not None else _count(tokenizer, reply)
        if n_in is not None and (n_in < 4 or n_in > max_prompt_len or n_in + n_out > max_total_len):
            continue
        if n_out < 4 and output_len is None:
            continue
        items.append(BenchRequest(prompt, n_in, n_out))
    if not items:
        raise ValueError(f"{path}: no usable conversations (each needs a prompt and a reply turn)")
    return _take(items, num, seed, shuffle=True)


def _read(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    return p.read_text()


def _count(tokenizer: Any | None, text: str) -> int | None:
    return len(tokenizer(text)["input_ids"]) if tokenizer is not None else None


def _take(items: list[BenchRequest], num: int, seed: int, shuffle: bool) -> list[BenchRequest]:
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if shuffle:
        items = list(items)
        random.Random(seed).shuffle(items)
    return [items[i % len(items)] for i in range(num)]


def build_requests(name: str, num: int, seed: int, tokenizer: Any | None, chat: bool, *, path: str | None = None,
                   input_len: int = 128, output_len: int | None = None, range_ratio: float = 0.0,
                   vocab_size: int | None = None, length_sigma: float = 0.0,
                   max_len: int | None = None) -> list[BenchRequest]:
    """The requests of dataset `name` ("random", "jsonl", "sharegpt")."""
    if name == "random":
        return random_requests(num, input_len, output_len or 128, range_ratio, seed, tokenizer, vocab_size,
                               as_text=chat, length_sigma=length_sigma, max_len=max_len)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; use one of {DATASETS}")
    if not path:
        raise ValueError(f"the {name} dataset needs --dataset-path FILE")
    if name == "jsonl":
        return jsonl_requests(path, num, output_len, seed, tokenizer)
    return sharegpt_requests(path, num, output_len, seed, tokenizer)
