"""float8_e4m3fn weight bytes to bfloat16 inside a kernel, exactly, on the integer and bf16 pipes (Triton, CUDA).

The FP8 products (engine/quantization/fp8_linear.py, engine/kernels/small_m/linear.py) read each weight as one byte
and feed tl.dot in the activations' dtype. Triton's own conversion goes float8 -> float16 -> bfloat16, two converts a
weight, and Hopper converts types at 16 a clock per SM (against 128 for float32 arithmetic): 2.5 TB/s of FP8 weights
at most on an H100, below its memory's 3. Here each byte becomes a bfloat16 half with bit operations and one bf16x2
multiply by a power of two, two instructions a weight. The GPU test (tests/gpu/test_fp8_linear_cuda.py) checks every
non-NaN byte bit for bit against torch's conversion; NaN bytes (0x7F, 0xFF) come out finite (no FP8 checkpoint holds
them).
"""

from __future__ import annotations

from engine.kernels.triton_compat import tl, triton

__all__ = ["e4m3_to_bf16"]


@triton.jit
def e4m3_to_bf16(byte):
    """uint8 bytes -> bfloat16 values of the same shape. Four bytes ($2) make two registers of two halves:
    - prmt sign-extends each byte to 16 bits (selector nibbles 8 + i replicate byte i's top bit);
    - shifted left 4, a half holds the sign at bit 15 (from the extension), the 4 exponent bits at 10..7 (bfloat16's
      low exponent bits) and the 3 mantissa bits at 6..4; the mask drops the rest (the sign's copies at 11..14, and
      the low half's bits that crossed into the high half's 0..3);
    - that half is the value times 2 ** -120 (bfloat16's exponent bias less e4m3's), its subnormals bfloat16's
      subnormals of the same value, so one multiply by 2 ** 120 makes it exact."""
    return tl.inline_asm_elementwise("""
        {
        .reg .b32 a, b, c;
        mov.b32 c, 0x7B807B80;
        prmt.b32 a, $2, 0, 0x9180;
        prmt.b32 b, $2, 0, 0xB3A2;
        shl.b32 a, a, 4;
        shl.b32 b, b, 4;
        and.b32 a, a, 0x87F087F0;
        and.b32 b, b, 0x87F087F0;
        mul.rn.bf16x2 $0, a, c;
        mul.rn.bf16x2 $1, b, c;
        }
        """, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True, pack=4)
