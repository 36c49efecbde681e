"""Which Saguaro sampling (engine/sample/saguaro.py) a draft that drafts ahead uses: from
EngineConfig.speculation_ahead_saguaro, scaling the tokens speculation ahead caches windows for after a rejection."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.sample.saguaro import SaguaroSampling

# A rejection window's root at a draft (engine/speculation/ahead/branches.py) is the draft's likeliest token other
# than the one drawn there: whichever token was drawn, that root is one of q's top two, so scaling those covers it.
BRANCH_TOP_F = 2


def ahead_saguaro(config: EngineConfig) -> SaguaroSampling | None:
    """The proposer's Saguaro sampling, None where it is off (unset, or a factor of 1). EngineConfig.validate and
    EngineCore refuse a factor where no rejection window could use it."""
    factor = config.speculation_ahead_saguaro
    if factor is None or factor == 1.0:
        return None
    # Tree mode's roots at a draft are the draft's top F there other than the drawn token: the top F + 1 cover them.
    fanout = config.speculation_ahead_tree_fanout
    return SaguaroSampling(top_f=fanout + 1 if fanout else BRANCH_TOP_F, factor=float(factor))
