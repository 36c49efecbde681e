"""GPT-OSS calls in the harmony format (vLLM's `--tool-call-parser openai`): a commentary message addressed to the
function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

The markers are special tokens, so outputs are read from their token ids (serving/openai/harmony.py), never from the
text; this parser gives the grammar of a forced call (llguidance writes the special tokens by name) and the
markup of a conversation's earlier calls. One call a turn: harmony ends the output at `<|call|>`, so parallel
calls come one turn each.
"""

from __future__ import annotations

import json
from typing import Any

from serving.openai.harmony import CALL, CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE, START
from serving.openai.tool_parsers.base import Extracted, ParsedCall, ToolParser, lark_literal


class HarmonyToolParser(ToolParser):
    name = "openai"
    anywhere = True
    start_tokens = (CHANNEL, START)
    format_hint = ("To call a function, write a commentary message to it: <|channel|>commentary "
                   "to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>")

    def extract(self, markup: str, names: set[str], truncated: bool) -> Extracted:
        # Never reached: harmony outputs are split by their token ids (serving/openai/harmony.py); the text has
        # no markers.
        raise NotImplementedError("harmony outputs are parsed from token ids (serving.openai.harmony.HarmonyStream)")

    def grammar(self, calls: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        # The output opens after the generation prompt's `<|start|>assistant`: a header, the arguments, <|call|>.
        rules = []
        for i, (name, params) in enumerate(calls):
            schema = {**params, "x-guidance": {"whitespace_flexible": False}}
            rules.append(f"c{i}: {CHANNEL} {lark_literal('commentary to=' + FUNCTIONS + name + ' ')} {CONSTRAIN} "
                         f'"json" {MESSAGE} a{i} {CALL}')
            rules.append(f"a{i}: %json {json.dumps(schema)}")
        return "start: " + " | ".join(f"c{i}" for i in range(len(calls))) + "\n" + "\n".join(rules) + "\n"

    def format_calls(self, calls: list[ParsedCall]) -> str:
        # Compact JSON, as a forced call's grammar writes the arguments.
        return "".join(f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{c.name} {CONSTRAIN}json{MESSAGE}"
                       f"{json.dumps(c.arguments, separators=(',', ':'))}{CALL}" for c in calls)
