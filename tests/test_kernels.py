"""The Triton kernels (engine/kernels) against their torch references, on CPU under Triton's interpreter.

TRITON_INTERPRET=1 only works if it is set before triton is first imported, and this test process has
imported triton long before (transformers imports it), so the kernel tests run in child pytest processes
started with the variable set (tests/interpreter_children.py); in this process they are skipped and
`test_kernels_under_interpreter` runs the children and fails with their output if any kernel test fails. Started
with TRITON_INTERPRET=1 from the outset, the tests run in-process.

The interpreter's tl.dot mishandles bfloat16, so attention runs in fp32 and fp16 here; bf16 is covered by
tests/gpu/test_kernels_cuda.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by
from kernel_support import attention_case, poison_outside_window, rejection_case

from engine.kernels.attention import kv_store
from engine.kernels.attention import launch as attention_launch
from engine.kernels.attention import paged as paged_attention
from engine.kernels.speculation import rejection
from engine.kernels.triton_compat import HAS_TRITON, interpreting
from engine.speculation import rejection_sampler

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

INTERPRETED = interpreting()
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process started "
                                                         "by test_kernels_under_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter: the kernel tests run in this process")
def test_kernels_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: two of the three head shapes of
    # paged attention, and the rest (the third, the other attention checks, the KV store and rejection sampling).
    assert_pytest_children_pass(__file__, split_by("paged_attention_matches_reference and not 2-2-64"))


# --------------------------------------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------------------------------------

# A mix of padding requests (q_len 0), decode (1), verify (3) and a prefill (17) after cached prefixes that end
# inside and at the edges of blocks; a request's tokens then cross block boundaries.
MIXED = ([1, 3, 0, 17, 1, 5], [40, 14, 0, 29, 0, 59])
DECODE = ([1, 1, 0, 1], [33, 16, 5, 70])
VERIFY = ([5, 5, 5], [12, 31, 0])
LONG = ([1, 4, 0, 1], [300, 190, 0, 64])  # several key tiles per request: for splits of the keys
# More key tiles than one chunk of the combine's splits (16): a grid of 32 splits has 18-35 live ones here.
LONGER = ([1, 2], [1100, 20])


def _check_attention(case, atol: float, rtol: float, splits: int | None = None) -> None:
    sentinel = 7.0
    out = torch.full_like(case.query, sentinel)
    ref = torch.full_like(case.query, sentinel)
    paged_attention.paged_attention_ref(*case.args(ref))
    kv = poison_outside_window(case) if case.sliding_window is not None else case.kv_cache
    paged_attention.paged_attention(*case.args(out, kv), num_kv_splits=splits)
    n = case.num_valid_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    pad = out[n:]
    assert bool(((pad == sentinel) | (pad == 0)).all()), "padding tokens were written with values"


@interpreted
# Each query-heads-per-KV-head count (1; 3, padded to a 4-row group with masked rows; 4) once and each head size
# once: the kernel's constants (HEADS_PER_KV, HEAD_DIM and the row block they give) take every value, and under the
# interpreter their pairings change no branch (only GPU warp counts, which tests/gpu/test_kernels_cuda.py covers).
# The full 3 x 3 product cost three times the interpreted time.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (6, 2, 128), (8, 2, 256)])
def test_paged_attention_matches_reference(num_heads, num_kv_heads, head_dim):
    # The mask cases, float32, at one head shape: 16-token blocks without a window, with one inside a block (5) and
    # one across blocks (20); 32-token blocks with a window inside one. Not a product: the block size only indexes
    # the block table (a 32-token block without a window, or with one of 5, runs no branch these do not), and the
    # other head shapes take the window across blocks here (their rows without a window: the cases below).
    mask_cases = ((16, None), (16, 5), (16, 20), (32, 20)) if head_dim == 64 else ((16, 20),)
    for block_size, window in mask_cases:
        case = attention_case(num_heads, num_kv_heads, head_dim, block_size, *MIXED, window, torch.float32,
                              seed=block_size + (window or 0))
        _check_attention(case, atol=2e-5, rtol=1e-4)
    # fp16; and flash-decoding splits of the keys: some splits of the short requests see no key at all, and a grid
    # of more splits than a request has tiles leaves most of them idle (the combine must read the live ones only).
    # At head dims 64 and 128 the launch picks 64- or 128-key tiles by a split's share of keys (attention_launch); both
    # occur. Head dim 256 reads 64 keys here, 32 in the prefill rows of the cases above.
    tiles = set()
    for lens, window, splits in ((DECODE, None, 1), (DECODE, 7, 4), (VERIFY, None, 4), (VERIFY, 9, 1),
                                 (LONG, None, 4), (LONG, 100, 8), (LONG, None, 32), (LONGER, None, 32),
                                 (LONGER, 300, 32), (LONG, 100, 1), (LONGER, 300, 4)):
        case = attention_case(num_heads, num_kv_heads, head_dim, 16, *lens, window, torch.float16, seed=head_dim)
        _check_attention(case, atol=2e-3, rtol=2e-3, splits=splits)
        tiles.add(attention_launch.kernel_variant(len(lens[0]), max(lens[0]), num_heads // num_kv_heads, num_kv_heads,
                                                  head_dim, case.block_table.shape[1] * 16, case.query.device,
                                                  splits, kv_bytes=case.kv_cache.element_size()).tile_n)
    assert tiles == ({64, 128} if head_dim in (64, 128) else {64}), tiles


@interpreted
def test_paged_attention_int64_metadata_and_loose_max_query_len():
    case = attention_case(4, 1, 64, 16, *MIXED, 6, torch.float32, seed=3)
    case.max_query_len += 9  # an upper bound (e.g. a CUDA graph's bucket) sizes the grid only
    case.query_start_loc = case.query_start_loc.long()
    case.seq_lens = case.seq_lens.long()
    case.block_table = case.block_table.long()
    _check_attention(case, atol=2e-5, rtol=1e-4)


@interpreted
def test_paged_attention_reads_strided_views_of_the_engine_cache():
    """The engine passes kv_cache[0] / kv_cache[1] of a [2, num_blocks, ...] tensor; a wrong stride would
    read the other half. Here the value half is the negated key half, so keys and values must not mix."""
    case = attention_case(4, 2, 64, 32, *VERIFY, None, torch.float32, seed=4)
    case.kv_cache[1] = -case.kv_cache[0]
    _check_attention(case, atol=2e-5, rtol=1e-4)


def test_paged_attention_rejects_bad_shapes():
    case = attention_case(6, 4, 64, 16, *DECODE, None, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention.paged_attention_ref(*case.args(torch.empty_like(case.query)))
    case = attention_case(4, 2, 64, 16, *DECODE, None, torch.float32)
    with pytest.raises(ValueError, match="out must have the query's shape"):
        paged_attention.paged_attention_ref(*case.args(torch.empty(1, 4, 64)))
    case.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention.paged_attention_ref(*case.args(torch.empty_like(case.query)))


def test_split_rule_goes_wide_for_a_tiny_grid_only(monkeypatch):
    """Batch 1 (8 programs on 132 SMs) splits its keys up to 64 ways, never into more splits than key tiles; a grid of
    a batch of 8 keeps `_auto_splits` (two programs an SM, 4 splits); off CUDA nothing is split. A grid of one to four
    programs (a model of few KV heads) goes past 64 splits only where each keeps four tiles."""
    monkeypatch.setattr(attention_launch, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert attention_launch._decode_splits(8, 512, cuda) == 64
    assert attention_launch._decode_splits(8, 8, cuda) == 8
    assert attention_launch._auto_splits(8, 512, cuda) == 16
    assert attention_launch._decode_splits(64, 512, cuda) == attention_launch._auto_splits(64, 512, cuda) == 4
    assert attention_launch._decode_splits(8, 512, torch.device("cpu")) == 1
    assert attention_launch._decode_splits(3, 512, cuda) == 128  # 32k tokens in 64-key tiles: 256 keys a split
    assert attention_launch._decode_splits(3, 128, cuda) == 64  # 8k tokens: 128 splits would hold one tile each
    assert attention_launch._decode_splits(1, 1024, cuda) == 128
    assert attention_launch._decode_splits(1, 256, cuda) == 64


def test_key_tiles_follow_programs_an_sm(monkeypatch):
    """A decode or verify launch (up to 32 rows a program) picks its key tile and warps from its head dim, how many
    programs share an SM and a split's share of keys. At head dim 128: four programs an SM (a tiny grid's wide splits)
    whose splits hold 256 keys or more take 64 keys with 2 warps (32 keys for 32 rows), about two take 128 keys with 4
    warps (64 where a split's share of keys is shorter). Head dim 64 takes 128 keys (8 warps from 1024 keys a split),
    head dim 256 64 keys with 8 warps, or 32 with 2 at four programs an SM. A tile whose pipeline would not fit the
    GPU's shared memory (a float32 cache) is not taken. Prefill rows keep 64 keys (32 at head dim 256); off CUDA the
    grid counts as one program an SM. The tile and warps select the compiled kernel, so a runner's warm-up compiles
    each."""
    monkeypatch.setattr(attention_launch, "_num_sms", lambda device: 132)
    monkeypatch.setattr(attention_launch, "_shared_memory", lambda device: 232448)  # an H100's or H200's
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    variant = functools.partial(attention_launch.kernel_variant, kv_bytes=2)  # a bf16 / fp16 cache unless named
    qwen = dict(num_kv_heads=8, head_dim=128, max_keys=32768)
    assert variant(1, 1, 2, device=cuda, **qwen)[2:] == (64, 64, 2)  # 512 programs of 512 keys
    assert variant(1, 1, 2, 8, 128, 8192, cuda)[2:] == (64, 64, 4)  # 512 programs of 128 keys
    assert variant(8, 1, 2, device=cuda, **qwen)[2:] == (4, 128, 4)  # 256
    assert variant(8, 1, 2, device=cuda, kv_bytes=4, **qwen)[2:] == (4, 64, 4)  # float32: 128 keys do not fit
    assert variant(1, 5, 4, device=cuda, **qwen)[2:] == (64, 32, 2)  # the 8B verify: 32 rows, 512 programs
    assert variant(8, 5, 4, device=cuda, **qwen)[2:] == (4, 128, 4)
    assert variant(2, 1, 2, 8, 128, 512, cuda)[2:] == (8, 64, 4)  # a split's share, 64 keys, under one wide tile
    assert variant(1, 64, 2, device=cuda, **qwen).tile_n == 64  # 128 rows: a prefill's tiles
    assert variant(1, 1, 2, device=cpu, **qwen)[2:] == (1, 128, 4)
    gemma = dict(heads_per_kv=4, num_kv_heads=1, head_dim=256, device=cuda)
    assert variant(1, 1, max_keys=32768, **gemma)[2:] == (128, 64, 8)  # 128 programs
    assert variant(8, 1, max_keys=32768, **gemma)[2:] == (64, 32, 2)  # 512 programs
    assert variant(8, 1, max_keys=2048, **gemma)[2:] == (64, 64, 4)  # 32 keys a split
    assert variant(1, 1, max_keys=32768, kv_bytes=4, **gemma)[2:] == (128, 32, 4)  # float32 keeps 32 keys
    smollm2 = dict(heads_per_kv=3, num_kv_heads=3, head_dim=64, device=cuda)
    assert variant(1, 1, max_keys=32768, **smollm2)[2:] == (128, 128, 4)  # 256 keys a split
    assert variant(8, 1, max_keys=32768, **smollm2)[2:] == (8, 128, 8)  # 4096
    assert variant(1, 1, max_keys=2048, **smollm2)[2:] == (32, 64, 4)  # 64 keys a split
    tiny, batch8 = (attention_launch.compiled_variant(b, 1, 2, 8, 128, 32768, cuda, kv_bytes=2) for b in (1, 8))
    assert tiny == (16, True, 64, 2) and batch8 == (16, True, 128, 4)
    monkeypatch.setattr(attention_launch, "_shared_memory", lambda device: 0)  # not reported: no wider tile
    assert variant(8, 1, 2, device=cuda, **qwen)[2:] == (4, 64, 4)


@pytest.mark.skipif(INTERPRETED, reason="checks the error outside the interpreter")
def test_kernels_refuse_cpu_tensors_without_interpreter():
    case = attention_case(4, 2, 64, 16, *DECODE, None, torch.float32)
    with pytest.raises(ValueError, match="paged_attention_ref"):
        paged_attention.paged_attention(*case.args(torch.empty_like(case.query)))


# --------------------------------------------------------------------------------------------------------
# KV store
# --------------------------------------------------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (3, 128, 32), (2, 256, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference_and_skips_padding(num_kv_heads, head_dim, block_size, slot_dtype):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 6, 21
    base = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).half()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7, 20]] = -1  # CUDA-graph padding tokens
    slots = slots.to(slot_dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)  # fp32 into an fp16 cache: cast
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    got, want = base.clone(), base.clone()
    kv_store.store_kv(key, value, got[0], got[1], slots)
    kv_store.store_kv_ref(key, value, want[0], want[1], slots)
    assert torch.equal(got, want)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    flat = got.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    assert torch.equal(flat[:, ~written], base.view_as(flat)[:, ~written]), "a slot outside the mapping changed"
    assert torch.equal(flat[0, slots[0].long()], key[0].half())


def test_store_kv_rejects_bad_slot_mapping():
    cache = torch.zeros(2, 4, 16, 2, 64)
    key = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="one slot per token"):
        kv_store.store_kv_ref(key, key, cache[0], cache[1], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32 or int64"):
        kv_store.store_kv_ref(key, key, cache[0], cache[1], torch.zeros(3))


# --------------------------------------------------------------------------------------------------------
# rejection sampling
# --------------------------------------------------------------------------------------------------------


def _check_rejection(case) -> None:
    want = rejection_sampler.rejection_sample_from_noise(*case.args())
    got = rejection.rejection_sample_from_noise(*case.args())
    assert torch.equal(got.output_token_ids, want.output_token_ids), (got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.num_output, want.num_output)
    assert got.output_token_ids.dtype == got.num_accepted.dtype == got.num_output.dtype == torch.int64


@interpreted
@pytest.mark.parametrize("mode", ["strict", "probabilistic", "synthetic"])
@pytest.mark.parametrize("noise", [False, True], ids=["greedy", "random"])
def test_rejection_matches_torch(mode, noise):
    accepted = 0
    for max_k in (0, 1, 3, 5):
        for seed in range(2):
            case = rejection_case(mode, 7, max_k, 300, noise, seed=seed + 10 * max_k)
            _check_rejection(case)
            accepted += int(rejection_sampler.rejection_sample_from_noise(*case.args()).num_accepted.sum())
    assert accepted > 0, "no draft was accepted: the accepted-prefix paths went untested"


@interpreted
@pytest.mark.parametrize("mode", ["strict", "probabilistic", "synthetic"])
def test_rejection_large_vocab_ties_and_raw_logits(mode):
    # Several vocabulary blocks, with ties across them (first index wins, as torch.argmax).
    _check_rejection(rejection_case(mode, 3, 2, 9000, noise=False, ties=True, seed=1))
    _check_rejection(rejection_case(mode, 3, 2, 9000, noise=True, ties=True, seed=2))
    if mode != "probabilistic":  # all-greedy strict / synthetic batches pass raw logits (negative scores)
        _check_rejection(rejection_case(mode, 4, 3, 500, noise=False, raw_logits=True, seed=3))


@interpreted
def test_rejection_broadcasts_one_noise_row_in_strict_mode():
    case = rejection_case("strict", 5, 3, 200, noise=True, seed=5)
    case.exponentials = case.exponentials[:, :1].contiguous()
    _check_rejection(case)


def test_rejection_rejects_missing_inputs():
    case = rejection_case("probabilistic", 2, 2, 50, noise=False)
    case.draft_probs = None
    with pytest.raises(ValueError, match="draft_probs"):
        rejection.rejection_sample_from_noise(*case.args())
    case = rejection_case("synthetic", 2, 2, 50, noise=False)
    case.rate = None
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        rejection.rejection_sample_from_noise(*case.args())
