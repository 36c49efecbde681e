"""A step's plan carries only what the model sides do not know yet: both ends of that protocol.

A request's sampling settings never change and its block tables grow a block at a time, yet both used to travel
whole in every step's plan: with 16 requests of 2000-token contexts and two KV-cache groups in each of two models,
some 25 kB a step for a handful of new block ids (benchmarks/plan_size.py). Now:

- settings go with a request's first entry only (`PlannedRequest.sampling`; None means "as before");
- block tables go as tails: per KV-cache group, the index from which the table differs from the one last sent
  (their longest common prefix) and the blocks from there (`block_table_starts`). The common prefix takes any
  change of a table: blocks appended, a sliding-window group's out-of-window blocks released (NULL_BLOCK) or
  replaced, a table that starts with cached blocks other requests share. A draft that sits a step out
  (`draft_runs=False`) is sent no tables that step.

The builder's half is `SentState`: per request and model, the tables the sides were sent. Each side's half is its
request table (engine/step/request_table.py), which keeps the settings and whole tables and puts them back into every
entry (`fill_settings`, `splice_tables`) before anything reads it; every rank of both models keeps the same.

The builder is exact only if it forgets whatever the sides may not have: a request that ends or is preempted (its
id goes out in the plan's finished_ids, and the sides drop it too), and everything after a step fails (a plan may
have reached some ranks and not others) or the executor's draft group changes (new ranks know nothing): the next
entries are then whole. A side sent a tail it cannot splice raises rather than run with a wrong table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engine.step.plan import PlannedRequest, SamplingSettings


@dataclass
class _Sent:
    """What the sides were last sent of one request's block tables (lists the builder never changes in place)."""

    tables: list[list[int]] | None = None  # [num_target_groups][num_blocks]
    draft_tables: list[list[int]] | None = None  # [num_draft_groups][num_blocks]; None: none sent yet


class SentState:
    """The builder's record of what the sides know of each request, from which it writes entries as deltas."""

    def __init__(self) -> None:
        self._requests: dict[str, _Sent] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def forget(self, request_ids: Iterable[str]) -> None:
        """The sides drop these requests (finished, aborted, preempted): their next entries are whole."""
        for rid in request_ids:
            self._requests.pop(rid, None)

    def reset(self) -> None:
        """The sides may know less than was sent (a failed step, a new draft group): every next entry is whole."""
        self._requests.clear()

    def encode(self, entry: PlannedRequest, tables: list[list[int]], draft_tables: list[list[int]] | None) -> bool:
        """Set `entry`'s block tables to what the sides lack, and remember what they now have; returns whether the
        sides know nothing of the request, so that the entry must carry its settings (else `entry.sampling` is set
        to None). tables / draft_tables: the request's current tables per group (not kept; None: the draft sits
        this step out)."""
        sent = self._requests.get(entry.request_id)
        first = sent is None
        if sent is None:
            sent = self._requests[entry.request_id] = _Sent()
        else:
            entry.sampling = None
        entry.block_tables, entry.block_table_starts, sent.tables = _delta(sent.tables, tables)
        if draft_tables is not None:
            entry.draft_block_tables, entry.draft_block_table_starts, sent.draft_tables = _delta(
                sent.draft_tables, draft_tables)
        return first


def _delta(sent: list[list[int]] | None, now: list[list[int]]
           ) -> tuple[list[list[int]], list[int] | None, list[list[int]]]:
    """(what to send per group, start index per group or None for whole tables, the tables as now sent)."""
    if sent is None or len(sent) != len(now):
        kept = [t[:] for t in now]
        return kept, None, kept  # shared: neither the entry's nor the kept lists are ever changed in place
    starts, tails, kept = [], [], []
    for old, cur in zip(sent, now):
        n = len(old)
        if len(cur) == n and cur == old:
            # Unchanged, as in most steps (a block holds block_size tokens): keep the list sent, no copy of a table
            # that holds thousands of blocks at long context.
            starts.append(n)
            tails.append([])
            kept.append(old)
            continue
        if n > len(cur) or cur[:n] != old:  # not only appended to: a block released or replaced (sliding window)
            n = _common_prefix(old, cur)
        starts.append(n)
        tails.append(cur[n:])
        kept.append(cur[:])  # a copy: the KV manager appends to its own list in place
    return tails, starts, kept


def _common_prefix(old: list[int], cur: list[int]) -> int:
    for i, (a, b) in enumerate(zip(old, cur)):
        if a != b:
            return i
    return min(len(old), len(cur))


# --- the sides' half -------------------------------------------------------------------------------------
def fill_settings(request_id: str, known: SamplingSettings | None,
                  sent: SamplingSettings | None) -> SamplingSettings:
    """The request's settings: those the entry carries, else those this side kept."""
    if sent is not None:
        return sent
    if known is None:
        raise RuntimeError(f"the plan leaves request {request_id}'s sampling settings to this side, which has none "
                           "(it does not know the request, or lost it)")
    return known


def splice_tables(request_id: str, model: str, known: list[list[int]] | None, starts: list[int] | None,
                  sent: list[list[int]]) -> list[list[int]]:
    """The whole block tables per group: `sent` if it is whole (starts None), else the tails in `sent` after the
    first starts[g] blocks of the tables this side kept. New lists where a table changed (earlier entries may still
    hold the old ones), the kept list where it did not: no table is ever changed in place."""
    if starts is None:
        return sent
    if known is None:
        raise RuntimeError(f"the plan sends request {request_id}'s {model} block tables as tails, but this side has "
                           "no tables of it (it does not know the request, or lost it)")
    if not len(known) == len(starts) == len(sent):
        raise RuntimeError(f"the plan sends request {request_id}'s {model} block tables for {len(starts)} KV-cache "
                           f"groups, but this side has {len(known)}")
    tables = []
    for g, (have, start, tail) in enumerate(zip(known, starts, sent)):
        if start == len(have):  # the usual case, blocks appended (or none: then the same list, not a copy)
            tables.append(have + tail if tail else have)
        elif start < len(have):
            tables.append(have[:start] + tail)
        else:
            raise RuntimeError(f"the plan continues request {request_id}'s {model} block table of KV-cache group "
                               f"{g} from block {start}, but this side has only {len(have)} blocks of it")
    return tables
