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
