"""Paged K gather with TMA: ``out[i] = k_cache[page_ids[i]]``.

The smallest real building block of the paged-attention kernels, and the proof
that the compile path (symbolic dims, tvm-ffi, both arches) works.

Shapes (row-major, ``head_dim`` contiguous)::

    k_cache  [num_pages, page_size, num_kv_heads, head_dim]   bf16/fp16, num_pages symbolic,
                                                             page stride symbolic (strided
                                                             views such as kv[:, 0] are fine)
    page_ids [n]                                             int32, n symbolic
    out      [n, page_size, num_kv_heads, head_dim]          same dtype, compact

Grid ``(n, num_kv_heads)``, one warp per CTA.  CTA ``(i, h)`` moves the
``page_size x head_dim`` tile of head ``h`` of page ``page_ids[i]``.

Roles / pipeline (single stage, one tile per CTA):

1. warp 0, one elected lane: prefetch both TMA descriptors, ``mbarrier.init``
   (arrival count 1), ``fence.mbarrier_init``; then ``bar.sync``.
2. all lanes read ``page = page_ids[i]`` (the TMA coordinate of the page mode).
3. elected lane: ``mbarrier.arrive.expect_tx(tile_bytes)`` and the TMA load
   ``cp.async.bulk.tensor.4d ... mbarrier::complete_tx::bytes`` with coordinate
   ``(0, 0, h, page)`` into shared memory.
4. all lanes wait on the mbarrier (phase 0).
5. thread 0: TMA store ``cp.async.bulk.tensor.4d.global.shared::cta`` of the
   tile to ``out[i, :, h, :]``, ``commit_group`` + ``wait_group.read 0`` so the
   shared memory stays alive until the bulk store has read it.

A page id outside ``[0, num_pages)`` is out of bounds for the TMA box, which the
hardware zero-fills: the matching output page is zeros, never a fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ...compile import register_kernel
from ...config import KernelConfig
from .limits import SMEM_LIMIT_BYTES

DTYPES: dict[str, Any] = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
ELEMENT_BYTES = 2
TMA_BOX_MAX = 256  # cuTensorMapEncodeTiled: every box dimension <= 256 elements


@dataclass(frozen=True)
class PageGatherConfig(KernelConfig):
    """Compile-time shape of one page; the number of pages and ``n`` are runtime."""

    kernel_name: ClassVar[str] = "page_gather"

    page_size: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"

    @property
    def tile_bytes(self) -> int:
        """Bytes moved by one TMA load: one head of one page."""
        return self.page_size * self.head_dim * ELEMENT_BYTES

    def can_implement(self) -> str | None:
        if (reason := super().can_implement()) is not None:
            return reason
        if self.dtype not in DTYPES:
            return f"dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}"
        for name in ("page_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name}={value!r} must be a positive int"
        if (self.head_dim * ELEMENT_BYTES) % 16:
            return (
                f"head_dim={self.head_dim}: a row is {self.head_dim * ELEMENT_BYTES} bytes, "
                "TMA needs the contiguous extent to be a multiple of 16 bytes "
                "(head_dim multiple of 8 for 2-byte dtypes)"
            )
        if self.head_dim > TMA_BOX_MAX:
            return f"head_dim={self.head_dim} exceeds the TMA box limit of {TMA_BOX_MAX}"
        if self.page_size > TMA_BOX_MAX:
            return f"page_size={self.page_size} exceeds the TMA box limit of {TMA_BOX_MAX}"
        if self.num_kv_heads > 65535:
            return f"num_kv_heads={self.num_kv_heads} exceeds the grid.y limit of 65535"
        if self.tile_bytes + 8 > SMEM_LIMIT_BYTES:
            return f"tile of {self.tile_bytes} bytes does not fit in shared memory"
        return None


class PageGather:
    """The kernel object: compile-time constants live on ``self``."""

    def __init__(self, config: PageGatherConfig) -> None:
        self.page_size = config.page_size
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = DTYPES[config.dtype]
        self.tile_bytes = config.tile_bytes
        self.num_threads = 32

    def __repr__(self) -> str:
        # Shows up in the mangled kernel name (profilers, PTX).
        return f"PageGather_P{self.page_size}_H{self.num_kv_heads}_D{self.head_dim}"

    @cute.jit
    def __call__(
        self,
        k_cache: cute.Tensor,
        page_ids: cute.Tensor,
        out: cute.Tensor,
        stream: cuda.CUstream,
    ):
        # View both 4-D tensors as (page_size, head_dim, num_kv_heads, pages):
        # the first two modes are the TMA box, the last two are coordinates.
        order = [1, 3, 2, 0]
        k_view = cute.make_tensor(k_cache.iterator, cute.select(k_cache.layout, mode=order))
        o_view = cute.make_tensor(out.iterator, cute.select(out.layout, mode=order))
        tile = (self.page_size, self.head_dim)
        # Plain row-major tile (no swizzle): nobody reads it through ldmatrix here.
        smem_layout = cute.make_layout(tile, stride=(self.head_dim, 1))
        load_atom, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k_view, smem_layout, tile
        )
        store_atom, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o_view, smem_layout, tile
        )
        self.kernel(load_atom, tma_k, store_atom, tma_o, page_ids, smem_layout).launch(
            grid=(page_ids.shape[0], self.num_kv_heads, 1),
            block=(self.num_threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        load_atom: cute.CopyAtom,
        tma_k: cute.Tensor,
        store_atom: cute.CopyAtom,
        tma_o: cute.Tensor,
        page_ids: cute.Tensor,
        smem_layout: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        slot, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        s_tile = smem.allocate_tensor(self.dtype, smem_layout, byte_alignment=128)
        mbar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(load_atom)
            cpasync.prefetch_descriptor(store_atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Partition for TMA: the whole (page_size, head_dim) tile is one TMA
        # "value"; the remaining modes are (num_kv_heads, pages) coordinates.
        t_s_load, t_g_k = cpasync.tma_partition(
            load_atom,
            0,
            cute.make_layout(1),
            cute.group_modes(s_tile, 0, 2),
            cute.group_modes(tma_k, 0, 2),
        )
        t_s_store, t_g_o = cpasync.tma_partition(
            store_atom,
            0,
            cute.make_layout(1),
            cute.group_modes(s_tile, 0, 2),
            cute.group_modes(tma_o, 0, 2),
        )

        page = page_ids[slot]
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.tile_bytes)
            # The DSL issues a TMA copy from a single elected lane by itself.
            cute.copy(load_atom, t_g_k[None, head, page], t_s_load, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)

        if tidx == 0:
            cute.copy(store_atom, t_s_store, t_g_o[None, head, slot])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


def build(config: PageGatherConfig) -> tuple[Any, tuple[Any, ...]]:
    """``(jit_fn, fake_args)`` for :func:`cute_attn.compile.compile_kernel`."""
    dtype = DTYPES[config.dtype]
    P, H, D = config.page_size, config.num_kv_heads, config.head_dim
    num_pages = cute.sym_int(symbol="num_pages")
    # 16-byte aligned page stride (TMA global strides must be multiples of 16 B).
    page_stride = cute.sym_int64(divisibility=16 // ELEMENT_BYTES, symbol="page_stride")
    n = cute.sym_int(symbol="n")  # shared by page_ids and out
    k_cache = cute.runtime.make_fake_tensor(
        dtype, (num_pages, P, H, D), stride=(page_stride, H * D, D, 1), assumed_align=16
    )
    page_ids = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (n,))
    out = cute.runtime.make_fake_compact_tensor(
        dtype, (n, P, H, D), stride_order=(3, 2, 1, 0), assumed_align=16
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return PageGather(config), (k_cache, page_ids, out, stream)


def default_configs(arch: str) -> list[PageGatherConfig]:
    """Configs built by ``tools/compile_all.py``."""
    return [PageGatherConfig(arch=arch, page_size=16, num_kv_heads=8, head_dim=128)]


register_kernel(PageGatherConfig, build, configs=default_configs)
