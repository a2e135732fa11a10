"""Pool garbage in a key tile's V rows: which rows can hold it, and zeroing them (device helpers, both arches).

P V multiplies every V row of a stage, and a masked score's P of 0 times NaN is NaN, so every V row the GEMM
reads must be finite. A paged stage's rows come from three places:

* pages wholly past the item's ``KV_END``: never read (TMA zero-fills the out-of-bounds box of id -1, a row gather
  zero-fills id -1 by ``cp.async`` src-size 0): zeros;
* rows of ``[KV_END, kv_len)`` in a page that is read: keys of the same request, finite (the mask hides them);
* rows at or past the request's ``kv_len`` inside its last page: whatever the pool holds there (the tests poison
  it with NaN).

So only ``[kv_len, round_up(KV_END, page_size))`` of the tile can hold garbage, and it is empty unless ``KV_END``
falls in the request's last page (a causal item ending mid-request reads none of it). Zeroing every row past
``KV_END`` instead, one bf16 element a thread a step, was 30% of the instructions the sm_90a prefill kernel
executed at 4 x 992 h32/kv4 (ncu, session 22): most causal items end mid-tile but not in the last page.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

CHUNK = 8  # bf16 elements in one 16-byte shared-memory store


@cute.jit
def garbage_rows(kv_base: Int32, kv_end: Int32, kv_len: Int32, tile_n: cutlass.Constexpr[int],
                 page_size: cutlass.Constexpr[int]):
    """``(first, end)``: the tile rows (the tile starts at key ``kv_base``) that may hold pool garbage when an item
    ends at ``kv_end`` in a request of ``kv_len`` keys; none when ``end <= first``. Pages of one key have no
    tail: ``end`` is then ``kv_end - kv_base <= first``. Always inside the tile (``0 <= first``, ``end <= tile_n``),
    whatever ``kv_len`` a hostile ``qo_indptr`` makes: the zeroing never writes outside its stage."""
    loaded_end = cutlass.min((kv_end + page_size - 1) // page_size * page_size, kv_base + tile_n)
    return cutlass.max(kv_len - kv_base, 0), loaded_end - kv_base


@cute.jit
def zero_rows(s_rows: cute.Tensor, first: Int32, end: Int32, tid: Int32, num_threads: cutlass.Constexpr[int],
              head_dim: cutlass.Constexpr[int]):
    """Zero rows ``[first, end)`` of one stage ``s_rows`` (``(rows, head_dim)``, swizzled or not: the swizzle
    keeps each 16-byte vector whole) with 16-byte stores from ``num_threads`` threads. The caller fences them into
    the async proxy and syncs its MMA threads before the GEMM reads them."""
    chunks = head_dim // CHUNK
    vectors = cute.flat_divide(s_rows, (1, CHUNK))  # (1, CHUNK, row, chunk)
    zero = cute.make_rmem_tensor((CHUNK,), s_rows.element_type)
    zero.fill(0.0)
    for e in cutlass.range(tid, (end - first) * chunks, num_threads, unroll=1):
        vectors[0, None, first + e // chunks, e % chunks].store(zero.load())
