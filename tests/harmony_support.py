"""A tiny model that speaks through a harmony tokenizer: the byte-level tokenizer of tests/byte_models.py plus
GPT-OSS's harmony special tokens, and a chat template in GPT-OSS's style (system message with the reasoning
effort, tools as a `functions` namespace in a developer message, earlier turns' reasoning, calls and results as
harmony messages, `<|start|>assistant` as the generation prompt)."""

from __future__ import annotations

from pathlib import Path

import torch
from byte_models import byte_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from serving.openai.harmony import HARMONY_TOKENS

HARMONY_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' -%}"
    "<|start|>system<|message|>You are a tiny model.\nReasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}\n"
    "type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role in ('system', 'developer') %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """259 byte-level ids, then the seven harmony tokens (special: the output text leaves them out)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tok.chat_template = HARMONY_TEMPLATE
    return tok


def make_harmony_model(root: Path, draft: Path | None = None) -> str:
    """A 2-layer random Llama over the harmony tokenizer's vocabulary, saved with the tokenizer in root/harmony
    (or root itself when `draft` is given); `draft`: also a draft there, the target's weights plus 5% noise (it
    agrees with the target often, so speculation accepts runs)."""
    tok = harmony_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = root / "harmony" if draft is None else root
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if draft is not None:
        with torch.no_grad():
            for w in model.parameters():
                if w.dim() == 2:
                    w.add_(0.05 * w.std() * torch.randn_like(w))
        model.save_pretrained(draft)
        tok.save_pretrained(draft)
    return str(path)
