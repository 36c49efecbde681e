"""Default sampling settings from a model's generation_config.json, as vLLM's `--generation-config auto` applies
them: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the model's value,
and max_new_tokens caps max_tokens. Only the keys the file sets count (an absent key keeps OpenAI's default).

Extra EOS ids from the same file are the engine's business (engine.model_config.ModelConfig.eos_token_ids), so the
offline API stops on them too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("specserve")

# generation_config.json key -> the request field it is the default of.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# Neutral values: a file that sets one of these changes nothing, so it needs no support.
_NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0}


def load_generation_defaults(model_dir: str | Path, supported: frozenset[str] | None = None) -> dict[str, Any]:
    """Request field -> default from `model_dir`/generation_config.json ({} without the file).

    supported: the request fields this server implements; a default for another one (a repetition_penalty the
    engine cannot apply) is left out with a warning, rather than pretended."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    if raw.get("do_sample") is False and "temperature" not in raw:
        # HF's generate() is greedy when do_sample is false, whatever the temperature; vLLM does not read
        # do_sample, and neither do we: say so rather than silently sample.
        logger.info("%s sets do_sample=false; requests still sample at temperature 1 unless they say otherwise",
                    path)
    out: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        if supported is not None and field not in supported and value != _NEUTRAL.get(key):
            logger.warning("%s sets %s=%r, which this server cannot apply; requests use the neutral value",
                           path, key, value)
            continue
        out[field] = value
    return out
