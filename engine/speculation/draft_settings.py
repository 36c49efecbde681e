"""Engine settings that only mean something with a draft of some kind: refused when the engine starts without what they
need, rather than silently ignored."""

from __future__ import annotations

from engine.config import EngineConfig, SpeculativeConfig


def check_draft_settings(config: EngineConfig, spec: SpeculativeConfig | None, speculation_ahead: bool) -> None:
    """Raise ValueError for a setting of `config` that the engine's speculation cannot honour. spec: the engine's
    speculative config (None: no draft); speculation_ahead: whether the draft drafts ahead."""
    if config.draft_token_map is not None and spec is None:
        raise ValueError("draft_token_map restricts a draft model's LM head: give a draft model, or leave it unset")
    for name in ("synthetic_bonus_agreement", "synthetic_top_f_agreement"):
        if getattr(config, name) is not None and (spec is None or spec.rejection_sampling != "synthetic"):
            raise ValueError(f"{name} is a benchmark setting for rejection_sampling='synthetic'")
    if config.speculation_ahead_saguaro not in (None, 1.0) and not (
            speculation_ahead and spec.rejection_sampling == "probabilistic"):
        # Strict and synthetic acceptance emit the target's own sample at a rejection, whatever q: the scaling
        # would only cost accepted drafts.
        raise ValueError("speculation_ahead_saguaro needs a draft model, speculation ahead on (it is "
                         f"{'on' if speculation_ahead else 'off'}) and rejection_sampling='probabilistic'")
