"""fp32 -> 16-bit conversion of register fragments, two values per instruction.

``TensorSSA.to(BFloat16)`` only becomes ``cvt.rn.bf16x2.f32`` when LLVM manages to pair the
elements; for S tiles whose width is not a multiple of 32 (tile_n = 80, 96, 144) half of them come
out as scalar ``cvt.rn.bf16.f32`` (the d=256 PTX has 40 scalar for 64 paired). The P
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
# The e4m3 code of 2^x is round(8 x) + 56 (exponent bias 7, 8 codes per binade). The softmax's
# FFMA computes that code times 2^-24: converted to f16 it is a subnormal, whose ulp is 2^-24, so
# the f32 -> f16x2 conversion rounds it to the integer code, and its .relu clamps everything below
# code 0 (P under 2^-7 of its scaled range, masked -inf) to +0. The code is then the low byte of
# its f16 half: one FFMA per score, one conversion per two, one byte permute per four.
E4M3_CODE_BIAS = 56.0
CODE_UNIT = 2.0 ** -24


def exp_code_offset(p_log2_offset: float) -> float:
    """The code of P = 2^offset (the row's reference): the FFMA's addend is (this - 8 ref) * 2^-24."""
    return E4M3_CODE_BIAS + 8.0 * p_log2_offset


def _asm_f32(args, body: str, constraints: str, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip) for a in args], body, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def fma_f32(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c, rounded once."""
    return _asm_f32([a, b, c], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", loc=loc, ip=ip)


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    return _asm_f32([x], "cvt.rpi.f32.f32 $0, $1;", "=f,f", loc=loc, ip=ip)


@dsl_user_op
def pack_codes(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four scaled codes (``code * 2^-24``) as one word of e4m3 bytes, a in byte 0."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "{\n.reg .b32 lo, hi;\ncvt.rn.relu.f16x2.f32 lo, $2, $1;\ncvt.rn.relu.f16x2.f32 hi, $4, $3;\n"
        "prmt.b32 $0, lo, hi, 0x6420;\n}",
        "=r,f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


# --- e4m3 -> 16 bit by bit placement ----------------------------------------------------------
# An e4m3 byte's sign, exponent and mantissa moved into a bf16 (f16) field read as that type are
# the code's value times 2^-120 (2^-8), subnormal codes included (they land on the 16-bit type's
# subnormals); one exact multiply restores it. Integer ops and one packed multiply per two codes,
# instead of the e4m3 -> f16 -> f32 -> bf16 conversion chain. The NaN codes come out finite (480):
# cache slots no sequence owns are masked (K) and zeroed (V) anyway.
_E4M3_PLACE = {  # 16-bit type: (shift of the code's magnitude from bit 8, its mask, 2^bias gap)
    True: (4, 0x07F007F0, 0x7B807B80, "bf16x2"),
    False: (1, 0x3F803F80, 0x5C005C00, "f16x2"),
}


@dsl_user_op
def e4m3x2_to_16bit(word: Int32, upper: bool, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Bytes 0, 1 (``upper``: 2, 3) of ``word`` (e4m3 codes) as one bf16x2 / f16x2 word, byte 0
    (2) in the low half."""
    shift, mask, scale, kind = _E4M3_PLACE[bf16]
    select = "0x3424" if upper else "0x1404"  # each code into the high byte of its half
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 z, t, u, s;\nmov.b32 z, 0;\n"
        f"prmt.b32 t, $1, z, {select};\nshr.b32 u, t, {shift};\nand.b32 t, t, 0x80008000;\n"
        f"and.b32 u, u, {mask:#x};\nor.b32 t, t, u;\nmov.b32 s, {scale:#x};\nmul.rn.{kind} $0, t, s;\n}}",
        "=r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))
