"""fp32 -> 16-bit conversion of register fragments, two values per instruction.

``TensorSSA.to(BFloat16)`` only becomes ``cvt.rn.bf16x2.f32`` when LLVM manages to pair the
elements; for S tiles whose width is not a multiple of 32 (tile_n = 80, 96, 144) half of them come
out as scalar ``cvt.rn.bf16.f32`` (measured in the d=256 PTX: 40 scalar for 64 paired). The P
conversion sits on the critical path between the softmax and the P V wgmma, so pair explicitly.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one 32-bit register holding (lo, hi) as bf16x2 / f16x2 (round to nearest)."""
    kind = "bf16x2" if bf16 else "f16x2"
    # cvt.*x2 packs its first source into the upper half.
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor) -> None:
    """dst (16-bit, same size and register order as src) = src (fp32), two elements at a time."""
    bf16 = cutlass.const_expr(dst.element_type is cutlass.BFloat16)
    dst32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = cvt_pair(src[2 * i], src[2 * i + 1], bf16)


# --- FP8 P straight from the exponent arithmetic (``exp_bytes``) ---------------------------------
# 1.5 * 2^23: in [2^23, 2^24) an fp32's ulp is 1, so MAGIC + t (t integer, |t| < 2^22) holds t in
# its low mantissa bits -- for 0 <= t < 256, exactly the low byte (the next byte is zero).
E4M3_MAGIC = 12582912.0
# The code of 2^x is round(8 x) + 56 (e4m3's exponent bias 7, 8 codes per binade).
E4M3_CODE_BIAS = 56.0


def exp_byte_addend(p_log2_offset: float) -> float:
    """The FFMA addend of ``e4m3_exp_byte`` before the row's reference (8 x it) is subtracted."""
    return E4M3_MAGIC + E4M3_CODE_BIAS + 8.0 * p_log2_offset


def _asm_f32(args, body: str, constraints: str, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip) for a in args], body, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def e4m3_exp_byte(s: Float32, scale8: Float32, bias: Float32, *, loc=None, ip=None) -> Float32:
    """fp32 whose low byte is the e4m3 code round(s * scale8 + bias - MAGIC), clamped at 0:
    with scale8 = 8 log2(e) * scale and bias = MAGIC + 56 + 8 (offset - ref), the byte of
    2^(x + offset) by the e4m3 code's own layout (8 codes per binade: exponent in the high bits,
    the rounded eighth in the low three), so P needs neither the MUFU nor a conversion. Masked
    scores (-inf) clamp to MAGIC: byte 0, +0."""
    return _asm_f32([s, scale8, bias],
                    "{\n.reg .f32 t;\nfma.rn.f32 t, $1, $2, $3;\nmax.f32 $0, t, 0f4B400000;\n}",
                    "=f,f,f,f", loc=loc, ip=ip)


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    return _asm_f32([x], "cvt.rpi.f32.f32 $0, $1;", "=f,f", loc=loc, ip=ip)


@dsl_user_op
def pack_low_bytes(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """The low bytes of four 32-bit registers as one word (a in byte 0): three byte permutes."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{\n.reg .b32 lo, hi;\nprmt.b32 lo, $1, $2, 0x0040;\nprmt.b32 hi, $3, $4, 0x0040;\n"
        "prmt.b32 $0, lo, hi, 0x5410;\n}",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
