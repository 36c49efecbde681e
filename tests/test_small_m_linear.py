"""The few-row products with folded norms, activation and residual adds (engine/kernels/small_m_linear.py) against
their torch references, and greedy decoding through them (target decode and verify, and the draft loop) against
HF for the families the other kernel-path tests leave out, on CPU under Triton's interpreter (in child processes,
tests/interpreter_children.py). CUDA runs the kernel checks in tests/gpu/test_small_m_linear_cuda.py."""

from __future__ import annotations

import pytest
import torch
from interpreter_children import assert_pytest_children_pass, split_by

from engine.kernels import arrival_counters, small_m_tiles
from engine.kernels import small_m_linear as sml
from engine.kernels.triton_compat import HAS_TRITON, interpreting

if not HAS_TRITON:
    pytest.skip("triton is not installed (the `test` extra installs it on Linux)", allow_module_level=True)

interpreted = pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 child process")


@pytest.mark.skipif(interpreting(), reason="already under the interpreter")
def test_small_m_linear_under_interpreter():
    # Two children side by side (tests/interpreter_children.py), of about equal work: the kernel checks and Gemma 3,
    # and the two Qwen families.
    assert_pytest_children_pass(__file__, split_by("references or gemma3"))


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
    its unfused times here add the ~1.5 us of the separate kernel): the entry engine/kernels/small_m_tiles.py holds
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
    form's 16-row tile, the row loop's flag; a GPU model without entries keeps the rule; `measured=False` is the
    rule (what a sweep ranks and an explicit config overrides)."""
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
    monkeypatch.setattr(small_m_tiles, "_cuda_name", lambda index: "NVIDIA H100 80GB HBM3")
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
    monkeypatch.setattr(small_m_tiles, "_shared_memory", lambda index: 227 * 1024)
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
    monkeypatch.setattr(small_m_tiles, "_shared_memory", lambda index: 0)
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


def check_small_m_linear(device: str, dtype: torch.dtype, rows: tuple[int, ...] = (1, 2, 3, 5),
                         shapes: tuple[tuple[int, int], ...] = ((96, 200),), config: dict | None = None) -> None:
    """Every prologue and epilogue against its reference in each of the kernel's forms (on the interpreter's 4
    "SMs": 1 row FMA, 2 rows the row loop, 3 rows the five-stage tl.dot tiles, 5 rows the tl.dot tiles beyond; the
    narrow shape's 2 and 3 rows the row loop over several K tiles), with a K that
    is not a multiple of the K tile and an N that is not a multiple of the N tile; shared with the CUDA test.
    `config` overrides the kernel's tiles (a narrow BLOCK_K makes K span several tiles: the first is read before
    the dependent-launch wait, the others in the loop)."""
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    for k, n in shapes:
        w, bias = rand(n, k, scale=k ** -0.5), rand(n)
        for m in rows:
            x, res = rand(m, k, scale=2.0), rand(m, k)
            # (norm offset, residual, bias): Llama form alone, Llama form with everything, Gemma form
            for offset, r, b in ((0.0, None, None), (0.0, res, bias), (1.0, res, None)):
                nw = rand(k, scale=0.1) + (0.0 if offset else 1.0)
                out, s = sml.norm_linear(x, r, nw, 1e-6, offset, w, b, config=config)
                ref, ref_s = sml.norm_linear_ref(x, r, nw, 1e-6, offset, w, b)
                torch.testing.assert_close(out, ref, **tol)
                assert torch.equal(s, ref_s)  # the residual sum is rounded once, as torch rounds it
            gate_up = rand(m, 2 * k, scale=2.0)
            for act in ("silu", "gelu_pytorch_tanh"):
                torch.testing.assert_close(sml.act_linear(gate_up, act, w, config=config),
                                           sml.act_linear_ref(gate_up, act, w), **tol)
            add = rand(m, n)
            torch.testing.assert_close(sml.linear_add(x, w, bias, add, config=config),
                                       sml.linear_add_ref(x, w, bias, add), **tol)
    x = rand(2, 96)
    with pytest.raises(ValueError, match="at most"):
        sml.linear_add(rand(sml.MAX_ROWS + 1, 96), rand(8, 96), None, rand(sml.MAX_ROWS + 1, 8))
    with pytest.raises(ValueError, match="weight"):
        sml.linear_add(x, rand(8, 95), None, rand(2, 8))
    with pytest.raises(ValueError, match="act_linear supports"):
        sml.act_linear(x, "relu", rand(8, 48))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_small_m_linear_matches_references(dtype):
    check_small_m_linear("cpu", dtype)
    check_small_m_linear("cpu", dtype, shapes=((300, 40),), config={"BLOCK_K": 128})  # three K tiles
    # cuBLAS with the separate norm / activation / add, where FEW_ROWS_MEASURED sends a product
    check_small_m_linear("cpu", dtype, rows=(1, 3), config=small_m_tiles.CUBLAS)


@interpreted
def test_a_gpu_models_cublas_entry_and_an_explicit_config(monkeypatch):
    """Where a GPU model's table sends a shape to cuBLAS at one row and at three to four (the four-row entry), the
    wrappers run the unfused form there and the kernel at two; an explicit config still runs the kernel (sweeps and
    tests time tilings with it); all match the references."""
    k, n = 96, 40
    monkeypatch.setattr(small_m_tiles, "device_name", lambda device: "a GPU model")
    monkeypatch.setitem(small_m_tiles.FEW_ROWS_MEASURED, "a GPU model",
                        {(1, n, k): small_m_tiles.CUBLAS, (4, n, k): small_m_tiles.CUBLAS})
    unfused, calls = sml.unfused_product, []
    monkeypatch.setattr(sml, "unfused_product", lambda *a: calls.append(a[0].shape[0]) or unfused(*a))
    g = torch.Generator().manual_seed(2)
    w, nw = torch.randn(n, k, generator=g) * k ** -0.5, torch.rand(k, generator=g) + 0.5
    for m, config, want in ((1, None, [1]), (2, None, []), (3, None, [3]), (4, None, [4]), (1, {"BLOCK_K": 32}, [])):
        calls.clear()
        x, res = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
        out, s = sml.norm_linear(x, res, nw, 1e-6, 0.0, w, config=config)
        ref, ref_s = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(s, ref_s) and calls == want, (m, config, calls)


@interpreted
def test_split_k_matches_references(monkeypatch):
    """5, 17 and 64 rows (row tiles of 16, 32, 64) with K split in three (the last program to arrive at a column
    tile sums the partials) and unsplit, each prologue and the epilogue once, float32 and float16 (the interpreter's
    bf16 tl.dot is wrong: bf16 runs in the CUDA test): the references' results up to the sum order, the residual
    sum exact, and every arrival counter back at zero after each launch (the next launch reuses them)."""
    g = torch.Generator().manual_seed(1)
    k, n = 96, 40  # three K tiles of 32; three column tiles of 16, the last partly masked
    used = []
    monkeypatch.setattr(sml, "arrival_counters", lambda device, t: used.append(t) or arrival_counters.arrival_counters(
        device, t))
    assert small_m_tiles.split_k_range(k, 32, 3) == (3, 32)
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.float16, dict(atol=3e-2, rtol=3e-2))):
        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        w, bias, nw = rand(n, k, scale=k ** -0.5), rand(n), rand(k, scale=0.1) + 1.0
        for m, split in ((5, 3), (17, 1), (64, 3)):
            cfg = dict(USE_DOT=True, BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
                       SPLIT_K=split)
            x, res, add, gate_up = rand(m, k, scale=2.0), rand(m, k), rand(m, n), rand(m, 2 * k, scale=2.0)
            out, s = sml.norm_linear(x, res, nw, 1e-6, 0.0, w, bias, config=cfg)
            ref, ref_s = sml.norm_linear_ref(x, res, nw, 1e-6, 0.0, w, bias)
            torch.testing.assert_close(out, ref, **tol)
            assert torch.equal(s, ref_s)  # written once, by the first program
            torch.testing.assert_close(sml.act_linear(gate_up, "silu", w, config=cfg),
                                       sml.act_linear_ref(gate_up, "silu", w), **tol)
            torch.testing.assert_close(sml.linear_add(x, w, bias, add, config=cfg),
                                       sml.linear_add_ref(x, w, bias, add), **tol)
            assert all(not c.any() for c in arrival_counters._buffers.values())
    assert used == [3] * 12  # the split launches (and only those) took counters, one per column tile


@interpreted
def test_row_squares_and_gated_epilogue_match_references():
    """The wide path's forms (5-64 rows): linear_add_ss's output and its rows' sums of squares per column tile (split
    K and not), the norm reading them (row_ss) instead of x's rows, and gate_up with the activation as its epilogue
    (glu; SiLU, and GELU with Gemma's offset norm), float32 and float16, against the references; and what they
    refuse, named."""
    g = torch.Generator().manual_seed(3)
    k, n, inter = 96, 40, 24
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.float16, dict(atol=3e-2, rtol=3e-2))):
        def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        w, bias, nw = rand(n, k, scale=k ** -0.5), rand(n), rand(n, scale=0.1) + 1.0
        w_q, w_gu = rand(32, n, scale=n ** -0.5), rand(2 * inter, n, scale=n ** -0.5)
        for m, split in ((5, 3), (17, 1), (64, 2)):
            cfg = dict(USE_DOT=True, BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
                       SPLIT_K=split)
            x, add = rand(m, k), rand(m, n, scale=2.0)
            y, ss = sml.linear_add_ss(x, w, bias, add, config=cfg)
            ref_y, ref_ss = sml.linear_add_ss_ref(x, w, bias, add)
            torch.testing.assert_close(y, ref_y, **tol)
            assert ss.shape == (3, m) and ss.dtype == torch.float32  # three column tiles of 16
            torch.testing.assert_close(ss.sum(0), y.float().square().sum(-1), atol=1e-3, rtol=1e-5)
            for act, offset in (("silu", 0.0), ("gelu_pytorch_tanh", 1.0)):
                plain = dict(cfg, SPLIT_K=1)
                out, s = sml.norm_linear(y, None, nw, 1e-6, offset, w_q, config=plain, row_ss=ss)
                torch.testing.assert_close(out, sml.norm_linear_ref(y, None, nw, 1e-6, offset, w_q)[0], **tol)
                assert s is y
                gated, _ = sml.norm_linear(y, None, nw, 1e-6, offset, w_gu, config=plain, row_ss=ss, glu=act)
                ref = sml.norm_linear_ref(y, None, nw, 1e-6, offset, w_gu, glu=act)[0]
                assert gated.shape == (m, inter)
                torch.testing.assert_close(gated, ref, **tol)
    x, w_gu, nw = torch.randn(5, 64), torch.randn(6, 64), torch.ones(64)
    with pytest.raises(ValueError, match="without split K"):
        sml.norm_linear(x, None, nw, 1e-6, 0.0, w_gu, glu="silu", config=dict(USE_DOT=True, BLOCK_M=16, BLOCK_N=16,
                                                                               BLOCK_K=16, SPLIT_K=2))
    with pytest.raises(ValueError, match="glu takes"):
        sml.norm_linear(x, None, nw, 1e-6, 0.0, torch.randn(5, 64), glu="silu")
    with pytest.raises(ValueError, match="row_ss"):
        sml.norm_linear(x, torch.randn(5, 64), nw, 1e-6, 0.0, w_gu, row_ss=torch.zeros(1, 5))


@interpreted
# Llama itself is left out: its layers are the Qwen ones' (engine/models/llama.py) without a bias (Qwen2 has one)
# or a q/k norm (Qwen3 has one), and each of those branches runs here with the other family (Mistral's Llama
# layers run the kernel path in tests/test_kernel_path.py). Each interpreted family costs over a minute of CI time.
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_greedy_through_small_m_kernels_equals_hf(tmp_path, family):
    """Decode (1-4 rows, FMA form) and verify of 3 drafts (up to 16 rows, tl.dot form) through the new kernels,
    float32: token for token HF's greedy output; and the draft loop alone (3 rows) from a 1-layer Qwen3 draft."""
    from conftest import TINY_CONFIGS, hf_greedy, make_tiny_model, random_prompts
    from fast_path_support import draft_runner, hf_draft_tokens, run_draft_loop

    from engine import LLM, SamplingParams
    from engine.speculation.draft_loop import DraftLoop

    torch.set_num_threads(1)
    target = make_tiny_model(tmp_path, family, TINY_CONFIGS[family])
    draft = make_tiny_model(tmp_path, family + "-draft", TINY_CONFIGS[family], scale=5.9)
    prompts = random_prompts([5, 9, 14, 3], seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(target.path, draft_model=draft.path, num_speculative_tokens=3, attention_backend="triton",
              device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=4, small_m_rows=16)
    layer = llm.executor.target.model.model.layers[0]
    assert layer.small_m_rows == 16 and layer.mlp.small_m_rows == 16
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(target.hf, p, 10), f"{family}: prompt of {len(p)} tokens diverged"
    assert llm.spec_stats(outs).acceptance_rate > 0.3
    if family == "qwen3":
        runner = draft_runner(draft, "cpu", 5, 4, graphs=False, small_m_rows=4)
        assert runner.model.model.layers[0].small_m_rows == 4
        loop = DraftLoop(runner, 5, keep_probs=False)
        lp, ks = random_prompts([6, 7, 10], seed=5), [5, 3, 5]
        ids, _ = run_draft_loop(runner, loop, lp, ks)
        assert [row[:k] for row, k in zip(ids.tolist(), ks)] == hf_draft_tokens(draft, lp, ks)
