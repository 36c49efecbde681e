"""Benchmarks only: a measured profile of how often the target's token is among the draft's top-f candidates, for
speculation ahead under synthetic rejection (EngineConfig.synthetic_top_f_agreement; a module below the config, which
checks it, and beside engine/speculation/ahead/synthetic_agreement.py, which reads it).

Under synthetic rejection (random-weight pairs of real shapes) the target's tokens are unrelated to the draft's, so a
window or tree branch drafted ahead for an outcome would never hit. synthetic_bonus_agreement credits the outcome's
first window at one rate R, whatever the outcome and however many candidates were drafted for it: tree mode's fan-out
F then changes the cost of a step and never its hits. A profile instead gives, per verify outcome a, P(the target's
token at position a is among the draft's top-f tokens there, d_{a+1} left out for a rejection | a) for f = 1..F_max,
measured on a real pair (benchmarks/tree_hit_rate.py --profile): a lookup whose outcome has n candidates drafted ahead
hits candidate r (0-based, in the order they were drafted: the draft's top-f order for a tree's roots and for the
bonus windows) with probability top_f[a][r] - top_f[a][r - 1], so it hits at all with probability top_f[a][n - 1],
as a real pair would with the same draft quality. The draft's KV then holds its candidate where the target has another
token: harmless for a benchmark whose outputs mean nothing; refused everywhere else (EngineCore: synthetic only).

Rows: a = 0..K-1 (a rejection after a accepted drafts), then the bonus outcome (all K accepted), of the K the profile
was measured at. An engine of another k reads rejection row min(a, K - 1) and the bonus row for a = k; n beyond the
profile's F_max reads its last column (an under-estimate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AgreementProfile:
    top_f: tuple[tuple[float, ...], ...]  # [K + 1][F_max]: rows a = 0..K-1 rejections, then the bonus outcome

    @classmethod
    def from_table(cls, table: Sequence[Sequence[float]]) -> AgreementProfile:
        """ValueError, naming EngineConfig's field, for a table that is not a profile."""
        name = "synthetic_top_f_agreement"
        if isinstance(table, (str, bytes)) or not isinstance(table, Sequence) or len(table) < 2:
            raise ValueError(f"{name} must be a list of at least 2 rows (rejection outcomes a = 0.., then the bonus "
                             f"outcome), got {table!r}")
        rows = []
        for a, row in enumerate(table):
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row:
                raise ValueError(f"{name}: row {a} must be a non-empty list of P(top-f), f = 1.., got {row!r}")
            values = []
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                    raise ValueError(f"{name}: row {a} holds {v!r}, not a probability in [0, 1]")
                values.append(float(v))
            if any(b < x for x, b in zip(values, values[1:])):
                raise ValueError(f"{name}: row {a} must not decrease with f (top-f contains top-(f-1)), got {values}")
            rows.append(tuple(values))
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"{name}: every row needs the same fan-outs f = 1..F_max, got lengths "
                             f"{[len(r) for r in rows]}")
        return cls(tuple(rows))

    def row(self, a: int, k: int) -> tuple[float, ...]:
        """P(top-f), f = 1..F_max, at outcome a of a verify of k drafts."""
        return self.top_f[-1] if a >= k else self.top_f[min(a, len(self.top_f) - 2)]

    def hit_rank(self, a: int, k: int, candidates: int, u: float) -> int | None:
        """The candidate (0-based, draft order) that agrees with the target at outcome a, given a uniform u in
        [0, 1), when `candidates` were drafted for it; None: none of them does."""
        row = self.row(a, k)
        for r in range(min(candidates, len(row))):
            if u < row[r]:
                return r
        return None

    def guess_rates(self, a: int, k: int) -> tuple[float, float]:
        """P(the draft's top candidate agrees), P(its runner-up does), at outcome a: what the window mode's branch
        estimates score for the argmax and runner-up guesses (engine/speculation/ahead/branches.py)."""
        row = self.row(a, k)
        return row[0], (row[1] - row[0]) if len(row) > 1 else 0.0
