"""The index rules both device paths apply (the device planner's rule pass, ``device_planner.py``; the planner-free
prefill's in-kernel checks, ``unit_schedule.py``): the fault bits, one request's own rules, and the rows a refused
batch or request gets (arch-neutral SIMT helpers)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .planner_collectives import INT32_MAX
from .planner_scan import FAULT_PAGE_ID, record_fault

# fault bits (cute_attn.device_errors.Fault mirrors them)
FAULT_QO_INDPTR, FAULT_KV_INDPTR, FAULT_LAST_PAGE_LEN, FAULT_CAPACITY = 1, 2, 4, 16

__all__ = ["FAULT_QO_INDPTR", "FAULT_KV_INDPTR", "FAULT_LAST_PAGE_LEN", "FAULT_CAPACITY", "FAULT_PAGE_ID",
           "request_rule_faults", "empty_rows"]


@cute.jit
def request_rule_faults(error_word, last, request, pages, page_size: cutlass.Constexpr,
                        kv_tile: cutlass.Constexpr) -> Int32:
    """A request's own rules: its ``kv_last_page_len`` (``last``) in ``1..page_size`` (0..page_size without pages),
    its keys within int32. Returns the fault bits; each is recorded in ``error_word`` when one is given."""
    lowest = Int32(1) if pages > 0 else Int32(0)
    faults = Int32(0)
    if last < lowest or last > page_size:
        faults = faults | FAULT_LAST_PAGE_LEN
        if cutlass.const_expr(error_word is not None):
            record_fault(error_word, FAULT_LAST_PAGE_LEN, request)
    if Int64(pages) * page_size > Int64(INT32_MAX - 2 * kv_tile):
        faults = faults | FAULT_KV_INDPTR
        if cutlass.const_expr(error_word is not None):
            record_fault(error_word, FAULT_KV_INDPTR, request)
    return faults


@cute.jit
def empty_rows(output: cute.Tensor, lse: cute.Tensor, tidx, num_threads: cutlass.Constexpr,
               head_dim: cutlass.Constexpr, first_row, row_end, step):
    """(token, head) rows ``first_row + tidx``, then every ``step * num_threads``-th, below ``row_end * heads``
    (``first_row`` counts (token, head) pairs, ``row_end`` tokens): output 0, lse -inf."""
    heads = output.shape[1]
    for r in range(first_row + tidx, row_end * heads, step * num_threads):
        lse[r // heads, r % heads] = -cutlass.Float32.inf
        for d in range(head_dim):
            output[r // heads, r % heads, d] = cutlass.BFloat16(0.0)
