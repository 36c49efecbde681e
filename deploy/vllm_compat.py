"""vLLM's spellings that are not one field each: `--speculative-config` JSON (also a `speculative_config` key in a
YAML file or `serve run` arguments), read into specserve's speculation fields."""

from __future__ import annotations

import json
from typing import Any

import yaml

from engine.config import SPECULATIVE_METHODS
from engine.model_setup import VLLM_SPEC_KEYS as ENGINE_VLLM_SPEC_KEYS

# vLLM's speculative_config keys -> ServeConfig fields: the offline LLM's, and the draft's quantization (an
# EngineConfig field there, so served only). The methods: a separate draft model, an EAGLE-3 head.
VLLM_SPEC_KEYS = {**ENGINE_VLLM_SPEC_KEYS, "quantization": "draft_quantization"}
SPEC_METHODS = SPECULATIVE_METHODS


def expand_speculative_config(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with a `speculative_config` (or `speculative-config`) mapping, or its JSON/YAML text, replaced by
    the fields it sets. Its keys: vLLM's (model, num_speculative_tokens, method, draft_tensor_parallel_size,
    disable_by_batch_size, quantization) and the names of specserve's speculation fields (rejection_sampling, ...).
    Unknown keys and methods other than draft_model and eagle3 are refused, naming them."""
    key = next((k for k in values if str(k).replace("-", "_") == "speculative_config"), None)
    if key is None:
        return values
    out = {k: v for k, v in values.items() if k != key}
    spec = values[key]
    if spec is None:
        return out
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            spec = yaml.safe_load(spec)
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {values[key]!r}")
    from deploy.serve_options import SpeculationOptions

    own = {f for f in SpeculationOptions.__dataclass_fields__}
    method = spec.get("method", spec.get("speculative_method", "draft_model"))
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported: specserve speculates with a "
                         f"separate draft model (method 'draft_model') or an EAGLE-3 head (method 'eagle3')")
    unknown = sorted(k for k in spec if k not in VLLM_SPEC_KEYS and k not in own)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(sorted(set(VLLM_SPEC_KEYS) | own))}")
    if "model" not in spec and "draft_model" not in spec:
        raise ValueError("speculative_config needs the draft's 'model'")
    for k, v in spec.items():
        out[VLLM_SPEC_KEYS.get(k, k)] = v
    return out
