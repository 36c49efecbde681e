"""How the ingress picks an engine replica for a request: a Serve request router (`request_router_config`).

Every request goes to a replica that takes requests: each engine replica reports, through Serve's routing
stats (`record_routing_stats`, polled every few seconds), whether it is serving, so a replica that is rebuilding
its worker groups after a worker died, or draining, gets no new requests while the others serve. Among those,
Serve's power of two choices: the shorter queue of two random replicas.

With prefix affinity (`request_router: prefix_aware`), requests that share a long prompt prefix (a system
prompt, a few-shot preamble, a conversation's history) go to the replica that served that prefix last, so a
replica that caches prefixes' KV can reuse it instead of recomputing it. Routing does not depend on the engine
having such a cache: it is a policy over prompts. When load is imbalanced, the replica holding the prefix is
passed over and power of two choices decides, so a popular prefix cannot pile every request onto one replica.

How a prefix is recognised: the prompt's token ids are cut into blocks of `block_size` tokens, and each block
gets a chained hash (of itself and every block before it), so one hash names a whole prefix. After a request is
routed, each of its block hashes maps to the replica; a new request looks up its own hashes from the longest
prefix down. The table is an LRU bounded by `max_entries` hashes, local to each ingress process (each learns
from the requests it routes).
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger("specserve")

# The engine method whose arguments carry the prompt: generate(request_id, prompt_token_ids, params).
ROUTED_METHOD = "generate"


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """One hash per whole block of the prompt, each chained to the blocks before it: hashes[i] names the
    prefix token_ids[:(i + 1) * block_size]."""
    out, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        out.append(h)
    return out


class PrefixTable:
    """Block-prefix hash -> the replica that served it last; least recently used entries go first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()

    def record(self, hashes: list[int], replica: str) -> None:
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def longest_match(self, hashes: list[int], live: set[str]) -> tuple[str | None, int]:
        """(replica, number of blocks) of the longest prefix of `hashes` served by a replica in `live`."""
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[i])
            if owner is not None and owner in live:
                return owner, i + 1
        return None, 0

    def forget(self, replica: str) -> None:
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def __len__(self) -> int:
        return len(self._owner)


# The routing stat an engine replica reports: False while it cannot take requests (recovering, draining).
ACCEPTING = "accepting"
DEFAULT_OPTIONS = {"prefix_affinity": False, "block_size": 16, "min_prefix_tokens": 64, "imbalanced_threshold": 8,
                   "max_entries": 200_000}


def check_router_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The router's options with defaults filled in; ValueError naming an unknown or bad option (checked when the
    application is built, not first in the ingress once requests arrive)."""
    unknown = sorted(set(kwargs) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"request_router_kwargs: unknown option(s) {unknown}; known: {sorted(DEFAULT_OPTIONS)}")
    options = {**DEFAULT_OPTIONS, **kwargs}
    if not isinstance(options["prefix_affinity"], bool):
        raise ValueError(f"request_router_kwargs.prefix_affinity must be true or false, "
                         f"got {options['prefix_affinity']!r}")
    for name, value in options.items():
        if name == "prefix_affinity":
            continue
        low = 0 if name == "imbalanced_threshold" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"request_router_kwargs.{name} must be an integer >= {low}, got {value!r}")
    return options


class EngineRequestRouter(RequestRouter):
    """Replicas that take requests first; then prefix affinity (when on) and power of two choices. Options
    (`request_router_kwargs`):

    prefix_affinity: route by shared prompt prefix (else power of two choices alone).
    block_size: tokens per hashed block (a prefix is matched in whole blocks).
    min_prefix_tokens: a shared prefix shorter than this does not pin a request (too little to reuse).
    imbalanced_threshold: pass the prefix's replica over when its queue is longer than the shortest queue among
        the replicas by more than this many requests.
    max_entries: block hashes remembered (each prompt of n tokens adds n / block_size).
    """

    def initialize_state(self, **kwargs: Any) -> None:
        options = check_router_kwargs(kwargs)
        self.prefix_affinity = options["prefix_affinity"]
        self.block_size = options["block_size"]
        self.min_prefix_blocks = -(-options["min_prefix_tokens"] // self.block_size)
        self.imbalanced_threshold = options["imbalanced_threshold"]
        self.table = PrefixTable(options["max_entries"])

    # --- Serve's hooks -------------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas to try in order: the prefix's replica (when it has a long enough prefix and is not
        overloaded), then two random ones (Serve takes the one with the shorter queue)."""
        # A replica that is not serving answers 503 at once; with the shortest queue it would draw every request.
        # When none reports serving (or no stats came yet), all are candidates: a request then gets that 503.
        candidates = [r for r in candidate_replicas if r.routing_stats.get(ACCEPTING, True)] or candidate_replicas
        if not candidates:
            return []
        fallback = random.sample(candidates, min(2, len(candidates)))
        hashes = self._hashes(pending_request)
        if not hashes:
            return [fallback]
        by_id = {r.replica_id.unique_id: r for r in candidates}
        owner, blocks = self.table.longest_match(hashes, set(by_id))
        if owner is None or blocks < self.min_prefix_blocks or self._overloaded(by_id[owner], candidates):
            return [fallback]
        return [[by_id[owner]], fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self._hashes(pending_request)
        if hashes:
            self.table.record(hashes, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    # --- helpers -------------------------------------------------------------------------------------------
    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        """The prompt's block hashes; empty without prefix affinity or for a call that carries no prompt."""
        if (not self.prefix_affinity or pending_request is None
                or pending_request.metadata.call_method != ROUTED_METHOD):
            return []
        args = pending_request.args
        prompt = args[1] if len(args) > 1 else pending_request.kwargs.get("prompt_token_ids")
        if not isinstance(prompt, list):
            return []
        return prefix_hashes(prompt, self.block_size)

    def _overloaded(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """Whether `replica`'s queue (Serve's cached queue lengths; unknown counts as balanced) is longer than
        the shortest one by more than the threshold."""
        queues = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) for r in candidates}
        mine = queues.get(replica.replica_id)
        known = [q for q in queues.values() if q is not None]
        return mine is not None and bool(known) and mine - min(known) > self.imbalanced_threshold
