"""What one model processes in one forward: the per-step batch, built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, build_common_metadata, build_group_metadata
from engine.kv_cache.spec import KVCacheGroupSpec


@dataclass
class Chunk:
    """One request's share of a forward: `token_ids` at positions start_pos.., how many of the last
    positions need logits (0 mid-prefill, 1 to sample, k + 1 to verify k drafts), and where its KV lives."""

    token_ids: list[int]
    start_pos: int
    num_logits: int
    block_tables: list[list[int]]  # [num_kv_groups][num_blocks]; must cover start_pos + len(token_ids)


@dataclass
class DeviceTokens:
    """Token ids of a step that were not known when its input was built (a draft's proposal): the chunks hold
    placeholders at these flat token indices, and the device overwrites them before the forward, so the host
    never waits for ids still on the GPU, and an input built ahead takes its drafts without being rebuilt."""

    index: torch.Tensor  # [m] int64; flat token index within the step's input
    ids: torch.Tensor  # [m] int64; the token ids, on the model's device

    def write(self, input_ids: torch.Tensor) -> None:
        """Overwrite the placeholders in a step's input ids (queued on the device, no host sync)."""
        input_ids.index_copy_(0, self.index, self.ids)


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata  # common layout + one entry per KV-cache group
    logits_indices: torch.Tensor  # [num_logits] int64; flat token indices whose logits are computed
    num_logits_per_req: list[int]  # [num_reqs]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PreparedForward:
    """A forward's input, already on the device, that has not run yet: `ModelRunner.prepare_forward` builds it,
    `run_forward` writes in the ids that were placeholders and runs it. Between the two a target's worker waits
    for the draft's proposal, so the input is built while the draft works instead of after it."""

    step: StepInput  # on the kernel path, views of the runner's input buffers
    graph_key: tuple[int, ...] | None  # the CUDA graph to replay (engine/runner/cuda_graphs.py); None: run eagerly
    num_tokens: int  # real rows of the output: tokens eagerly, logits rows on a graph (padding rows after them)


@dataclass
class CutForward:
    """A forward whose chunks hold more tokens than the input buffers, cut (`ModelRunner.cut_to_fit`): pieces of
    leading tokens that need no logits, run first, in order, then the rest. Rows index the original chunks' tokens
    flattened in order (what a forward that reads per-token inputs beside the ids, an EAGLE-3 head, selects with)."""

    pieces: list[tuple[list[Chunk], list[int]]]  # [num_pieces] (chunks, their rows); each fits the buffers
    rest: list[Chunk]  # one per original chunk, its last max(num_logits, 1) tokens
    rest_rows: list[int]  # [rest's tokens] the rows of the rest's tokens


def build_step_input(chunks: list[Chunk], groups: list[KVCacheGroupSpec], device: torch.device) -> StepInput:
    """Flatten the chunks and build attention metadata for every KV-cache group of this model."""
    if not chunks:
        raise ValueError("a step needs at least one request")
    query_lens = [len(c.token_ids) for c in chunks]
    seq_lens = [c.start_pos + len(c.token_ids) for c in chunks]
    common = build_common_metadata(query_lens, seq_lens, device)
    groups = [
        build_group_metadata(g.group_id, [c.block_tables[g.group_id] for c in chunks],
                             query_lens, seq_lens, g.spec.block_size, g.spec.sliding_window, device)
        for g in groups
    ]
    ids: list[int] = []
    logits_idx: list[int] = []
    for c in chunks:
        if not 0 <= c.num_logits <= len(c.token_ids):
            raise ValueError(f"{c.num_logits} logits asked for {len(c.token_ids)} tokens")
        ids.extend(c.token_ids)
        logits_idx.extend(range(len(ids) - c.num_logits, len(ids)))
    return StepInput(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=common.positions,
        attn=AttentionMetadata(common=common, groups=groups),
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=device),
        num_logits_per_req=[c.num_logits for c in chunks],
    )
