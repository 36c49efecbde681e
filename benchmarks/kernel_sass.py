"""Instructions a weight in a kernel's K loop, compiled for an H100 (sm_90) on any machine: no GPU is needed, only
Triton's compiler and its bundled ptxas and nvdisasm. The loop is the compiled kernel's largest basic block; the
count is its SASS instructions over the weights a thread handles in one trip. Used to find where the MXFP4 experts'
kernels and the FP8 product spend issue slots (benchmarks/RESULTS.md, 2026-12-07).

    python benchmarks/kernel_sass.py moe_gate_up --tiles 16,256,4
    python benchmarks/kernel_sass.py fp8 --tiles 32,128,4 --ptx 0
    python benchmarks/kernel_sass.py small_m_fp8 --tiles 32,128,4

Integer arguments that a launch sees divisible by 16 (strides, sizes) are declared so, as Triton's launcher
specializes them: without it the loads would not vectorize here while they do on the GPU."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.moe import grouped as moe_grouped
from engine.kernels.moe import small_m as moe_small_m
from engine.kernels.small_m import linear as small_m_linear
from engine.quantization import fp8_linear


def _kernels(block_n: int, block_k: int, ptx: bool, stages: int = 1) -> dict[str, tuple]:
    """name -> (kernel, {arg: type}, divisible-by-16 args, constexprs, weights a program handles a trip)."""
    moe_args = ("top_k hidden inter rows k_slice stride_xt stride_we stride_wr blocks_e blocks_r scales_e scales_r"
                .split())
    gate_up = dict(zip("x_ptr ids_ptr w_ptr blocks_ptr scales_ptr part_ptr".split(),
                       ["*bf16", "*i32", "*u8", "*u8", "*u8", "*fp32"]), **dict.fromkeys(moe_args, "i32"))
    grouped = dict(zip("x_ptr slot_rows_ptr block_expert_ptr w_ptr blocks_ptr scales_ptr bias_ptr act_ptr".split(),
                       ["*bf16", "*i32", "*i32", "*u8", "*u8", "*u8", "*bf16", "*bf16"]),
                   top_k="i32", hidden="i32", inter="i32", alpha="fp32", limit="fp32",
                   **dict.fromkeys("stride_xt stride_we stride_wr blocks_e blocks_r scales_e scales_r stride_be"
                                   .split(), "i32"))
    ptrs = "x res res_out nw w s b add out part count ss_in ss_out".split()
    small_m = dict(zip([f"{p}_ptr" for p in ptrs], ["*bf16"] * 4 + ["*u8", "*fp32", "*bf16", "*bf16", "*bf16", "*fp32",
                                                                   "*i32", "*fp32", "*fp32"]),
                   **dict.fromkeys("M N K K_SPLIT NUM_SPLITS SS_TILES stride_x stride_r stride_ro stride_w stride_s "
                                   "stride_a stride_o".split(), "i32"), eps="fp32", offset="fp32")
    fp8 = dict(zip("x_ptr w_ptr s_ptr b_ptr out_ptr part_ptr count_ptr".split(),
                   ["*bf16", "*u8", "*fp32", "*fp32", "*bf16", "*fp32", "*i32"]),
               **dict.fromkeys("M N K G group_k k_slice num_splits stride_xm stride_wn stride_sn stride_om".split(),
                               "i32"))
    return {
        "moe_gate_up": (moe_small_m._gate_up_kernel, gate_up,
                        {"hidden", "inter", "k_slice", "stride_xt", "blocks_e", "blocks_r", "scales_e"},
                        dict(PACKED=True, OAI=True, BLOCK_N=block_n, BLOCK_K=block_k, PTX=ptx, STAGES=stages,
                             USE_PDL=False),
                        2 * block_n * block_k),
        "moe_grouped_gate_up": (moe_grouped._gate_up_act_kernel, grouped,
                                {"hidden", "inter", "stride_xt", "blocks_e", "blocks_r", "scales_e", "stride_be"},
                                dict(PACKED=True, HAS_BIAS=True, OAI=True, GROUP_M=16, BLOCK_N=block_n,
                                     BLOCK_K=block_k, PTX=ptx, DTYPE=tl.bfloat16, PRECISION="tf32", USE_PDL=False),
                                2 * block_n * block_k),
        "small_m_fp8": (small_m_linear._small_m_linear_kernel, small_m,
                        {"N", "K", "K_SPLIT", "stride_x", "stride_w", "stride_a", "stride_o"},
                        dict(W_SCALE=2, GROUP_K=128, W_PTX=ptx, PROLOGUE=0, HAS_RES=False, HAS_OFFSET=False,
                             GELU_TANH=False, HAS_BIAS=False, HAS_ADD=True, USE_DOT=True, DOT_IEEE=False,
                             ROW_LOOP=False, USE_PDL=True, SPLIT=True, GLU=False, SS_IN=False, SS_OUT=False,
                             SS_BLOCK=1, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STATS_K=block_k),
                        block_n * block_k),
        "fp8": (fp8_linear._fp8_linear_kernel, fp8,
                {"N", "K", "k_slice", "stride_xm", "stride_wn", "stride_om", "group_k"},
                dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32", SPLIT=True,
                     W_PTX=ptx), block_n * block_k),
    }


def loop_stats(name: str, block_n: int, block_k: int, warps: int, ptx: bool, stages: int = 1) -> dict:
    """The K loop's SASS instruction count, per weight of a thread, and its ten commonest opcodes."""
    fn, sig, div16, consts, weights = _kernels(block_n, block_k, ptx, stages)[name]
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {(index[a],): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr") or a in div16}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                    constexprs={(index[k],): v for k, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    loop = max(re.split(r"\n\.L_x_\d+:", sass), key=lambda b: b.count(";"))
    ops = [line.split("*/")[1].split() for line in loop.split("\n") if line.strip().startswith("/*") and ";" in line]
    opcodes = collections.Counter((o[1] if o[0].startswith("@") else o[0]).split(".")[0] for o in ops)
    per_thread = weights / (32 * warps)
    return {"kernel": name, "instructions": len(ops), "per_weight": round(len(ops) / per_thread, 2),
            "top": dict(opcodes.most_common(10))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=sorted(_kernels(16, 256, True)))
    ap.add_argument("--tiles", default="16,256,4", help="BLOCK_N,BLOCK_K,num_warps")
    ap.add_argument("--ptx", type=int, default=1, help="the kernel's PTX decode or conversion (1) or Triton's (0)")
    ap.add_argument("--stages", type=int, default=1, help="the MoE few-row kernel's K-walk pipeline stages")
    args = ap.parse_args()
    n, k, w = (int(v) for v in args.tiles.split(","))
    print(loop_stats(args.kernel, n, k, w, bool(args.ptx), args.stages))


if __name__ == "__main__":
    main()
