"""Host-side plan of the sm_100a GQA decode kernel (``gqa_decode.py``): its constants, tensor-memory column plan,
ring depth, shared-memory budget and ``check_config``, which the op specs ask before any planning."""

from __future__ import annotations

from typing import NamedTuple

from ...config import PagedAttentionConfig, default_paged_config
from ..common.limits import SMEM_LIMIT_BYTES, TMEM_COLUMNS, row_gather_choice_reason

ARCH = "sm_100a"
KIND = "gqa_paged_decode"
MULTI_TOKEN_KIND = "gqa_paged_multi_token_decode"  # the same kernel with qo_indptr and a per-row causal mask
Q_VEC = 8  # bf16 per 16-byte vector (multi-token decode's Q load)
MMA_M = 128  # tcgen05 M (cta_group 1): TMEM lane r = packed row r
PAGE_SIZES = (16, 32, 64, 128)  # one page per step: S MMA N = page (16..256); P.V needs whole K=16 blocks of keys
SMALL_PAGE_SIZES = (1, 2, 4, 8)  # a step of kv_tile keys is kv_tile / page_size page boxes
SMALL_PAGE_STEPS = (32, 64, 128)  # kv_tile (keys per step) for the small pages
MAX_PAGES_PER_STEP = 64
HEAD_DIMS = (64, 128, 256)  # whole 64-column TMA boxes (128B swizzle); P.V MMA N = head_dim <= 256
# Ring depth: as many stages as fit in this many bytes (the definition config's 4 pages of K + V, so its
# code is unchanged; smaller pages get more pages in flight) and in shared memory, at least 2.
KV_RING_BYTES = 4 * 64 * (128 + 128) * 2
MIN_KV_STAGES = 2
PAGE_IDS_PER_LOAD = 32  # producer: one page id per lane of the load warp
ELEM = 2  # bf16 bytes
TMA_BOX_COLS = 64  # the 128B swizzle caps a box's inner extent at 64 bf16
TMEM_ALIGN = 32  # TMEM regions start on 32-column boundaries (the tcgen05.alloc granule)
SOFTMAX_WARPS = 4
MMA_WARP = 4
LOAD_WARP = 5
NUM_THREADS = 32 * 6
# mbarrier slots after the 2 * kv_stages ring barriers
Q_FULL, Q_EMPTY, S_FULL, P_FULL, O_FULL = 0, 1, 2, 4, 5
NUM_MISC_BARRIERS = 6
MERGE_BARRIER_ID = 1  # named barrier of the softmax warps (0 is __syncthreads)


class TmemPlan(NamedTuple):
    """TMEM columns of one CTA: S buffers ``s_col[i] .. + page``, P ``p_col .. + page/2``, O ``o_col .. +
    head_dim``; ``end`` is one past the last used column, ``alloc`` what tcgen05.alloc takes."""

    s_col: tuple[int, int]
    p_col: int
    o_col: int
    end: int
    alloc: int


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def step_keys(config: PagedAttentionConfig) -> int:
    """Keys per ring stage and S MMA (N): one page for pages of 16..128 keys, else ``kv_tile`` keys of several pages."""
    return config.page_size if config.page_size in PAGE_SIZES else config.kv_tile


def tmem_plan(config: PagedAttentionConfig) -> TmemPlan:
    page, dv = step_keys(config), config.head_dim_v
    s_stride = _round_up(page, TMEM_ALIGN)
    p_col = 2 * s_stride
    p_cols = page // 2  # bf16 P packed two keys per 32-bit column
    # O starts on a multiple of its own width (a 32-column multiple): the definition config keeps its
    # original plan O [256, 384), and no family config that fits with 32-column alignment is lost by it.
    o_col = _round_up(p_col + p_cols, max(TMEM_ALIGN, dv))
    end = o_col + dv
    alloc = max(TMEM_ALIGN, 1 << (end - 1).bit_length())  # tcgen05.alloc takes a power of two >= 32
    return TmemPlan((0, s_stride), p_col, o_col, end, alloc)


def kv_stages(config: PagedAttentionConfig) -> int:
    """Ring stages of one K page + one V page each: as many as KV_RING_BYTES and shared memory hold."""
    stages = max(1, KV_RING_BYTES // _kv_stage_bytes(config))
    while stages > 1 and _smem_bytes(config, stages) > SMEM_LIMIT_BYTES:
        stages -= 1
    return stages


def tma_boxes_per_tile(head_dim: int) -> int:
    """TMA boxes (rows x 64 columns) per Q, K or V tile of ``head_dim`` columns."""
    return head_dim // TMA_BOX_COLS


def check_config(config: PagedAttentionConfig) -> str | None:
    """None when this Blackwell kernel can run ``config``, else why not (on top of ``config.shape_reason``)."""
    if (reason := config.shape_reason()) is not None:
        return reason
    if config.kind not in (KIND, MULTI_TOKEN_KIND) or config.arch != ARCH:
        return f"this kernel is gqa_paged_decode for {ARCH}, not {config.kind} for {config.arch}"
    if (reason := row_gather_choice_reason(config)) is not None:
        return reason
    if config.causal and config.kind == KIND:
        return "decode attends every key of its request (causal=False)"
    if config.page_size not in PAGE_SIZES + SMALL_PAGE_SIZES:
        return (f"page_size={config.page_size} must be one of {PAGE_SIZES} (one page is one S MMA, N = page_size, "
                f"and whole 16-key blocks of the P.V MMA) or {SMALL_PAGE_SIZES} (kv_tile keys of several pages)")
    if config.kind == MULTI_TOKEN_KIND and config.page_size < config.kv_tile:
        return (f"page_size={config.page_size}: multi-token decode loads its query rows in the one-page-per-step "
                f"load role; steps of several pages (page_size < kv_tile={config.kv_tile}) are single-token only here")
    if config.page_size in SMALL_PAGE_SIZES and (config.kv_tile not in SMALL_PAGE_STEPS
                                                 or config.kv_tile // config.page_size > MAX_PAGES_PER_STEP):
        return (f"page_size={config.page_size}: a step of kv_tile={config.kv_tile} keys is kv_tile / page_size TMA "
                f"boxes; kv_tile must be one of {SMALL_PAGE_STEPS} with at most {MAX_PAGES_PER_STEP} pages")
    if config.head_dim_qk != config.head_dim_v:
        return "head_dim_qk must equal head_dim_v"
    if config.head_dim_v not in HEAD_DIMS:
        return (f"head_dim={config.head_dim_v} must be one of {HEAD_DIMS}: whole {TMA_BOX_COLS}-column TMA "
                "boxes, and the P.V MMA N = head_dim <= 256")
    if config.kv_tile % config.page_size:
        return f"kv_tile={config.kv_tile} must be a multiple of page_size={config.page_size}"
    if config.group_size > MMA_M or config.tile_q_rows > MMA_M:
        return f"group {config.group_size} / tile_q_rows {config.tile_q_rows} exceed the {MMA_M}-row MMA tile"
    if config.ctas_per_sm != 1:
        return "one CTA per SM: the TMEM allocation and the K/V ring are sized for the whole SM"
    plan = tmem_plan(config)
    if plan.end > TMEM_COLUMNS:
        return (f"TMEM: S0/S1 ({step_keys(config)} fp32 columns each), P ({step_keys(config) // 2}) and O "
                f"({config.head_dim_v}, from column {plan.o_col}) need {plan.end} of {TMEM_COLUMNS} columns")
    if kv_stages(config) < MIN_KV_STAGES:
        return (f"shared memory: Q and {MIN_KV_STAGES} K/V stages need "
                f"{_smem_bytes(config, MIN_KV_STAGES)} B, more than {SMEM_LIMIT_BYTES} B")
    if config.line_schedule:
        from ..common.line_schedule import gqa_line_reason

        if (reason := gqa_line_reason(config, line_table_requests(config))) is not None:
            return reason
    return None


def line_table_requests(config: PagedAttentionConfig) -> int:
    """The most requests a ``line_schedule`` build's table holds (it aliases the K stages)."""
    from ..common.line_schedule import table_requests

    return table_requests(NUM_THREADS, kv_stages(config) * step_keys(config) * config.head_dim_qk * ELEM)


def line_capacity(config: PagedAttentionConfig) -> tuple[int, int]:
    """(requests the table holds, threads a CTA: its edges ``num_ctas + 1`` must not outnumber them)."""
    return line_table_requests(config), NUM_THREADS


def _kv_stage_bytes(config: PagedAttentionConfig) -> int:
    return step_keys(config) * (config.head_dim_qk + config.head_dim_v) * ELEM


def _smem_bytes(config: PagedAttentionConfig, stages: int) -> int:
    q = MMA_M * config.head_dim_qk * ELEM
    barriers = 8 * (2 * stages + NUM_MISC_BARRIERS) + 4 + 4  # mbarriers, TMEM address, merge arrival word
    return q + stages * _kv_stage_bytes(config) + barriers + 3 * 1024  # worst-case padding of 3 buffers


def smem_bytes(config: PagedAttentionConfig) -> int:
    """Dynamic shared memory of one CTA, as the kernel allocates it (1024 B alignment per tile buffer)."""
    return _smem_bytes(config, kv_stages(config))


def tmem_columns(config: PagedAttentionConfig) -> tuple[int, int]:
    """(columns used: one past the last, columns allocated)."""
    plan = tmem_plan(config)
    return plan.end, plan.alloc


def configs(arch: str, kind: str = KIND) -> list[PagedAttentionConfig]:
    """The definition's config (h20/kv4, d128, page 64) and one family member (h32/kv8), as on sm_90a, plus
    the family's extremes that change the code: pages 16 / 128 (S and P widths, ring depth) at head_dim
    128, head_dim 64 / 256 (TMA boxes, O width) at page 64, and page 128 at head_dim 64 (O from column 320)."""
    if arch != ARCH:
        return []

    def decode(hq, hkv, page=64, head_dim=128):
        return default_paged_config(kind, arch=ARCH, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=head_dim,
                                    head_dim_v=head_dim, page_size=page, causal=kind == MULTI_TOKEN_KIND)

    if kind == MULTI_TOKEN_KIND:  # the definition's heads and one family member (the Q load and mask are new)
        return [decode(20, 4), decode(32, 8)]
    return [decode(20, 4), decode(32, 8), decode(32, 8, page=16), decode(32, 8, page=128),
            decode(32, 8, head_dim=64), decode(32, 8, head_dim=256), decode(32, 8, page=128, head_dim=64),
            decode(20, 4, page=1), decode(20, 4, page=8)]


def multi_token_configs(arch: str) -> list[PagedAttentionConfig]:
    return configs(arch, MULTI_TOKEN_KIND)
