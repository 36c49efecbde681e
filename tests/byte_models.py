"""Tiny served models with a real tokenizer, and their offline greedy oracle.

The tiny models read bytes: a byte-level tokenizer (259 ids: pad, BOS, EOS, then the 256 bytes) saved next to
random-weight Llama checkpoints, so every text prompt tokenizes, every output decodes, and a server starts and
steps in well under a second per request on a 2-core CPU. The draft is the target plus 5% noise with one more
layer: it agrees with the target often (speculation really accepts runs) and, being larger, gets fewer KV blocks
than the target from the same memory budget (so the draft is the model that runs out first).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

BYTE_VOCAB = 3 + 256
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte, ids 3..258; 0/1/2 are pad/BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: ord(ch))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_byte_models(root: Path, draft_layers: int = 3) -> tuple[str, str]:
    """(target, draft) directories: a 2-layer target and its noisy draft with `draft_layers` layers (the first
    two are the target's plus noise), both with the tokenizer."""
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(_config(2)).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(6.0)  # peaked next-token distributions: greedy has clear winners
    torch.manual_seed(1)
    draft = AutoModelForCausalLM.from_config(_config(draft_layers)).eval()  # extra layers: small random init
    weights = draft.state_dict()
    with torch.no_grad():
        for name, w in target.state_dict().items():
            weights[name] = w + 0.05 * w.std() * torch.randn_like(w) if w.dim() == 2 else w.clone()
    draft.load_state_dict(weights)
    tok = byte_tokenizer()
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


_BYTE_TOKENIZER: PreTrainedTokenizerFast | None = None


def byte_ids(prompt: str) -> list[int]:
    """The byte-level tokenizer's ids of `prompt` (BOS first)."""
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        _BYTE_TOKENIZER = byte_tokenizer()
    return list(_BYTE_TOKENIZER(prompt)["input_ids"])


def byte_body(prompt: str, max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A greedy /v1/completions body for the tiny served model ("tiny"), the prompt as byte ids, EOS ignored."""
    return {"model": "tiny", "prompt": byte_ids(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


def greedy_oracle(model: str, max_model_len: int) -> Callable[[str, int], tuple[list[int], str]]:
    """(prompt, n) -> (token ids, text) of `model` alone, greedy, offline, with a KV cache that never runs out: the
    text as the engine's incremental detokenizer writes it, as a server's is."""
    from engine import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as the router's
    llm = LLM(model, max_model_len=max_model_len, block_size=4, num_kv_blocks=1024)
    torch.set_num_threads(threads)
    cache: dict[tuple[str, int], tuple[list[int], str]] = {}

    def get(prompt: str, n: int) -> tuple[list[int], str]:
        if (prompt, n) not in cache:
            out = llm.generate([byte_ids(prompt)], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
            cache[(prompt, n)] = (out.token_ids, out.text)
        return cache[(prompt, n)]

    return get
