"""The packed GQA Q box of the prefill kernels (both arches): whole tokens, as many as the M tile holds.

Packed row ``r`` of an item is token ``r // group``, head ``kv_head * group + r % group``; one TMA box over q viewed
as ``((group, total_q), head_dim, kv_heads)`` loads ``tile_m // group`` whole tokens, i.e. the tile's first
``q_rows = (tile_m // group) * group`` rows. When the group divides the tile (1, 2, 4, 8, 16) that is the whole
tile and these helpers return their argument unchanged; otherwise (3, 5, 6, 7, ...) the box fills the first
``q_rows`` rows of each Q stage and the rest stay stale: computed, never stored (the planner packs ``q_rows`` rows
per tile, ``PagedAttentionConfig.packed_rows_per_tile``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def q_box_stage_layout(s_q_layout, q_rows: int, tile_m: int, head_dim: int):
    """One Q stage's smem layout, restricted to the rows the box fills (the TMA atom's smem side)."""
    stage = cute.select(s_q_layout, mode=[0, 1])
    if cutlass.const_expr(q_rows == tile_m):
        return stage
    return cute.composition(stage, cute.make_layout((q_rows, head_dim), stride=(1, tile_m)))


def q_box_rows(s_q: cute.Tensor, q_rows: int, tile_m: int, head_dim: int, stages: int) -> cute.Tensor:
    """The Q stages ``(tile_m, head_dim, stages)`` restricted to their first ``q_rows`` rows (the box's destination)."""
    if cutlass.const_expr(q_rows == tile_m):
        return s_q
    return cute.composition(s_q, cute.make_layout((q_rows, head_dim, stages), stride=(1, tile_m, tile_m * head_dim)))
