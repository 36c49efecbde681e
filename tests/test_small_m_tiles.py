"""How the few-row products (engine/kernels/small_m/linear.py) pick their form and tiles
(engine/kernels/small_m/tiles.py): the rules per row count on an H100's SM count, each GPU model's measured
exceptions and the sweeps that write them (benchmarks/small_m_sweep.py), the split-K rule, pipelines fit to the shared
memory, and the row limits. No kernel runs here: tests/test_small_m_linear.py runs them."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.small_m import linear as sml
from engine.kernels.small_m import tiles as small_m_tiles
from engine.kernels.triton_compat import HAS_TRITON

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)


# (in_features K, out_features N) of the four projections of a Qwen3 layer: qkv, o_proj, gate_up, down.
QWEN3_PROJECTIONS = {
    "qwen3-0.6b": {"qkv": (1024, (16 + 2 * 8) * 128), "o": (16 * 128, 1024), "gate_up": (1024, 2 * 3072),
                   "down": (3072, 1024)},
    "qwen3-8b": {"qkv": (4096, (32 + 2 * 8) * 128), "o": (32 * 128, 4096), "gate_up": (4096, 2 * 12288),
                 "down": (12288, 4096)},
}


def test_config_picks_at_one_row_on_an_h100(monkeypatch):
    """The tiles `tiles_for` picks at one row on an H100 (132 SMs) for the eight projections of the Qwen3-0.6B and 8B
    shapes: (BLOCK_N, BLOCK_K, num_warps). For the 0.6B shape a sweep (benchmarks/gpu_small_m.py --sweep, with the
    first weight tile requested before the dependent-launch wait) found these the fastest or within 3% of it; the
    8B picks are those of the earlier sweep, the fastest or within 3.3%. A change of the rule must show here which
    picks it moves."""
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA H100 80GB HBM3")
    expected = {
        ("qwen3-0.6b", "qkv"): (8, 1024, 4), ("qwen3-0.6b", "o"): (4, 2048, 8),
        ("qwen3-0.6b", "gate_up"): (8, 512, 4), ("qwen3-0.6b", "down"): (4, 2048, 8),
        ("qwen3-8b", "qkv"): (4, 2048, 4), ("qwen3-8b", "o"): (4, 2048, 4), ("qwen3-8b", "gate_up"): (4, 2048, 4),
        ("qwen3-8b", "down"): (4, 2048, 4),
    }
    for (shape, proj), tiles in expected.items():
        k, n = QWEN3_PROJECTIONS[shape][proj]
        cfg = small_m_tiles.tiles_for(1, n, k, torch.device("cuda"))
        assert (cfg["USE_DOT"], cfg["BLOCK_M"]) == (False, 1), (shape, proj)
        assert (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == tiles, (shape, proj, cfg)


def test_one_row_exceptions_per_gpu_model(monkeypatch):
    """On a GPU model with measured one-row exceptions (an H200) an 8B model's qkv and gate_up go to cuBLAS and its
    o_proj and down take the measured tiles; the 0.6B shapes, two rows, and a GPU model without exceptions keep
    the rule; a CPU device never looks a name up."""
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    for name, want in (("NVIDIA H200", {"qkv": "cublas", "o": (8, 1024, 4), "gate_up": "cublas",
                                        "down": (8, 1024, 4)}),
                       ("NVIDIA H100 80GB HBM3", {p: (4, 2048, 4) for p in ("qkv", "o", "gate_up", "down")})):
        monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index, name=name: name)
        for proj, tiles in want.items():
            k, n = QWEN3_PROJECTIONS["qwen3-8b"][proj]
            cfg = small_m_tiles.tiles_for(1, n, k, cuda)
            got = "cublas" if cfg.get("CUBLAS") else (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"])
            assert got == tiles, (name, proj, cfg)
            assert not small_m_tiles.tiles_for(2, n, k, cuda).get("CUBLAS")
            # without the exceptions: the rule (what a sweep ranks, what an explicit config overrides)
            rule = small_m_tiles.tiles_for(1, n, k, torch.device("meta"))
            assert small_m_tiles.tiles_for(1, n, k, cuda, measured=False) == rule
        for k, n in QWEN3_PROJECTIONS["qwen3-0.6b"].values():
            assert small_m_tiles.tiles_for(1, n, k, cuda) == small_m_tiles.tiles_for(1, n, k, torch.device("meta"))
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: pytest.fail("looked up off CUDA"))
    assert small_m_tiles.device_name(torch.device("cpu")) == ""


def test_few_rows_sweeps_write_the_table_entry():
    """benchmarks/small_m_sweep.py's few_rows_table on the H200 sweeps' figures (benchmarks/RESULTS.md, "One row on
    an H200", "Attention at head dims 64 and 256" and "Two and four rows on an H200"; the first timed bare cuBLAS, so
    its unfused times here add the ~1.5 us of the separate kernel): the entry engine/kernels/small_m/tiles.py holds
    for that GPU model, with the row loop's and the DOT form's flags, and nothing where the rule is within 5% of the
    best (Qwen3-0.6B at one and two rows, the 270M model's gate_up and down), less the entries a draft loop measured
    level or slower with than without (SmolLM2 at one and two rows, the 270M model at two and four, Qwen3-0.6B at
    four: "Two and four rows on an H200")."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from small_m_sweep import few_rows_table

    def row(rows, n, k, best_us, rule_vs_best, unfused_us, bn, bk, warps, form="fma"):
        best = {"USE_DOT": form == "dot", "BLOCK_M": 16 if form == "dot" else rows, "BLOCK_N": bn, "BLOCK_K": bk,
                "num_warps": warps, "num_stages": 3, **({"ROW_LOOP": True} if form == "row" else {})}
        return {"rows": rows, "n": n, "k": k, "best_us": best_us, "rule_vs_best": rule_vs_best,
                "unfused_us": unfused_us, "best": best}

    sweep = [row(1, 6144, 4096, 18.66, 1.01, 16.6, 4, 1024, 4), row(1, 4096, 4096, 10.60, 1.21, 14.4, 8, 1024, 4),
             row(1, 24576, 4096, 55.10, 1.06, 51.2, 8, 1024, 4), row(1, 4096, 12288, 26.31, 1.15, 29.8, 8, 1024, 4),
             row(1, 4096, 1024, 4.45, 1.0, 6.4, 8, 1024, 4), row(1, 1024, 2048, 2.27, 1.04, 13.8, 8, 2048, 8)]
    # Gemma 3 1B and 270M at one row (cuBLAS timed with its separate kernel)
    sweep += [row(1, 1536, 1152, 3.03, 1.47, 6.48, 4, 2048, 8), row(1, 1152, 1024, 2.08, 1.10, 5.04, 2, 1024, 4),
              row(1, 13824, 1152, 16.57, 1.87, 12.77, 8, 512, 4), row(1, 1152, 6912, 7.99, 1.19, 10.15, 2, 2048, 4),
              row(1, 1536, 640, 2.53, 1.06, 5.27, 8, 1024, 8), row(1, 640, 1024, 1.66, 1.11, 5.08, 8, 1024, 8),
              row(1, 4096, 640, 3.63, 1.0, 5.68, 8, 1024, 4), row(1, 640, 2048, 1.96, 1.0, 7.07, 4, 2048, 8)]
    # two and four rows (and SmolLM2 and Qwen2.5-0.5B at one):
    # (rows, N, K, best, rule / best, unfused, BLOCK_N, BLOCK_K, warps, form)
    figures = [
        (2, 1536, 1152, 3.29, 1.48, 6.56, 4, 2048, 4, "row"), (2, 1152, 1024, 2.34, 1.02, 5.04, 4, 1024, 4, "row"),
        (2, 13824, 1152, 12.69, 2.56, 11.89, 64, 256, 4, "dot"), (2, 1152, 6912, 9.63, 1.54, 9.97, 4, 1024, 8, "fma"),
        (4, 1536, 1152, 4.96, 1.48, 6.25, 4, 2048, 4, "row"), (4, 1152, 1024, 3.76, 1.04, 5.19, 2, 1024, 8, "fma"),
        (4, 13824, 1152, 12.88, 4.37, 12.57, 64, 256, 4, "dot"), (4, 1152, 6912, 15.96, 1.07, 10.24, 8, 512, 8, "fma"),
        (1, 960, 576, 2.26, 1.14, 4.78, 16, 1024, 8, "fma"), (1, 576, 576, 1.51, 1.24, 4.32, 8, 1024, 8, "fma"),
        (1, 3072, 576, 3.08, 1.03, 5.39, 4, 1024, 4, "fma"), (1, 576, 1536, 1.92, 1.0, 5.76, 4, 2048, 8, "fma"),
        (2, 960, 576, 2.9, 1.16, 4.83, 4, 2048, 4, "row"), (2, 576, 576, 1.96, 1.0, 4.03, 8, 1024, 4, "row"),
        (2, 3072, 576, 3.49, 1.06, 5.37, 4, 1024, 4, "row"), (2, 576, 1536, 2.37, 1.07, 5.69, 8, 2048, 8, "row"),
        (4, 960, 576, 4.57, 1.05, 4.74, 4, 2048, 4, "row"), (4, 576, 576, 3.12, 1.06, 4.01, 2, 1024, 8, "fma"),
        (4, 3072, 576, 4.98, 1.0, 5.37, 8, 1024, 4, "row"), (4, 576, 1536, 3.67, 1.12, 5.82, 8, 2048, 8, "row"),
        (2, 1536, 640, 3.01, 1.18, 5.15, 4, 2048, 4, "row"), (2, 640, 1024, 1.94, 1.09, 5.04, 2, 1024, 4, "fma"),
        (2, 4096, 640, 3.84, 1.0, 5.76, 8, 1024, 4, "row"), (2, 640, 2048, 2.67, 1.01, 6.93, 8, 2048, 8, "row"),
        (4, 1536, 640, 4.69, 1.08, 5.0, 2, 1024, 4, "fma"), (4, 640, 1024, 3.02, 1.13, 4.79, 2, 1024, 4, "fma"),
        (4, 4096, 640, 5.45, 1.0, 5.67, 8, 1024, 4, "row"), (4, 640, 2048, 4.15, 1.0, 6.43, 4, 1024, 8, "fma"),
        (2, 4096, 1024, 4.46, 1.0, 6.49, 8, 1024, 4, "row"), (2, 1024, 2048, 2.73, 1.0, 10.95, 4, 2048, 8, "fma"),
        (2, 6144, 1024, 6.98, 1.0, 7.19, 4, 1024, 4, "row"), (2, 1024, 3072, 4.64, 1.0, 7.63, 4, 2048, 8, "fma"),
        (4, 4096, 1024, 6.41, 1.0, 6.56, 8, 1024, 4, "row"), (4, 1024, 2048, 3.45, 1.07, 11.05, 2, 1024, 4, "fma"),
        (4, 6144, 1024, 7.7, 1.0, 7.21, 64, 256, 4, "dot"), (4, 1024, 3072, 5.65, 1.0, 7.65, 4, 1024, 8, "fma"),
        (1, 1152, 896, 2.42, 1.07, 5.01, 16, 1024, 8, "fma"), (1, 896, 896, 1.89, 1.05, 5.59, 8, 1024, 4, "fma"),
        (1, 9728, 896, 8.91, 1.03, 8.40, 4, 1024, 4, "fma"), (1, 896, 4864, 4.88, 1.24, 8.16, 4, 2048, 8, "fma"),
        (2, 1152, 896, 3.16, 1.02, 4.96, 4, 2048, 4, "row"), (2, 896, 896, 2.0, 1.0, 5.51, 8, 1024, 4, "row"),
        (2, 9728, 896, 8.38, 1.14, 8.46, 8, 1024, 4, "row"), (2, 896, 4864, 6.62, 1.0, 8.33, 4, 2048, 8, "fma"),
        (4, 1152, 896, 4.79, 1.01, 5.03, 4, 2048, 4, "row"), (4, 896, 896, 3.3, 1.0, 5.56, 8, 1024, 4, "row"),
        (4, 9728, 896, 9.54, 1.0, 8.45, 64, 256, 4, "dot"), (4, 896, 4864, 7.8, 1.0, 8.33, 4, 1024, 8, "fma"),
    ]
    sweep += [row(*f) for f in figures]
    table = few_rows_table(sweep)
    left_out = {(1, 960, 576), (1, 576, 576), (2, 960, 576), (2, 3072, 576), (2, 576, 1536), (2, 1536, 640),
                (2, 640, 1024), (4, 1536, 640), (4, 640, 1024), (4, 1024, 2048), (4, 6144, 1024)}
    assert left_out <= table.keys()
    entry = small_m_tiles.FEW_ROWS_MEASURED["NVIDIA H200"]
    assert {key: tiles for key, tiles in table.items() if key not in left_out} == {
        key: "CUBLAS" if tiles is small_m_tiles.CUBLAS else tiles for key, tiles in entry.items()}


def test_few_rows_entries_give_the_form_and_row_tile(monkeypatch):
    """An H200's measured entries at 1-4 rows on Gemma 3 1B's shapes: three rows take the four-row entry, the DOT
    form's 16-row tile, the row loop's flag; an H100 takes the same entries, a GPU model without entries the rule;
    `measured=False` is the rule (what a sweep ranks and an explicit config overrides)."""
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    qkv, gate_up, down = (1536, 1152), (13824, 1152), (1152, 6912)
    for m, (n, k), want in ((2, qkv, ("row", 2, 4, 2048, 4)), (3, qkv, ("row", 4, 4, 2048, 4)),
                            (4, qkv, ("row", 4, 4, 2048, 4)), (2, gate_up, "cublas"),
                            (3, gate_up, ("dot", 16, 64, 256, 4)), (4, gate_up, ("dot", 16, 64, 256, 4)),
                            (2, down, ("fma", 2, 4, 1024, 8)), (4, down, "cublas")):
        cfg = small_m_tiles.tiles_for(m, n, k, cuda)
        got = "cublas" if cfg.get("CUBLAS") else (
            "dot" if cfg["USE_DOT"] else "row" if cfg.get("ROW_LOOP") else "fma", cfg["BLOCK_M"], cfg["BLOCK_N"],
            cfg["BLOCK_K"], cfg["num_warps"])
        assert got == want, (m, n, k, cfg)
        rule = small_m_tiles.tiles_for(m, n, k, torch.device("meta"))
        assert small_m_tiles.tiles_for(m, n, k, cuda, measured=False) == rule != cfg
    h200 = small_m_tiles.tiles_for(4, *gate_up, cuda)
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA H100 80GB HBM3")  # shares these entries
    assert small_m_tiles.tiles_for(4, *gate_up, cuda) == h200
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert small_m_tiles.tiles_for(4, *gate_up, cuda) == small_m_tiles.tiles_for(4, *gate_up, torch.device("meta"))


def test_config_picks_at_two_to_four_rows_on_an_h100(monkeypatch):
    """The tiles `tiles_for` picks at 2 and 4 rows on an H100 for the Qwen3-0.6B shape (a draft's catch-up step and
    speculation-ahead branches): (form, BLOCK_N, BLOCK_K, num_warps), each the fastest of two sweeps
    (benchmarks/gpu_small_m.py --sweep, then --sweep row for the row loop) or within 2% of it."""
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA H100 80GB HBM3")
    expected = {
        (2, "qkv"): ("row", 8, 1024, 4), (2, "o"): ("fma", 4, 2048, 8), (2, "gate_up"): ("row", 4, 1024, 4),
        (2, "down"): ("fma", 4, 2048, 8),
        (4, "qkv"): ("row", 8, 1024, 4), (4, "o"): ("fma", 4, 1024, 8), (4, "gate_up"): ("dot", 64, 256, 4),
        (4, "down"): ("fma", 4, 1024, 8),
    }
    for (m, proj), tiles in expected.items():
        k, n = QWEN3_PROJECTIONS["qwen3-0.6b"][proj]
        cfg = small_m_tiles.tiles_for(m, n, k, torch.device("cuda"))
        form = "dot" if cfg["USE_DOT"] else "row" if cfg.get("ROW_LOOP") else "fma"
        assert (form, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == tiles, (m, proj, cfg)
        assert cfg["BLOCK_M"] == (16 if cfg["USE_DOT"] else m)
        assert cfg.get("num_stages", 5) == 5  # the DOT tiles were measured with five pipeline stages


def test_split_k_rule_fills_the_gpu_at_five_to_sixty_four_rows(monkeypatch):
    """Rows 5-64 on an H100 (132 SMs), Qwen3-0.6B and 8B shapes: the DOT form on a row tile of the rows padded to a
    power of two (16 at least), K split into equal, non-empty, BLOCK_K-aligned ranges so that the grid has at least
    one program per SM (the 1024-wide projections had 32-64 programs without the split), and no split where the
    column tiles alone fill the GPU twice over."""
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "")  # the rule itself: no GPU model's tilings
    for shape, projections in QWEN3_PROJECTIONS.items():
        for proj, (k, n) in projections.items():
            for m in (5, 8, 16, 17, 32, 33, 64):
                cfg = small_m_tiles.tiles_for(m, n, k, torch.device("cuda"))
                assert cfg["USE_DOT"] and cfg["BLOCK_M"] == max(16, 1 << (m - 1).bit_length()), (shape, proj, m)
                splits, k_split = small_m_tiles.split_k_range(k, cfg["BLOCK_K"], cfg["SPLIT_K"])
                programs = -(-n // cfg["BLOCK_N"]) * splits
                assert programs >= 132, (shape, proj, m, cfg)
                assert k_split % cfg["BLOCK_K"] == 0 and (splits - 1) * k_split < k <= splits * k_split
                if -(-n // cfg["BLOCK_N"]) >= 2 * 132:
                    assert splits == 1, (shape, proj, m, cfg)
    assert small_m_tiles.split_k_range(300, 128, 4) == (3, 128)  # three K tiles: at most three splits
    assert small_m_tiles.split_k_range(3072, 128, 9) == (8, 384)  # 24 tiles: 8 splits of 3 rather than 9 of 2-3
    assert small_m_tiles.split_k_range(1024, 256, 1) == (1, 1024)
    # a measured tiling (what the sweep prints) replaces the rule for its row tile and shape only
    measured = dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_warps=8, num_stages=4)
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "a GPU model")
    monkeypatch.setitem(small_m_tiles.DOT_MEASURED, "a GPU model", {(32, 1024, 2048): measured})
    assert small_m_tiles.tiles_for(20, 1024, 2048, torch.device("cuda")) == dict(USE_DOT=True, BLOCK_M=32, **measured)
    assert small_m_tiles.tiles_for(16, 1024, 2048, torch.device("cuda"))["BLOCK_N"] == 32


def test_dot_pipelines_cut_to_the_shared_memory_of_their_element_size(monkeypatch):
    """Tables measured in bf16 keep their stages in bf16; in float32, and with the gated epilogue's two weight
    tiles, a pipeline past the device's shared memory (227 KB, an H100's or H200's) loses stages until it fits (not
    below two); the FMA form, devices off CUDA and GPUs that report no size are left alone."""
    monkeypatch.setattr(small_m_tiles, "_shared_memory", lambda device: 227 * 1024)
    cuda = torch.device("cuda", 0)
    gate_up = dict(USE_DOT=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)
    assert small_m_tiles.fit_stages(gate_up, 2, 2, cuda) is gate_up  # bf16: 3 x 40 KB
    assert small_m_tiles.fit_stages(gate_up, 4, 2, cuda)["num_stages"] == 2  # float32: 3 x 80 KB > 227 KB
    assert small_m_tiles.fit_stages(gate_up, 4, 1, cuda) is gate_up  # one weight tile: 3 x 48 KB
    rule = dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=5)
    assert small_m_tiles.fit_stages(rule, 4, 1, cuda)["num_stages"] == 2  # 80 KB a stage in float32
    assert small_m_tiles.fit_stages(rule, 2, 1, cuda)["num_stages"] == 5
    fma = dict(USE_DOT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, num_warps=4)
    assert small_m_tiles.fit_stages(fma, 4, 1, cuda) is fma
    assert small_m_tiles.fit_stages(gate_up, 4, 2, torch.device("cpu")) is gate_up
    monkeypatch.setattr(small_m_tiles, "_shared_memory", lambda device: 0)
    assert small_m_tiles.fit_stages(gate_up, 4, 2, cuda) is gate_up


def test_rows_limit_keeps_wide_layers_at_one_row():
    """An 8B-wide layer (hidden 4096) takes single rows whatever the setting; a draft-wide one takes the setting;
    0 stays off for both."""
    assert sml.rows_limit(4, 4096) == 1 and sml.rows_limit(16, 5120) == 1
    assert sml.rows_limit(4, 1024) == 4 and sml.rows_limit(16, 576) == 16
    assert sml.rows_limit(0, 4096) == 0 and sml.rows_limit(0, 1024) == 0


def test_small_m_rows_setting_goes_up_to_the_kernels_rows():
    """EngineConfig.small_m_rows takes 0..MAX_ROWS (64: the split-K DOT form); beyond it the kernels refuse."""
    from engine.config import EngineConfig

    base = dict(device=torch.device("cpu"), dtype=torch.float32, max_model_len=64)
    EngineConfig(**base, small_m_rows=sml.MAX_ROWS).validate()
    with pytest.raises(ValueError, match=r"small_m_rows must be in \[0, 64\]"):
        EngineConfig(**base, small_m_rows=sml.MAX_ROWS + 1).validate()


QWEN3_8B_PRODUCTS = tuple((n, k) for k, n in QWEN3_PROJECTIONS["qwen3-8b"].values())  # (N, K): qkv, o, gate_up, down


def test_wide_layers_take_their_measured_rows_and_tilings(monkeypatch):
    """A layer in WIDE_LAYERS_MEASURED (an 8B target on an H200) takes its wide path up to its rows, with a
    DOT_MEASURED entry on the same GPU model for each of its four products at that row tile; an entry may send one
    product to cuBLAS (the 8B qkv) while the others take tilings. Another GPU model, or a layer of other shapes
    (Llama-3-8B's MLP), gets 0: the engine's setting alone decides."""
    from engine.kernels.triton_compat import triton

    for gpu, layers in small_m_tiles.WIDE_LAYERS_MEASURED.items():
        for products, rows in layers.items():
            assert small_m_tiles.FMA_MAX_ROWS < rows <= sml.MAX_ROWS and len(products) == 4
            tile = max(16, triton.next_power_of_2(rows))
            assert all((tile, n, k) in small_m_tiles.DOT_MEASURED[gpu] for n, k in products), (gpu, products)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(small_m_tiles, "num_sms", lambda device: 132)
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "NVIDIA H200")
    assert small_m_tiles.wide_layer_rows(QWEN3_8B_PRODUCTS, cuda) == 8
    assert small_m_tiles.tiles_for(5, 6144, 4096, cuda) is small_m_tiles.CUBLAS
    for m in (5, 16):
        down = small_m_tiles.tiles_for(m, 4096, 12288, cuda)
        assert down == dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=2, num_stages=3)
    assert small_m_tiles.tiles_for(17, 4096, 12288, cuda)["BLOCK_M"] == 32  # past the entry's tile: the rule
    llama3_8b = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    assert small_m_tiles.wide_layer_rows(llama3_8b, cuda) == 0
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert small_m_tiles.wide_layer_rows(QWEN3_8B_PRODUCTS, cuda) == 0
