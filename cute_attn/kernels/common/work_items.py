"""A CTA's work-item fields in registers, with its first item read before its range is known.

A persistent CTA learns where its items start from ``work_indptr[cta]``, a global load whose latency
comes before everything else it does. The planner lays items out CTA-major, so whenever every CTA
before ``c`` has exactly one item (split-KV decode plans of at most ``num_ctas`` items, i.e. the
latency-bound small batches), CTA ``c``'s first item is row ``c``. :func:`guess_first_item` loads row
``c`` alongside ``work_indptr[c]``; :func:`load_item` reuses it when the guess was right and loads the
item's row otherwise, so a wrong guess costs one wasted load and never a wrong field.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def guess_first_item(items: cute.Tensor, cta, fields: cutlass.Constexpr, row: cute.Tensor):
    """Load ``fields`` of row ``min(cta, capacity - 1)`` into ``row`` (Int32 rmem); return that row index."""
    guess = cutlass.min(cta, items.shape[0] - 1)
    for i in cutlass.range_constexpr(len(fields)):
        row[i] = items[guess, fields[i]]
    return guess


@cute.jit
def load_item(items: cute.Tensor, it, item_begin, guess, fields: cutlass.Constexpr, row: cute.Tensor):
    """``row[i] = items[it, fields[i]]``, skipped for the CTA's first item when the guess holds it."""
    if Int32(it - item_begin) | Int32(item_begin - guess) != 0:
        for i in cutlass.range_constexpr(len(fields)):
            row[i] = items[it, fields[i]]
