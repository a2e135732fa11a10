"""A split request folded by its thread-block cluster in distributed shared memory (``cluster_merge``).

The plan's shape (``plan_clusters.py``): the CTA of rank ``r`` in a cluster of ``k`` holds piece ``r`` of one merge
(or the cluster holds no split item). Each CTA keeps its piece's normalised O (``heads x columns`` fp32) and base-2
LSE per head in its own shared memory (:func:`keep_piece`) instead of storing a global partial. Then:

1. every thread of every CTA: ``barrier.cluster.arrive`` (release) + ``wait`` (acquire), so each CTA's piece is
   visible to its peers;
2. the consumer threads of a CTA whose item is split fold columns ``r * columns / k ..`` of every head
   (:func:`fold_cluster_columns`): the k peers' LSEs of the head, their weights ``2^(lse_p - max)``, and the weighted
   sum of the peers' 16-byte column vectors, each read with ``ld.shared::cluster``; rank 0 also writes the merged
   LSE;
3. a second cluster barrier, so no CTA exits (its shared memory gone) while a peer still reads it.

Every CTA executes both barriers (the grid is whole clusters; CTAs without an item too). What a merge costs is two
cluster barriers and ``k`` distributed-shared-memory loads a thread, against the combine launch's ~4 us after the
attention grid (MLA decode page 64, ``docs/perf-history.md``). All-``-inf`` pieces (no keys) give 0 and ``-inf``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

VEC = 4  # fp32 columns a thread folds together (one 16-byte ld.shared::cluster a peer)
#: fp32 words after each head's row of the kept O: the consumers' stores from the O^T accumulator put 8 columns x 4
#: heads on a warp's lanes, and rows 512 words apart land all 4 heads of a column on one bank (4-way conflicts); 516
#: apart they spread over all 32 banks (and a row still starts 16-byte aligned)
ROW_PAD = 4


def fold_buffer_bytes(heads: int, columns: int) -> int:
    """Shared memory of the kept piece: O (heads x columns fp32, rows :data:`ROW_PAD` apart) and the LSE per head,
    16-byte aligned."""
    return heads * (columns + ROW_PAD) * 4 + max(16, heads * 4)


def allocate_fold_buffers(smem, heads: int, columns: int) -> tuple:
    """``(piece_o, piece_lse)``: the kept piece's O ``(heads, columns)`` fp32, rows ``columns + ROW_PAD`` words apart,
    and its LSE ``(heads,)``."""
    piece_o = smem.allocate_tensor(Float32, cute.make_layout((heads, columns), stride=(columns + ROW_PAD, 1)), 16)
    piece_lse = smem.allocate_tensor(Float32, cute.make_layout((max(4, heads),)), 16)
    return piece_o, piece_lse


def peer_address(smem_ptr, rank) -> Int32:
    """The 32-bit ``shared::cluster`` address of the same shared-memory byte in CTA ``rank`` of this cluster
    (``cute.arch.map_dsmem_ptr``: ``mapa``), for the peer loads below."""
    return cute.arch.map_dsmem_ptr(smem_ptr, rank).toint()


@dsl_user_op
def load_peer_f32(address, *, loc=None, ip=None) -> Float32:
    """``ld.shared::cluster.f32`` at a :func:`peer_address` (a side effect: it stays after the cluster barrier)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(address).ir_value(loc=loc, ip=ip)], "ld.shared::cluster.f32 $0, [$1];", "=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def load_peer_v4(address, *, loc=None, ip=None) -> tuple:
    """``ld.shared::cluster.v4.f32`` (16-byte aligned) at a :func:`peer_address`: four Float32."""
    struct = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * VEC), [Int32(address).ir_value(loc=loc, ip=ip)],
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(VEC))


@cute.jit
def cluster_sync():
    """``barrier.cluster.arrive`` (release) then ``wait`` (acquire): every thread of every CTA of the cluster."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def fold_cluster_columns(piece_o: cute.Tensor, piece_lse: cute.Tensor, rank, token, row_count, output: cute.Tensor,
                         lse: cute.Tensor, lse_out_scale: Float32, tidx,
                         cluster_size: cutlass.Constexpr[int], num_threads: cutlass.Constexpr[int]):
    """This rank's ``1 / cluster_size`` of the columns of every head, from every peer's kept piece, into
    ``output[token, head, columns]``; rank 0 writes ``lse[token, head] * lse_out_scale`` (module docstring, step 2).
    Heads ``>= row_count`` are read and not stored. ``tidx`` in ``0 .. num_threads - 1``."""
    heads, columns = cute.size(piece_o, mode=[0]), cute.size(piece_o, mode=[1])
    row = columns + ROW_PAD
    width = columns // cluster_size
    vecs_a_head = width // VEC
    total = heads * vecs_a_head
    neg_inf = -Float32.inf
    peers_o = [peer_address(piece_o.iterator, p) for p in range(cluster_size)]  # byte addresses of (0, 0)
    peers_lse = [peer_address(piece_lse.iterator, p) for p in range(cluster_size)]
    # every peer load of every step goes out before any is used: one distributed-shared-memory round trip instead of
    # one a step and peer (a thread past ``total`` rereads the last vector and stores nothing)
    loaded = []
    for step in cutlass.range_constexpr((total + num_threads - 1) // num_threads):
        v = tidx + step * num_threads
        last = cutlass.min(v, total - 1)
        head = last // vecs_a_head
        column = rank * width + (last % vecs_a_head) * VEC
        offset = (head * row + column) * 4
        loaded.append((v, head, column, [load_peer_f32(peers_lse[p] + head * 4) for p in range(cluster_size)],
                       [load_peer_v4(peers_o[p] + offset) for p in range(cluster_size)]))
    for v, head, column, piece, parts in loaded:
        if v < total:
            top = piece[0]
            for p in cutlass.range_constexpr(1, cluster_size):
                top = cute.arch.fmax(top, piece[p])
            safe = top if top != neg_inf else Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            total_weight = Float32(0.0)
            for p in cutlass.range_constexpr(cluster_size):
                weight = cute.math.exp2(piece[p] - safe, fastmath=True)
                total_weight = total_weight + weight
                for i in cutlass.range_constexpr(VEC):
                    acc[i] = acc[i] + weight * parts[p][i]
            inv = Float32(0.0)
            if total_weight > 0.0:
                inv = 1.0 / total_weight
            if head < row_count:
                out = cute.make_rmem_tensor((VEC,), output.element_type)
                for i in cutlass.range_constexpr(VEC):
                    out[i] = (acc[i] * inv).to(output.element_type)
                cute.autovec_copy(out, cute.local_tile(output[token, head, None], (VEC,), (column // VEC,)))
                if rank == 0:
                    if v % vecs_a_head == 0:
                        merged = neg_inf
                        if total_weight > 0.0:
                            merged = top + cute.math.log2(total_weight, fastmath=True)
                        lse[token, head] = merged * lse_out_scale


__all__ = ["allocate_fold_buffers", "cluster_sync", "fold_buffer_bytes", "fold_cluster_columns", "VEC"]
