"""Online softmax on Hopper wgmma accumulators (device helpers, traced inside a kernel).

Shared by the sm_90a GQA prefill and decode kernels. Conventions (see docs/kernel-contract.md):

* Scores ``S`` arrive raw (``q . k``, fp32, masked entries ``-inf``). The exponent works in base 2
  with ``scale_log2 = sm_scale * log2(e)``: ``p = exp2(S * scale_log2 - m * scale_log2)`` where ``m``
  is the running row max of the raw scores (one FFMA per element).
* A row whose running max is still ``-inf`` (it has seen no key) uses 0 as the max in the exponent,
  so its ``p`` are exact zeros, never NaN; ``finalize`` then gives O scale 0 and lse ``-inf``.
* The row sum is kept per thread (each row is spread over the 4 threads of a quad) and reduced
  across the quad only in ``finalize``; the row max is reduced at every step.

Accumulator views: a wgmma C fragment has layout ``((2, 2, N/8), MMA_M, MMA_N)`` (values: column
pair, row +8, column group of 8). :func:`acc_mn_view` regroups it as ``(rows, cols)`` =
``((2, MMA_M), (2, N/8, MMA_N))`` so a thread loops over its rows; :func:`acc_to_mma_a_view`
regroups it as the register A operand of the next wgmma (``((2, 2, 2), MMA_M, (N/16, MMA_N))``).

Use: ``row_max, row_sum = make_softmax_state(rows)``; per item ``softmax_reset``; per key tile
``scale = softmax_update(acc_s, ...)`` then ``rescale_rows(acc_o, scale)``; at the end
``o_scale, lse = softmax_finalize(...)`` and ``rescale_rows(acc_o, o_scale)``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """``acc`` ((2, 2, V), MMA_M, MMA_N) viewed as (rows, cols) = ((2, MMA_M), (2, V, MMA_N)); an 8-column MMA's
    ((2, 2), MMA_M, MMA_N) (no V mode) as ((2, MMA_M), (2, MMA_N))."""
    flat = cute.make_layout(acc.layout.shape)  # column-major over the same shape
    if len(flat.shape[0]) == 2:
        shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[2]))
        stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[2]))
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))
    shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
    stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def acc_to_mma_a_view(acc: cute.Tensor) -> cute.Tensor:
    """``acc`` ((2, 2, N/8), MMA_M, MMA_N) viewed as a 16-bit wgmma A fragment ((2, 2, 2), MMA_M, (N/16, MMA_N))."""
    lay = acc.layout
    assert lay.shape[0][2] % 2 == 0, "the accumulator needs an even number of 8-column groups"
    div = cute.logical_divide(lay, ((None, None, 2), None, None))
    shape = ((div.shape[0][0], div.shape[0][1], div.shape[0][2][0]), div.shape[1], (div.shape[0][2][1], div.shape[2]))
    stride = ((div.stride[0][0], div.stride[0][1], div.stride[0][2][0]), div.stride[1],
              (div.stride[0][2][1], div.stride[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


@dsl_user_op
def _cvt_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Two fp32 -> one packed bf16x2 word (``lo`` in the low half), as an opaque inline-asm value."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def store_p_bf16(acc_s: cute.Tensor, t_op: cute.Tensor):
    """``t_op = bf16(acc_s)`` (``t_op``: the register A operand, e.g. from ``acc_to_mma_a_view`` shapes).

    The same values as ``t_op.store(acc_to_mma_a_view(acc_s).load().to(bf16))``, but each pair goes through
    an inline-asm ``cvt``: LLVM cannot then fold the conversions of a loop-carried P into one conversion
    after the loop's phi, which would keep the fp32 scores live into the next iteration (64 extra registers
    while an overlapped QK GEMM is in flight; ptxas then serialises the wgmma).
    """
    src = acc_to_mma_a_view(acc_s)
    dst = cute.recast_tensor(t_op, Int32)
    for i in cutlass.range_constexpr(cute.size(dst)):
        dst[i] = _cvt_bf16x2(src[2 * i], src[2 * i + 1])


def make_softmax_state(num_rows: int) -> tuple[cute.Tensor, cute.Tensor]:
    """``(row_max, row_sum)`` register tensors for ``num_rows`` accumulator rows (reset per work item).

    Plain tensors rather than an object: a Python object carried through a dynamic loop is refused by
    the DSL, register tensors are not.
    """
    return cute.make_rmem_tensor(num_rows, Float32), cute.make_rmem_tensor(num_rows, Float32)


def softmax_reset(row_max: cute.Tensor, row_sum: cute.Tensor) -> None:
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)


def softmax_update(acc_s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
                   quad: int = 4) -> cute.Tensor:
    """Exponentiate ``acc_s`` (a wgmma C fragment of raw scores) in place; return the per-row factor for O."""
    return _online_update(acc_mn_view(acc_s), row_max, row_sum, scale_log2, quad)


def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor) -> None:
    """``acc[row, :] *= row_scale[row]`` for a wgmma C fragment."""
    _rescale_rows(acc_mn_view(acc), row_scale)


def softmax_finalize(row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
                     lse_scale: Float32 | float = 1.0, quad: int = 4) -> tuple[cute.Tensor, cute.Tensor]:
    """``(o_scale, lse)`` per row: ``o_scale = 1/sum`` (0 for a row that saw no key) and
    ``lse = (max * scale_log2 + log2(sum)) * lse_scale`` (base 2 for ``lse_scale = 1``; ``-inf`` for such a row)."""
    n = cute.size(row_max)
    o_scale = cute.make_rmem_tensor(n, Float32)
    lse = cute.make_rmem_tensor(n, Float32)
    _finalize(row_max, row_sum, o_scale, lse, scale_log2, Float32(lse_scale), quad)
    return o_scale, lse


@cute.jit
def _row_max(row: cute.Tensor, n: cutlass.Constexpr[int], init: Float32) -> Float32:
    m = [init, row[0], row[1], row[2]]
    for i in cutlass.range_constexpr(3, n, 4):
        for j in cutlass.range_constexpr(4):
            if cutlass.const_expr(i + j < n):
                m[j] = cute.arch.fmax(m[j], row[i + j])
    return cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))


@cute.jit
def _online_update(acc_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
                   quad: cutlass.Constexpr[int]) -> cute.Tensor:
    row_scale = cute.make_rmem_tensor(cute.size(row_max), Float32)
    ncol = cute.size(acc_mn, mode=[1])
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = acc_mn[r, None]
        prev = row_max[r]
        cur = _row_max(row, ncol, prev)
        cur = cute.arch.warp_reduction_max(cur, threads_in_group=quad)
        row_max[r] = cur
        row_scale[r], row_sum[r] = exp_row_against_max(row, ncol, prev, cur, row_sum[r], scale_log2)
    return row_scale


@cute.jit
def exp_row_against_max(row: cute.Tensor, ncol: cutlass.Constexpr[int], prev, cur, old_sum, scale_log2: Float32):
    """One row's online-softmax step once its new running max ``cur`` is known (``prev``: the old one): the row's
    logits become ``exp2((s - cur) * scale_log2)`` in place; returns (the factor that rescales the old sum and O,
    the new row sum)."""
    safe = Float32(0.0) if cur == -Float32.inf else cur
    safe_scaled = safe * scale_log2
    # prev == -inf: exp2(-inf) = 0 and the (zero) old sum and O vanish; never inf - inf
    prev_safe = safe if prev == -Float32.inf else prev
    scale = cute.math.exp2(prev_safe * scale_log2 - safe_scaled, fastmath=True)
    scale = Float32(0.0) if prev == -Float32.inf else scale
    total = old_sum * scale
    for c in cutlass.range_constexpr(ncol):
        p = cute.math.exp2(row[c] * scale_log2 - safe_scaled, fastmath=True)
        row[c] = p
        total += p
    return scale, total


@cute.jit
def _rescale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * row_scale[r]


@cute.jit
def _finalize(row_max: cute.Tensor, row_sum: cute.Tensor, o_scale: cute.Tensor, lse: cute.Tensor,
              scale_log2: Float32, lse_scale: Float32, quad: cutlass.Constexpr[int]):
    for r in cutlass.range_constexpr(cute.size(row_max)):
        s = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=quad)
        empty = s == Float32(0.0) or s != s
        inv = cute.arch.rcp_approx(Float32(1.0) if empty else s)
        o_scale[r] = Float32(0.0) if empty else inv
        l2 = row_max[r] * scale_log2 + cute.math.log2(Float32(1.0) if empty else s, fastmath=True)
        lse[r] = -Float32.inf if empty else l2 * lse_scale
