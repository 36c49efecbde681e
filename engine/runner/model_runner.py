"""One model on one device: weights, KV-cache groups and their tensors, and the forward of a step."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.config import EngineConfig, graph_batch_sizes, mixed_graph_token_sizes, resolve_attention_backend
from engine.kernels.activation import ACTIVATIONS
from engine.kernels.small_m.linear import MAX_ROWS, rows_limit
from engine.kernels.small_m.tiles import folds_fp8, wide_layer_rows
from engine.kv_cache.spec import AttentionSpec, KVCacheGroupSpec, group_layers
from engine.model_config import ModelConfig
from engine.models.eagle3 import build_eagle3_head
from engine.models.loader import build_model
from engine.models.moe import max_graph_tokens
from engine.parallel import get_tp_group
from engine.quantization import is_quantized, weights_summary
from engine.quantization.fp8 import folds_quantized
from engine.runner.cuda_graphs import ForwardGraphs, GraphPool
from engine.runner.draft_vocabulary import DraftVocabularyHead, restrict_draft_head
from engine.runner.input_buffers import InputBuffers
from engine.runner.step_input import (
    Chunk,
    CutForward,
    DeviceTokens,
    PreparedForward,
    StepInput,
    build_step_input,
)
from engine.runner.tree_graphs import TreeGraphs

logger = logging.getLogger("specserve")

_DEFAULT_CPU_KV_BYTES = 1 << 30


class ModelRunner:
    """Owns one model (target or draft) on one device: builds it, sizes and allocates its paged KV
    tensors per KV-cache group, and runs forwards. Block accounting (which blocks a request holds) is the
    scheduler's; this class only reads the block tables it is given."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, name: str = "target",
                 draft_token_map: str | None = None) -> None:
        """draft_token_map: a draft's EngineConfig.draft_token_map, its LM head restricted to those tokens
        (engine/runner/draft_vocabulary.py); the logits stay [.., vocab_size] wide."""
        self.name = name
        self.model_config = model_config
        self.config = engine_config
        self.device = engine_config.device
        self.dtype = engine_config.dtype
        quantization = engine_config.draft_quantization if name.startswith("draft") else engine_config.quantization
        if model_config.family == "eagle3":  # an EAGLE-3 head: its own checkpoint formats (engine/models/eagle3.py)
            if quantization:
                raise ValueError(f"quantization={quantization!r}: an EAGLE-3 head is not quantized; leave the "
                                 "draft's quantization unset")
            self.model = build_eagle3_head(model_config, self.device, self.dtype, engine_config.load_format)
        else:
            self.model = build_model(model_config, self.device, self.dtype, load_format=engine_config.load_format,
                                     quantization=quantization)
        # What the weights hold, for the start-up line and /health: {"bytes", "format"} (engine/quantization).
        self.weights = weights_summary(self.model)
        logger.info("%s: weights %.1f MiB, %s", name, self.weights["bytes"] / 2**20, self.weights["format"])
        self.draft_head: DraftVocabularyHead | None = (
            restrict_draft_head(self.model, draft_token_map, model_config.vocab_size, get_tp_group().size)
            if draft_token_map is not None else None)
        self._set_small_m_rows(engine_config.small_m_rows)
        layers = self.model.attention_layers()
        specs = [AttentionSpec(a.num_kv_heads, a.head_dim, self.dtype, engine_config.block_size, a.sliding_window)
                 for a in layers]
        self.kv_groups: list[KVCacheGroupSpec] = group_layers(specs)
        self.num_blocks = self._num_blocks()
        self._bind_kv_caches(layers)
        # The kernel path reads its inputs from buffers at fixed addresses (what CUDA graphs need); the
        # torch reference path builds fresh tensors every step.
        self.backend = resolve_attention_backend(engine_config.attention_backend, self.device)
        self.buffers: InputBuffers | None = None
        self.graphs: ForwardGraphs | None = None
        self.graph_pool: GraphPool | None = None
        self.tree_graphs: TreeGraphs | None = None  # speculation ahead's tree forwards (engine/runner/tree_graphs.py)
        if self.backend == "triton":
            max_reqs = engine_config.max_num_seqs
            # Verify steps may add k + 1 tokens per request beyond the scheduler's token budget.
            per_req = engine_config.num_speculative_tokens + 2
            max_tokens = engine_config.max_num_batched_tokens + max_reqs * per_req
            self.buffers = InputBuffers(self.kv_groups, max_reqs, max_tokens, engine_config.max_model_len, self.device)
            self._build_persistent_decoder(engine_config.persistent_decode_rows)
            if model_config.family != "eagle3":  # a head embeds through the target's table: its proposer warms it
                self.warm_up_attention()
        logger.info("%s: %d KV-cache group(s) %s, %d blocks of %d tokens", name, len(self.kv_groups),
                    [(len(g.layer_ids), g.spec.sliding_window) for g in self.kv_groups], self.num_blocks,
                    engine_config.block_size)

    def warm_up_attention(self) -> list[tuple[int, int]]:
        """Compile every paged-attention variant this runner's steps can select, before the first request: one
        eager forward of a padding-only step per variant (its requests hold no token: nothing is read or written).
        Without it a variant first met mid-serving (a prefill chunk of a new length, a batch of a new size)
        compiles inside that step, for a second or more, in every worker process. Returns the (requests, longest
        query) shapes run."""
        if self.buffers is None or self.device.type != "cuda":
            return []
        from engine.kernels.attention.launch import compiled_variant

        b = self.buffers
        max_keys = b.max_blocks * self.config.block_size
        heads = {(a.num_heads // a.num_kv_heads, a.num_kv_heads, a.head_dim) for a in self.model.attention_layers()}
        shapes: dict[tuple, tuple[int, int]] = {}
        for num_reqs in range(1, b.max_num_reqs + 1):
            for query_len in range(1, min(b.max_num_tokens // num_reqs, self.config.max_model_len) + 1):
                for h in heads:
                    key = (h, compiled_variant(num_reqs, query_len, *h, max_keys, self.device,
                                               kv_bytes=self.dtype.itemsize))
                    shapes.setdefault(key, (num_reqs, query_len))
        runs = sorted(set(shapes.values()))
        for num_reqs, query_len in runs:
            self.execute(b.load_padding(num_reqs, num_reqs * query_len, query_len, num_reqs))
        torch.cuda.synchronize(self.device)  # SYNC: start-up only
        return runs

    def _set_small_m_rows(self, rows: int) -> None:
        """Tell the layers up to how many rows a forward folds its norms and adds into the products
        (engine/kernels/small_m/linear.py), the setting capped for this model's width (`rows_limit`), and the rows a
        wide layer takes past that cap where this GPU measured its wide path faster (`wide_layer_rows`). Not under
        tensor parallelism: a row-parallel product's partial sums must be all-reduced before the residual add that
        the kernel would fold into it."""
        # FP8 weights fold where that was measured faster (small_m_tiles.folds_fp8): the kernels read them as bytes
        # and take the tl.dot forms at every row count, as fast at 64 rows as at one (the weight read once), so a layer
        # that can takes the wide path at every row count up to MAX_ROWS, whatever the cap.
        quantized = is_quantized(self.model)
        on = (rows > 0 and get_tp_group().size == 1
              and (not quantized or (folds_quantized(self.model) and folds_fp8(self.device))))
        rows = rows_limit(rows, self.model_config.hidden_size) if on else 0
        for module in self.model.modules():
            if hasattr(module, "small_m_rows"):
                module.small_m_rows = rows
            if hasattr(module, "wide_rows") and module.mlp.act_name in ACTIVATIONS:
                module.dot_products = on and quantized
                # past the cap: a wide layer's verify rows where this GPU measured its wide path faster
                module.wide_rows = (MAX_ROWS if module.dot_products else
                                    wide_layer_rows(module.product_shapes(), self.device) if on else 0)

    def _build_persistent_decoder(self, rows: int) -> None:
        """Give the model its persistent decoder (engine/kernels/persistent/plan.py) where EngineConfig asks for one
        and it applies: one KV-cache group, no tensor parallelism, a layer narrower than 4096, a model that lays its
        layers out for it. Otherwise its layers run as they are."""
        from engine.kernels.triton_compat import interpreting

        on_kernels = self.device.type == "cuda" or interpreting()
        if not rows or not on_kernels or get_tp_group().size != 1 or len(self.kv_groups) != 1:
            return
        if is_quantized(self.model):  # its plan reads each layer's weights in the model's dtype
            return
        if self.model_config.hidden_size >= 4096 or not hasattr(self.model, "persistent_layers"):
            return
        laid_out = self.model.persistent_layers()
        if laid_out is None:
            return
        from engine.kernels.persistent.plan import PersistentDecoder

        shape, weights = laid_out
        rotary = self.model.model.layers[0].self_attn.rotary
        self.model.model.persistent = PersistentDecoder(shape, weights, rotary.cos, rotary.sin, max_rows=rows)
        logger.info("%s: decode steps of up to %d rows run every layer in one persistent launch", self.name, rows)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        bytes_per_block = sum(g.block_bytes for g in self.kv_groups)
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cfg.gpu_memory_utilization)
            else:
                budget = _DEFAULT_CPU_KV_BYTES
        # No point holding more than every running request at full length could use.
        full = max(g.spec.max_blocks_per_request(cfg.max_model_len) for g in self.kv_groups)
        wanted = cfg.max_num_seqs * full + 1
        n = min(budget // bytes_per_block, wanted)
        # Tensor-parallel ranks may see different free memory, but the router's block tables address every
        # rank's cache alike: all take the smallest count. Reduced before the check below so that a rank
        # short of memory does not raise while the others wait in the collective.
        n = int(get_tp_group().all_reduce_min(torch.tensor([n], dtype=torch.int64, device=self.device)).item())
        min_blocks = full + 1
        if n < min_blocks:
            raise ValueError(
                f"{self.name}: a KV budget of {budget} bytes holds {n} blocks, but one request of max_model_len="
                f"{cfg.max_model_len} needs {min_blocks}; raise kv_cache_memory_bytes or lower max_model_len")
        return int(n)

    def reserve_kv_blocks(self, wanted: int) -> list[int]:
        """Take up to `wanted` block ids out of the ones this runner reports (`num_blocks`, what the scheduler's pools
        hand out), for the runner's side to use on its own (the scratch KV of speculation ahead's branches): the
        highest ids, the same ids in every KV-cache group. Leaves at least what one request of max_model_len needs,
        and takes at most a quarter of the blocks. Call it before anything reads num_blocks; the KV tensors keep
        their size, so the reserved ids stay addressable."""
        full = max(g.spec.max_blocks_per_request(self.config.max_model_len) for g in self.kv_groups)
        n = max(0, min(wanted, self.num_blocks - (full + 1), self.num_blocks // 4))
        self.num_blocks -= n
        return list(range(self.num_blocks, self.num_blocks + n))

    def _bind_kv_caches(self, layers: list) -> None:
        self.kv_caches: list[list[torch.Tensor]] = []  # [num_groups][layers in group]
        for g in self.kv_groups:
            tensors = []
            for layer_id in g.layer_ids:
                # Zeroed: masked keys of padding and released blocks still enter the matmul (times 0).
                t = torch.zeros(2, self.num_blocks, g.spec.block_size, g.spec.num_kv_heads, g.spec.head_dim,
                                dtype=self.dtype, device=self.device)
                layers[layer_id].kv_cache = t
                layers[layer_id].kv_group_id = g.group_id
                tensors.append(t)
            self.kv_caches.append(tensors)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the forward and return logits [num_logits, vocab_size] float32."""
        hidden = self.model(step.input_ids, step.positions, step.attn)
        return self._logits(hidden[step.logits_indices])

    def forward_all(self, step: StepInput) -> torch.Tensor:
        """Logits of every token of the step [num_tokens, vocab_size] float32 (graphs capture this)."""
        return self._logits(self.model(step.input_ids, step.positions, step.attn))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] float32 (a restricted draft head's logits widened to the vocabulary)."""
        logits = self.model.compute_logits(hidden)
        return self.draft_head.widen(logits) if self.draft_head is not None else logits

    def forward_chunks(self, chunks: list[Chunk]) -> torch.Tensor:
        """Build the step's input (attention metadata for every KV-cache group) and run it: a graph replay
        when one fits, else eagerly. A step whose ids are not all known yet uses prepare_forward/run_forward.
        Chunks past the input buffers (a draft's catch-up) run their leading tokens first (`fit_chunks`)."""
        return self.run_forward(self.prepare_forward(self.fit_chunks(chunks)))

    def fit_chunks(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks, cut to fit the input buffers. A draft's catch-up after steps at draft length 0 (or after a
        prefix hit of the target's beyond its own) is not charged to the step's token budget, so its tokens may
        exceed what the buffers hold. Then every chunk's leading tokens (`cut_to_fit`) run now, in forwards that fit
        (the KV written as prefill chunks write it, each request's tokens in order, no logits), and what is returned
        is the rest, a forward that fits (a graph's shape, where one is captured). Only a length check when the
        chunks fit; on the torch reference path (fresh tensors every step) nothing is cut."""
        cut = self.cut_to_fit(chunks)
        if cut is None:
            return chunks
        for piece, _ in cut.pieces:
            self._prefill_piece(piece)
        return cut.rest

    def cut_to_fit(self, chunks: list[Chunk]) -> CutForward | None:
        """None where the chunks fit the input buffers (or there are none: the torch path); else the pieces to run
        ahead and the rest. The rest is the same chunks, in the same order, with their logits rows, each holding its
        last max(num_logits, 1) tokens; the pieces hold everything before, each request's tokens in order, at most
        one segment of a request a piece, each piece as many tokens as the buffers hold."""
        if self.buffers is None:
            return None
        cap = self.buffers.max_num_tokens
        if sum(len(c.token_ids) for c in chunks) <= cap:
            return None
        rest: list[Chunk] = []
        rest_rows: list[int] = []
        # (chunk, its first token, its tokens, its first row in the chunks' flat tokens) of the leading segments
        pending: list[tuple[Chunk, int, int, int]] = []
        offset = 0
        for c in chunks:
            keep = min(len(c.token_ids), max(c.num_logits, 1))
            head = len(c.token_ids) - keep
            if head:
                pending.append((c, 0, head, offset))
            rest.append(Chunk(c.token_ids[head:], c.start_pos + head, c.num_logits, c.block_tables))
            rest_rows.extend(range(offset + head, offset + len(c.token_ids)))
            offset += len(c.token_ids)
        if len(rest) > self.buffers.max_num_reqs or len(rest_rows) > cap:
            raise ValueError(f"a forward of {len(rest)} requests wanting {sum(c.num_logits for c in chunks)} logits "
                             f"rows does not fit the input buffers ({self.buffers.max_num_reqs} / {cap} tokens)")
        pieces: list[tuple[list[Chunk], list[int]]] = []
        while pending:
            piece: list[Chunk] = []
            rows: list[int] = []
            room = cap
            later: list[tuple[Chunk, int, int, int]] = []
            for c, first, n, row in pending:
                take = min(n, room)
                if take:
                    piece.append(Chunk(c.token_ids[first:first + take], c.start_pos + first, 0, c.block_tables))
                    rows.extend(range(row + first, row + first + take))
                    room -= take
                if take < n:  # its later tokens go in the next piece, after these
                    later.append((c, first + take, n - take, row))
            pieces.append((piece, rows))
            pending = later
        return CutForward(pieces, rest, rest_rows)

    @torch.inference_mode()
    def _prefill_piece(self, chunks: list[Chunk]) -> None:
        """One forward over chunks that need no logits, for the KV it writes (eagerly: off the usual shapes)."""
        step = self.buffers.load(chunks)
        self.model(step.input_ids, step.positions, step.attn)

    def prepare_forward(self, chunks: list[Chunk]) -> PreparedForward:
        """The step's input on the device, not run yet (placeholders may stand where ids are still missing). Not cut to
        fit the buffers (a placeholder among leading tokens run ahead would be read before it is written): its
        callers (the target's verify, the scheduler's budget bounds its tokens; an EAGLE-3 head's forward, which
        pairs every row with a target state) pass chunks that fit, and chunks that do not are refused by the
        buffers with a ValueError."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if self.buffers is None:
            return PreparedForward(build_step_input(chunks, self.kv_groups, self.device), None, num_tokens)
        key = self.graphs.bucket(chunks) if self.graphs is not None else None
        if key is not None:
            # A graph's output rows: the step's logits rows (every token's, for a uniform graph), then padding.
            return PreparedForward(self.graphs.load(chunks, key), key, sum(c.num_logits for c in chunks))
        return PreparedForward(self.buffers.load(chunks), None, num_tokens)

    def run_forward(self, prepared: PreparedForward, device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        """Write device_tokens over their placeholders and run the prepared input: logits [num_logits, V]
        (every real token's on a graph replay, whose chunks all want logits)."""
        if device_tokens is not None:
            device_tokens.write(prepared.step.input_ids)
        if prepared.graph_key is not None:
            return self.graphs.replay(prepared.graph_key, prepared.num_tokens)
        return self.execute(prepared.step)

    def capture_graphs(self, query_lens: list[int]) -> None:
        """Capture decode/verify graphs for these query lengths (1: decode, k + 1: verify), and the mixed graphs
        (a prefill chunk beside other rows, one logits row per request when query_lens is empty: the draft's),
        unless eager."""
        if not self.captures_graphs:
            return
        if self.graph_pool is None:
            self.graph_pool = GraphPool()
        mixed = mixed_graph_token_sizes(self.config)
        limit = max_graph_tokens(self.model)
        if limit is not None:  # routed experts: larger prefill chunks run eagerly (engine/models/moe.py)
            mixed = [t for t in mixed if t <= limit]
        self.graphs = ForwardGraphs(self.buffers, torch.inference_mode()(self.forward_all),
                                    graph_batch_sizes(self.config), query_lens, self.graph_pool,
                                    gathered=self.execute, mixed_token_sizes=mixed,
                                    side_output=self._aux_side_output())
        self.graphs.capture()

    def _aux_side_output(self) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]] | None:
        """The auxiliary states an EAGLE-3 head reads, kept through graph replays: set on the model before the
        graphs are captured (engine/speculation/eagle3_proposer.py), they are a side output of every graph."""
        if self.model_config.family == "eagle3" or not self.model.model.aux_layer_ids:
            return None
        inner = self.model.model
        return (lambda: inner.aux_hidden), (lambda t: setattr(inner, "aux_hidden", t))

    def build_tree_graphs(self, row_buckets: list[int], max_nodes: int, max_total_rows: int,
                          capture: bool = True) -> TreeGraphs:
        """Padded buffers for tree forwards of up to max_num_seqs trees (graph batch-size buckets) and `row_buckets`
        rows a tree, trees of at most max_nodes nodes, at most max_total_rows rows a forward; their CUDA graphs
        captured where this runner captures graphs (`capture` and the kernel path on a GPU, not eager). Tree
        forwards (engine/speculation/ahead/tree_draft.py) then run through them where they fit."""
        max_blocks = max(-(-self.config.max_model_len // g.spec.block_size) for g in self.kv_groups)
        graphs = TreeGraphs(self.kv_groups, torch.inference_mode()(self.forward_all), graph_batch_sizes(self.config),
                            row_buckets, max_nodes, max_total_rows, max_blocks, self.backend, self.device)
        if capture and self.captures_graphs:
            graphs.capture()
        self.tree_graphs = graphs
        return graphs

    @property
    def captures_graphs(self) -> bool:
        """Whether this runner's forwards run as CUDA graphs: the kernel path on a GPU, not eager."""
        return self.backend == "triton" and not self.config.enforce_eager and self.device.type == "cuda"

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size
