"""Row gathers into swizzled shared-memory tiles with 16-byte ``cp.async`` (device helpers, both arches).

For row sources TMA cannot describe: page-size-1 KV pools whose rows are picked one by one through
``kv_indices`` (a TMA box would need one descriptor coordinate per row), and query tiles whose last rows
must read as zeros. Every thread of the loading group copies 16-byte chunks (``.cg``: L2 only, the rows
are read once per CTA); rows that do not exist are zero-filled with plain 16-byte shared stores, so a
tile never holds stale or NaN data for the MMAs to multiply.

The tile is addressed as ``s_chunks = cute.flat_divide(s_tile, (1, ROW_CHUNK))``: ``(1, vec, row, chunk)``,
so the swizzle of the tile's layout applies to every chunk store. Copies go through the generic proxy:
:func:`commit_rows` waits for them and fences them into the async proxy (wgmma / tcgen05 operands)
before the pipeline arrival.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

ROW_CHUNK = 8  # bf16 / fp16 elements per 16-byte cp.async


def make_row_copy_atom(dtype) -> cute.CopyAtom:
    """The 16-byte ``cp.async.cg`` global -> shared copy of one row chunk."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=16 * ROW_CHUNK)


def row_passes(num_rows: int, chunks: int, num_threads: int) -> tuple[int, int, bool]:
    """``(rows_per_pass, passes, guarded)`` for ``num_threads`` threads copying ``num_rows`` rows of ``chunks``
    16-byte chunks, one chunk column each: every row is covered once; ``guarded`` when the last pass overshoots
    the tile (fewer rows than a pass holds, e.g. the 64-column pe part of an 8-row query tile), so its threads past
    the last row copy nothing."""
    if chunks > num_threads or num_threads % chunks:
        raise ValueError(f"{num_threads} threads cannot share rows of {chunks} chunks (a multiple is needed)")
    rows_per_pass = num_threads // chunks
    passes = -(-num_rows // rows_per_pass)
    return rows_per_pass, passes, passes * rows_per_pass != num_rows


@cute.jit
def gather_rows(copy_atom: cute.CopyAtom, zeros: cute.Tensor, src: cute.Tensor, row_stride: Int64,
                s_chunks: cute.Tensor, chunk0: cutlass.Constexpr[int], width: cutlass.Constexpr[int], tid: Int32,
                num_threads: cutlass.Constexpr[int], row0: Int64 | None = None, valid_rows: Int32 | None = None,
                ids: cute.Tensor | None = None):
    """Copy ``width`` columns of every tile row into the tile's 16-byte chunk columns ``chunk0 ..``.

    ``s_chunks``: ``(1, vec, row, chunk)`` view of the tile; ``zeros``: ``ROW_CHUNK`` zeros in registers.
    Either consecutive rows, ``row0`` and ``valid_rows``: tile row ``r`` is source row ``row0 + r`` and rows
    ``>= valid_rows`` are zero-filled; or rows by id, ``ids`` (a shared-memory table, one entry per tile
    row): tile row ``r`` is source row ``ids[r]``, and id -1 marks a row to zero-fill. ``num_threads``
    threads (``tid`` below it) share the work, each copying one chunk column of ``num_threads / chunks``
    rows per pass.
    """
    chunks = width // ROW_CHUNK
    num_rows = cute.size(s_chunks, mode=[2])
    rows_per_pass, passes, guarded = row_passes(num_rows, chunks, num_threads)
    chunk = tid % chunks
    for i in cutlass.range(passes, unroll=2):
        r = i * rows_per_pass + tid // chunks
        if cutlass.const_expr(guarded):
            if r < num_rows:
                _copy_row(copy_atom, zeros, src, row_stride, s_chunks, chunk0, chunk, r, row0, valid_rows, ids)
        else:
            _copy_row(copy_atom, zeros, src, row_stride, s_chunks, chunk0, chunk, r, row0, valid_rows, ids)


@cute.jit
def _copy_row(copy_atom: cute.CopyAtom, zeros: cute.Tensor, src: cute.Tensor, row_stride: Int64, s_chunks: cute.Tensor,
              chunk0: cutlass.Constexpr[int], chunk: Int32, r: Int32, row0, valid_rows, ids):
    """One chunk of tile row ``r`` (:func:`gather_rows`' rules for its source row and zero fill)."""
    dst = s_chunks[0, None, r, chunk0 + chunk]
    if cutlass.const_expr(ids is None):
        src_row = row0 + r
        ok = r < valid_rows
    else:
        rid = ids[r]
        src_row = Int64(rid)
        ok = rid >= 0
    if ok:
        offset = src_row * row_stride + chunk * ROW_CHUNK
        ptr = cute.make_ptr(src.element_type, (src.iterator + offset).toint(), cute.AddressSpace.gmem,
                            assumed_align=16)
        cute.copy(copy_atom, cute.make_tensor(ptr, cute.make_layout(ROW_CHUNK)), dst)
    else:
        cute.autovec_copy(zeros, dst)


@cute.jit
def commit_rows(pipe, state):
    """This thread's copies have landed: make them visible to the async proxy (the MMAs), then arrive."""
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    cute.arch.fence_view_async_shared()
    pipe.producer_commit(state)


def swizzle_128b(smem_addr: Int32) -> Int32:
    """The 128-byte swizzle of a shared-memory byte address (Swizzle<3,4,3>: the 16-byte chunk bits 4-6 XOR the row
    bits 7-9), as the DSL applies it to the swizzled stage tensors' loads and stores; ``iterator.toint()`` gives the
    address before it. Raw PTX into a swizzled tile (1024-byte aligned) must apply it itself."""
    return smem_addr ^ ((smem_addr >> 3) & 0x70)


@cute.jit
def cp_async_chunk(dst_smem: Int32, src_global: Int64, src_bytes: Int32):
    """One 16-byte ``cp.async.cg`` (L2 only) into shared memory; ``src_bytes`` 0 zero-fills the chunk without
    reading global memory, so a row outside the pool costs no branch and is never read."""
    cute.arch.inline_ptx(
        "{ .reg .u64 g; cvta.to.global.u64 g, {$r1}; cp.async.cg.shared.global [{$r0}], [g], 16, {$r2}; }",
        read_only_args=[dst_smem, src_global, src_bytes],
    )


SEGMENT_CHUNKS = 8  # 16-byte chunks in one 128-byte segment: a swizzle atom's row, a full L2 line


def segment_step_bytes(s_chunks: cute.Tensor) -> int:
    """Shared-memory bytes between a row's chunk ``c`` and chunk ``c + SEGMENT_CHUNKS`` (the next 64-column block of a
    128B-swizzled K-major tile). A multiple of 1024, so it never touches the swizzle's bits 4-9: every segment of a
    row is the first one's swizzled address plus a constant."""
    step = cute.crd2idx((0, 0, 0, SEGMENT_CHUNKS), s_chunks.layout) - cute.crd2idx((0, 0, 0, 0), s_chunks.layout)
    step_bytes = int(step) * s_chunks.element_type.width // 8
    if step_bytes % 1024:
        raise ValueError(f"segment step {step_bytes} B is not whole 1024-byte swizzle atoms")
    return step_bytes


def segments_fit(s_chunks: cute.Tensor, width: int, num_threads: int) -> bool:
    """:func:`gather_row_segments` covers the tile in whole passes (else the caller keeps chunk columns)."""
    rows_per_pass = num_threads // SEGMENT_CHUNKS
    return (width // ROW_CHUNK) % SEGMENT_CHUNKS == 0 and cute.size(s_chunks, mode=[2]) % rows_per_pass == 0


@cute.jit
def gather_row_segments(src: cute.Tensor, row_stride: Int64, s_chunks: cute.Tensor, chunk0: cutlass.Constexpr[int],
                        width: cutlass.Constexpr[int], tid: Int32, num_threads: cutlass.Constexpr[int],
                        ids: cute.Tensor | None = None, row0: Int64 | None = None, valid_rows: Int32 | None = None):
    """:func:`gather_rows_zero_fill`'s copies (the same rows, ids, zero fill by ``src-size`` 0 and completion rules),
    dealt by 128-byte segments: 8 lanes copy one segment of a row, a warp 4 rows, and each thread walks its few rows'
    ``width / 64`` segments at constant offsets. A thread of 128 then resolves 4 row ids and addresses a 64-key tile
    instead of 36 (one chunk column a thread visits every row): the load warps issue ~1/3 of the instructions, which
    is what they compete with the consumer warps for."""
    chunks = width // ROW_CHUNK
    if cutlass.const_expr(chunks % SEGMENT_CHUNKS or num_threads % SEGMENT_CHUNKS):
        raise ValueError(f"gather_row_segments: {width} columns / {num_threads} threads are not whole 128-byte segments")
    segments = chunks // SEGMENT_CHUNKS
    num_rows = cute.size(s_chunks, mode=[2])
    rows_per_pass = num_threads // SEGMENT_CHUNKS
    if cutlass.const_expr(num_rows % rows_per_pass):
        raise ValueError(f"gather_row_segments: {num_rows} rows are not whole passes of {rows_per_pass}")
    step = segment_step_bytes(s_chunks)
    lane = tid % SEGMENT_CHUNKS
    sub = tid // SEGMENT_CHUNKS
    elem = src.element_type.width // 8
    base = src.iterator.toint() + Int64(lane * ROW_CHUNK * elem)
    row_bytes = row_stride * elem
    for p in cutlass.range_constexpr(num_rows // rows_per_pass):
        r = p * rows_per_pass + sub
        nbytes, src_row = _row_source(r, ids, row0, valid_rows)
        src_addr = base + src_row * row_bytes
        dst = swizzle_128b(s_chunks[0, None, r, chunk0 + lane].iterator.toint())
        for s in cutlass.range_constexpr(segments):
            cp_async_chunk(dst + s * step, src_addr + s * SEGMENT_CHUNKS * ROW_CHUNK * elem, nbytes)


@cute.jit
def gather_one_row_pages(rows: cute.Tensor, s_chunks: cute.Tensor, lane_pages: cute.Tensor, head: Int32, lane: Int32,
                         num_rows: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int],
                         rows_b: cute.Tensor | None = None, s_chunks_b: cute.Tensor | None = None,
                         page_rows: cutlass.Constexpr[int] = 1, tile_row0: Int32 | None = None,
                         segments: cutlass.Constexpr[bool] = False):
    """One tile of a small-page pool: ``num_rows`` rows of KV head ``head`` by the 32 lanes of one warp, fully
    unrolled (the one-warp loop with a shared id table and a branch per row was latency-bound: 266 µs at decode
    page 1).

    ``rows``: a cache, ``[pages, page_rows, Hkv, D]``; ``s_chunks``: the tile as ``(1, vec, row, chunk)`` of a
    128B-swizzled stage (:func:`swizzle_128b` places every chunk); ``rows_b`` / ``s_chunks_b``: a second cache
    and tile with the same ids (decode: V beside K), copied in the same pass. ``lane_pages[c]``: the id of the
    tile's page ``32 c + lane`` (``common/page_ids.py``; tile row ``r`` is slot ``r % page_rows`` of page
    ``r // page_rows``), shuffled to the lanes copying that row. Each lane copies one 16-byte chunk column of
    ``32 / chunks`` rows per pass; an id outside ``[0, pages)`` (past the item's keys, or hostile) zero-fills its
    row. The copies complete on the stage's full mbarrier (``cp.async.mbarrier.arrive.noinc``,
    ``PipelineCpAsync``'s producer commit), so the lane never waits for them. ``tile_row0``: the rows are the
    tile's ``tile_row0 ..`` (a warp's slice of a tile that several warps gather; ``lane_pages`` holds the slice's
    ids). ``segments`` (``PagedAttentionConfig.row_segments``): 8 lanes copy one 128-byte segment of a row and each
    lane walks the row's ``head_dim / 64`` segments, so a lane resolves a page id and an address per segment group
    instead of per chunk (head_dim 128: half as many; 64: the same deal as without).
    """
    chunks = head_dim // ROW_CHUNK
    # segments: 8 lanes a 128-byte segment of a row, each lane the row's head_dim / 64 segments at constant offsets
    # (fewer id shuffles and addresses a copy: gather_row_segments' deal); else one chunk column a lane
    lanes_per_row = SEGMENT_CHUNKS if cutlass.const_expr(segments) else chunks
    row_segments = chunks // lanes_per_row
    rows_per_pass, passes, guarded = row_passes(num_rows, lanes_per_row, 32)
    if cutlass.const_expr(guarded or chunks % lanes_per_row):
        raise ValueError(f"gather_one_row_pages: {num_rows} rows are not whole passes of {rows_per_pass}")
    chunk = lane % lanes_per_row
    sub = lane // lanes_per_row
    step = segment_step_bytes(s_chunks) if cutlass.const_expr(row_segments > 1) else 0
    step_b = step
    if cutlass.const_expr(rows_b is not None and row_segments > 1):
        step_b = segment_step_bytes(s_chunks_b)
    seg_bytes = SEGMENT_CHUNKS * ROW_CHUNK * (rows.element_type.width // 8)
    num_pages = rows.shape[0]
    elem = rows.element_type.width // 8
    base = rows.iterator.toint() + Int64(head * rows.stride[2] + chunk * ROW_CHUNK) * elem
    page_bytes = Int64(rows.stride[0]) * elem
    slot_bytes = Int64(rows.stride[1]) * elem
    base_b = base
    page_bytes_b = page_bytes
    slot_bytes_b = slot_bytes
    if cutlass.const_expr(rows_b is not None):
        base_b = rows_b.iterator.toint() + Int64(head * rows_b.stride[2] + chunk * ROW_CHUNK) * elem
        page_bytes_b = Int64(rows_b.stride[0]) * elem
        slot_bytes_b = Int64(rows_b.stride[1]) * elem
    page_shift = page_rows.bit_length() - 1
    for p in cutlass.range_constexpr(passes):
        r0 = p * rows_per_pass
        r = r0 + sub
        if cutlass.const_expr(page_rows == 1):
            pid = cute.arch.shuffle_sync(lane_pages[r0 // 32], r0 % 32 + sub)
        else:
            # a register holds 32 pages = 32 * page_rows rows, a multiple of rows_per_pass: constant per pass
            pid = cute.arch.shuffle_sync(lane_pages[r0 // (32 * page_rows)], (r >> page_shift) & 31)
        nbytes = Int32(0)
        src_page = Int64(0)
        if pid >= 0:
            if pid < num_pages:
                nbytes = Int32(16)
                src_page = Int64(pid)
        src = base + src_page * page_bytes
        src_b = base_b + src_page * page_bytes_b
        if cutlass.const_expr(page_rows > 1):
            slot = Int64(r & (page_rows - 1))
            src = src + slot * slot_bytes
            src_b = src_b + slot * slot_bytes_b
        row = r if cutlass.const_expr(tile_row0 is None) else tile_row0 + r
        if cutlass.const_expr(row_segments == 1):
            cp_async_chunk(swizzle_128b(s_chunks[0, None, row, chunk].iterator.toint()), src, nbytes)
            if cutlass.const_expr(rows_b is not None):
                cp_async_chunk(swizzle_128b(s_chunks_b[0, None, row, chunk].iterator.toint()), src_b, nbytes)
        else:
            dst = swizzle_128b(s_chunks[0, None, row, chunk].iterator.toint())
            dst_b = dst
            if cutlass.const_expr(rows_b is not None):
                dst_b = swizzle_128b(s_chunks_b[0, None, row, chunk].iterator.toint())
            for g in cutlass.range_constexpr(row_segments):
                cp_async_chunk(dst + g * step, src + g * seg_bytes, nbytes)
                if cutlass.const_expr(rows_b is not None):
                    cp_async_chunk(dst_b + g * step_b, src_b + g * seg_bytes, nbytes)


@cute.jit
def _row_source(r: Int32, ids: cute.Tensor | None, row0: Int64 | None, valid_rows: Int32 | None):
    """``(cp.async src-size, source row)`` of tile row ``r``: 16 and ``ids[r]`` (or ``row0 + r``) for a row that
    exists, 0 and row 0 (nothing read; the 16 bytes zero-filled) for an id of -1 (or a row ``>= valid_rows``)."""
    nbytes = Int32(0)
    src_row = Int64(0)
    if cutlass.const_expr(ids is None):
        if r < valid_rows:
            nbytes = Int32(16)
            src_row = row0 + r
    else:
        rid = ids[r]
        if rid >= 0:
            nbytes = Int32(16)
            src_row = Int64(rid)
    return nbytes, src_row


@cute.jit
def gather_rows_zero_fill(src: cute.Tensor, row_stride: Int64, s_chunks: cute.Tensor, chunk0: cutlass.Constexpr[int],
                          width: cutlass.Constexpr[int], tid: Int32, num_threads: cutlass.Constexpr[int],
                          ids: cute.Tensor | None = None, row0: Int64 | None = None, valid_rows: Int32 | None = None):
    """:func:`gather_rows` by ids, every row a ``cp.async`` (an id of -1 zero-fills its row by ``src-size`` 0, not
    by a shared store) and every pass unrolled: all of the tile's writes are then cp.async, so the pipeline's
    producer commit can be ``cp.async.mbarrier.arrive.noinc`` (``PipelineCpAsync``) and the thread goes on to the
    next tile while this one is in flight. The consumers fence the rows into the async proxy after their wait.
    Or consecutive rows (``ids`` None): tile row ``r`` is source row ``row0 + r``, zero-filled from ``valid_rows``."""
    chunks = width // ROW_CHUNK
    num_rows = cute.size(s_chunks, mode=[2])
    rows_per_pass, passes, guarded = row_passes(num_rows, chunks, num_threads)
    if cutlass.const_expr(guarded):
        raise ValueError(f"gather_rows_zero_fill: {num_rows} rows are not whole passes of {rows_per_pass}")
    chunk = tid % chunks
    sub = tid // chunks
    elem = src.element_type.width // 8
    base = src.iterator.toint() + Int64(chunk * ROW_CHUNK * elem)
    row_bytes = row_stride * elem
    for p in cutlass.range_constexpr(passes):
        r = p * rows_per_pass + sub
        nbytes, src_row = _row_source(r, ids, row0, valid_rows)
        cp_async_chunk(swizzle_128b(s_chunks[0, None, r, chunk0 + chunk].iterator.toint()), base + src_row * row_bytes,
                       nbytes)
