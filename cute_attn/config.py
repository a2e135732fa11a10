"""Base class for frozen kernel configurations.

A config names one compiled kernel: everything that is baked in at compile time
(tile sizes, head dim, dtype, arch...).  Runtime sizes such as batch, sequence
length or number of pages are *not* part of it: kernels are compiled once per
config with symbolic dims.

Subclasses are ``@dataclass(frozen=True)``, set the class attribute
``kernel_name`` and extend :meth:`KernelConfig.can_implement`::

    @dataclass(frozen=True)
    class MyConfig(KernelConfig):
        kernel_name: ClassVar[str] = "my_kernel"
        head_dim: int = 128

        def can_implement(self) -> str | None:
            if (reason := super().can_implement()) is not None:
                return reason
            if self.head_dim % 8:
                return f"head_dim={self.head_dim} must be a multiple of 8"
            return None
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .arch import SUPPORTED_ARCHS

_KEY_TYPES = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class KernelConfig:
    """Frozen, hashable description of one kernel build."""

    arch: str

    #: Short stable name of the kernel, set by each subclass.
    kernel_name: ClassVar[str] = ""

    def can_implement(self) -> str | None:
        """None when this config can be built, else a readable reason why not."""
        if not type(self).kernel_name:
            return f"{type(self).__name__} does not set the class attribute kernel_name"
        if self.arch not in SUPPORTED_ARCHS:
            return (
                f"arch={self.arch!r} is not supported; use one of "
                f"{', '.join(repr(a) for a in SUPPORTED_ARCHS)}"
            )
        return None

    def cache_key(self) -> str:
        """Stable string over the kernel name and every field (sorted by name).

        Only plain values (str/int/float/bool/None and tuples of them) are
        allowed so the key never depends on object identity or ``repr`` quirks.
        """
        parts = []
        for f in sorted(dataclasses.fields(self), key=lambda f: f.name):
            parts.append(f"{f.name}={_key_value(getattr(self, f.name), f.name)}")
        return f"{type(self).kernel_name}({','.join(parts)})"

    def __str__(self) -> str:
        return self.cache_key()


def _key_value(value: object, name: str) -> str:
    if isinstance(value, tuple):
        return "(" + ",".join(_key_value(v, name) for v in value) + ")"
    if not isinstance(value, _KEY_TYPES):
        raise TypeError(
            f"config field {name!r} has type {type(value).__name__}; "
            "only str/int/float/bool/None and tuples of them are allowed"
        )
    return repr(value)


# ---------------------------------------------------------------------------------------------
# Paged attention kernels
# ---------------------------------------------------------------------------------------------
_GQA_HEAD_DIMS = (64, 128, 256)
#: (kind, arch) of the kernels that build ``PagedAttentionConfig.dynamic_schedule`` (the planner-free prefill)
DYNAMIC_SCHEDULE_KERNELS = tuple((kind, arch) for kind in ("gqa_paged_prefill", "mla_paged_prefill")
                                 for arch in ("sm_90a", "sm_100a"))


def __getattr__(name: str):
    if name == "PAGED_KINDS":  # the op kinds: one spec module each (cute_attn/ops)
        from .ops import kinds

        return kinds()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class PagedAttentionConfig(KernelConfig):
    """One paged-attention kernel build: the definition's constants plus the tile geometry.

    Packed GQA rows: the ``group = num_qo_heads // num_kv_heads`` query heads of a KV head are rows of
    one M tile (``tile_q_rows``), so every K/V tile load serves the whole group.
    """

    kernel_name: ClassVar[str] = "paged_attention"

    kind: str = "gqa_paged_prefill"
    num_qo_heads: int = 32
    num_kv_heads: int = 4
    head_dim_qk: int = 128
    head_dim_v: int = 128
    page_size: int = 64
    causal: bool = True
    tile_q_rows: int = 128
    kv_tile: int = 128
    ctas_per_sm: int = 1
    #: planner: split-KV chunks at least this long (fewer partials to merge; measured in decode_variants.py)
    min_chunk_keys: int = 0
    #: planner cost model: the fixed cost of one work item (Q load, pipeline fill, epilogue), in key-equivalents.
    #: The host's LPT barely depends on it; the device planner's contiguous cuts do (docs/perf-history.md, session 7)
    item_overhead_keys: int = 128
    #: sm_90a prefill: issue S_{j+1} = Q K_{j+1}^T before the softmax of tile j (FA3 intra-warpgroup overlap)
    intra_wg_overlap: bool = False
    #: sm_90a prefill: write the bf16 output tile through shared memory with 16-byte coalesced stores
    smem_epilogue: bool = False
    #: planner: at most this many query tokens per tile (0: as many as tile_q_rows holds); multi-token decode's
    #: kernel computes 8 tokens' rows, so a longer request is cut into several items rather than truncated
    max_tile_tokens: int = 0
    #: sm_90a MLA prefill: the two consumer warpgroups each compute S = Q K^T for half of a kv_tile's keys and
    #: share P through shared memory (``kernels/sm90/mla_prefill_shared_s.py``) instead of both computing all of S
    share_scores: bool = False
    #: sm_90a MLA prefill: the first consumer warpgroup computes all of S = Q K^T (one m64n64 wgmma chain) and the
    #: softmax, and hands P and the O rescale to the second, which only computes its half of O = P V
    #: (``kernels/sm90/mla_prefill_score_wg.py``); excludes ``share_scores``
    score_warpgroup: bool = False
    #: measurement builds, never a default (sm_90a MLA prefill, score_warpgroup, row gathers): "loads_only" -- the
    #: consumers wait for each K stage and release it without computing (the load role's own period a tile);
    #: "compute_only" -- the load role completes each K stage without copying into it (the consumers' chain alone).
    #: Their outputs are wrong by design; tools/mla_prefill_variants.py times them beside the real kernel. sm_90a GQA
    #: prefill: "cta_stamps" -- each CTA's entry, release and end times in scratch, outputs right (tools/cta_timeline.py)
    probe: str = ""
    #: sm_90a cp.async row gathers dealt by 128-byte segments, 8 lanes a segment and few rows a thread
    #: (``common/row_gather.gather_row_segments``, ``gather_one_row_pages(segments=True)``); False keeps one 16-byte
    #: chunk column a thread over every row. None: the kernels' policy, segments (H200: MLA prefill 1.07-1.18x, session 13;
    #: GQA page 1 decode 64 x 2048 84.8 -> 78.8 us and prefill 8 x 992 220.5 -> 206.3 us, session 14)
    row_segments: bool | None = None
    #: sm_90a GQA prefill row gathers (pages 1..8): the producer warps copy key tile t + 1's K before tile t's V (FA3's
    #: paged-KV order: with the intra-warpgroup overlap a consumer needs K_{t+1} for S_{t+1} before V_t for P_t V_t);
    #: False / None: K_t then V_t (the kernel's policy). A knob for ``tuning.sweep`` A/Bs in one process
    k_ahead: bool | None = None
    #: sm_90a GQA kernels: K/V tiles as 16-byte cp.async rows (True) or as TMA page boxes (False); None: the
    #: kernel's page-size policy (its ``ROW_GATHER_PAGE_SIZES``). A knob for ``tuning.sweep`` A/Bs in one process
    row_gather: bool | None = None
    #: sm_90a GQA decode row gathers (pages 1, 2): the warps that copy each stage's rows, 1 (the producer warp) or 4
    #: (a producer warpgroup, a quarter of every stage each, as the prefill kernel's);
    #: ``ops/gqa_decode.GATHER_WARPS_PAGE_SIZES`` says which is the default and why
    gather_warps: int = 1
    #: MLA kernels (both arches) and the sm_90a GQA prefill kernel: the last CTA to finish a split item folds its
    #: partials in-kernel (the GQA decode's ``common/decode_merge.py``), so no combine launch follows. MLA: correct on
    #: the H200 but slower (session 15), off (``ops/mla_prefill.FUSED_MERGE`` says why); GQA prefill:
    #: ``ops/gqa_prefill.FUSED_MERGE``
    fused_merge: bool = False
    #: sm_90a MLA kernels' TMA K stages at pages of >= kv_tile keys: a stage whose keys all hold rows (one page's
    #: contiguous rows) loads as kv_tile-row boxes, 9 TMA instructions, instead of 72 8-row ones
    #: (``common/mla.box_latent_tile``); ``ops/mla_prefill.PAGE_BOXES`` is the kind's policy. Row gathers
    #: (``row_gather=True``) ignore it
    page_boxes: bool = False
    #: every attention kernel: each CTA releases the launch that follows it (``griddepcontrol.launch_dependents``)
    #: right after its own wait (``kernels/common/launch_chain.wait_for_previous_grid``), so the combine's CTAs
    #: (launched with programmatic dependent launch) are dispatched while the attention grid runs and take SMs as its
    #: CTAs exit, instead of being launched when it ends (the combine still waits for the whole grid and its writes).
    #: ``default_paged_config`` takes EARLY_DEPENDENTS
    early_dependents: bool = False
    #: sm_90a MLA kernels: each CTA counts its split items in their merges after its item loop (release after the
    #: partial stores) and releases the combine launch at its start; the combine (``CombineConfig.eager``) then folds
    #: each merge once its slots are in, on SMs the attention grid's finished CTAs left, instead of waiting for the
    #: whole grid (``kernels/common/combine.py``). ``ops/mla_prefill.EAGER_COMBINE`` is the kind's policy
    eager_combine: bool = False
    #: sm_90a MLA and GQA prefill kernels with the combine launch: split items store their normalised partial O as
    #: bf16 instead of fp32 (the partial LSEs stay fp32), halving the partials' stores and the combine's reads
    #: (FlashInfer's split-KV keeps its partials in the output dtype too). ``BF16_PARTIALS`` is the policy
    bf16_partials: bool = False
    #: the sm_90a MLA decode kernel (one token a tile): CTAs launched in clusters of this many (2, 4 or 8; 0: none),
    #: and a split request folded by its cluster in shared memory (``kernels/common/cluster_merge.py``) instead of
    #: through global partials and the combine launch. Only a host plan of the cluster shape runs it
    #: (``plan_clusters.cluster_merge_size``; the plan picks it, ``ops/mla_decode.cluster_tiles``)
    cluster_merge: int = 0
    #: with ``cluster_merge``: the kernel checks at run time whether each cluster holds one whole merge (rank ``r`` its
    #: slot ``r``, one item a CTA: the ``plan_clusters`` shape, read from the plan in global memory), folds those in
    #: shared memory and flags them in the plan's ``merge_counters``; every other split item stores its global partial
    #: and the combine launch follows, skipping the flagged merges. For device plans, whose shape the host never sees
    #: (``ops/mla_decode.device_cluster_tiles``)
    cluster_merge_flags: bool = False
    #: the sm_90a GQA and MLA prefill kernels with no plan: each CTA checks the batch's index rules, then takes whole
    #: (request, q tile, KV head) units from an atomic counter, checking each unit's request and page ids as it goes
    #: (``kernels/common/unit_schedule.py``); nothing split, no combine, one launch. The default call's route for
    #: batches with enough units (``ops/gqa_prefill.DYNAMIC_SCHEDULE`` / ``ops/mla_prefill.DYNAMIC_SCHEDULE`` say when)
    dynamic_schedule: bool = False
    #: self-scheduling builds (``dynamic_schedule``) only: the load role takes its next unit from the counter once the
    #: current unit's last key tile is issued (the consumers then the K/V ring's depth from its end), not as its loads
    #: begin. Why: claimed a whole unit ahead, a CTA's second unit is taken before any CTA has finished its first, so at
    #: one or two units a CTA the longest units pair up on the same CTAs (``tools/dynamic_schedule_model.py
    #: --claim``: 1.21x the host plan's busiest CTA at 1 x 992, 1.38x at MLA 1 x 1028, where the H200 measured 1.20x
    #: and 1.30x; claimed late, 1.00x both). Built in session 36, on since session 37 (``LATE_CLAIM_KINDS``)
    late_claim: bool = False
    #: self-scheduling builds (``dynamic_schedule``) only: a batch whose requests all have as many q tiles and at most
    #: this many units a CTA takes its units rank-major (every request's last q tile, then every second-last, ...;
    #: longest first), not request-major; 0: request-major always. Why: at two or three units a CTA the
    #: request-major order hands the longest tiles of the last requests out late (``tools/dynamic_schedule_model.py``:
    #: h5/kv1 8 x 992 1.10x the host plan's busiest CTA, h6/kv1 1.16x; rank-major 1.00x). Built in session 39, not run
    rank_major_units: int = 0
    #: the decode kernels with no plan (GQA: sm_90a, sm_100a twin; the sm_90a one-token MLA decode): every CTA derives
    #: its own stretch of the device planner's cost line from ``kv_indptr`` / ``kv_last_page_len`` at its start
    #: (``kernels/common/line_schedule.py``; the numpy twin ``cute_attn/line_schedule.py``), so a new batch costs one
    #: launch: no planner, no plan buffers, no combine. Built in session 38, run on the H200 in session 39: the default
    #: call takes it under ``ops/gqa_decode.LINE_SCHEDULE`` / ``ops/mla_decode.SM90_LINE_SCHEDULE`` (both on, sm_90a)
    line_schedule: bool = False
    #: the line builds' check of every page id at the kernel's start (``unit_schedule.scan_page_ids``): ids a thread
    #: loads before it checks any (1: one load a pass, the landed build). A CTA's share is ids / (CTAs x threads)
    #: passes, each a dependent load: ~11 at page 1 for 64 x 8192 or 128 x 4096, ~21 for the ragged MLA 64, none
    #: of them overlapped with the loads, which wait at the barrier after it (session 40: the page-1 line build's
    #: extra +3..+8 us). With more, the CTA's share is prefetched to L2 and that many ids are in flight a thread, as the
    #: device planner's scan does; the default call's count is ``config.line_scan_ids`` (session 41: 8 from ~2 passes)
    scan_ids_per_thread: int = 1
    #: the line builds' stretch of a uniform batch (every request the same keys, none faulted) in closed form
    #: (``kernels/common/line_uniform.py``): one block reduction for the uniformity, one for the whole-tile vote, the
    #: deal and the merges, and no line starts, prefix sum or edge search; other batches derive on the table as
    #: before. Why: the prologue before the first TMA load is a ~730-instruction dependent chain a warp between 16
    #: barriers (session 42, ncu: ~4-5 us of the default call's +3.9 over plan-once at h20/kv4 64 x 2048, H100). The
    #: default call takes it for ``config.LINE_UNIFORM_KINDS`` (GQA decode, after session 42's A/B: -0.4..-1.6 us)
    uniform_line: bool = False
    #: the MLA kernels' load role over plan items (both arches): an item's first page ids load, from its
    #: ``KV_PAGE_START`` (no ``kv_indptr`` load), before its Q tile, so their latency runs under Q's instead of after
    #: Q's wait (``kernels/common/mla.load_q_and_kv_tiles``). None: on (the kernels' order since session 43); False:
    #: the earlier order, for A/Bs
    early_page_ids: bool | None = None
    #: the MLA kernels' load role over plan items with TMA-box K stages (sm_90a pages of >= 8 keys): an item's first K
    #: stage is issued before the thread waits for its Q copies, so the stage's TMA runs under Q's round trip instead
    #: of after it (Q is still issued first: the earlier "first K tile before Q" order, sessions 12-13, was slower).
    #: None: on (since session 44, H100: -0.1..-3.3 us on every page-64 MLA row); False: the earlier order, for A/Bs.
    #: The sm_100a kernel, which loads Q only for items with keys, keeps its order (its PTX is the same either way)
    early_first_stage: bool | None = None

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def packed_rows_per_tile(self) -> int:
        """Packed rows the planner puts in one M tile: whole tokens, ``(tile_q_rows // group) * group`` (a group
        of 5 fills 125 of 128 rows; the kernel computes the rest and never stores them)."""
        tokens = max(1, self.tile_q_rows // self.group_size)
        if self.max_tile_tokens > 0:
            tokens = min(tokens, self.max_tile_tokens)
        return tokens * self.group_size

    def plan_config(self, num_ctas: int):
        from .plan import PlanConfig  # plan.py is numpy-only; keep config importable without it

        return PlanConfig(
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, causal=self.causal,
            tile_q_rows=min(self.tile_q_rows, self.packed_rows_per_tile), kv_tile=self.kv_tile, num_ctas=num_ctas, min_chunk_keys=self.min_chunk_keys,
            item_overhead_keys=self.item_overhead_keys, page_size=self.page_size,
            zigzag=self.causal and self.kind.startswith("mla_"), sorted_deal=self.causal,
            host_deal=self.causal and self.kind == "gqa_paged_prefill", line_deal=self._line_deal(),
            even_pieces=EVEN_PIECES, max_slack_keys=MAX_SLACK_KEYS, whole_deal=self._whole_deal(),
            deal_whole_cuts=self._deal_whole_cuts(), deal_max_q_tiles=self._deal_max_q_tiles(),
            rank_deal_max_q_tiles=RANK_DEAL_MAX_Q_TILES if self.causal else 0,
            deal_first=self.causal and self.kind in DEAL_FIRST_KINDS,
            lap_turn=self.causal and self.kind in LAP_TURN_KINDS,
        )

    def _whole_deal(self) -> str:
        from .ops import gqa_prefill  # the prefill spec's host-plan policy

        return gqa_prefill.WHOLE_DEAL if self.causal and self.kind == "gqa_paged_prefill" else ""

    def _deal_whole_cuts(self) -> bool:
        from .ops import gqa_prefill  # the prefill spec's device-plan policy

        return self.causal and self.kind == "gqa_paged_prefill" and gqa_prefill.DEVICE_WHOLE_DEAL

    def _deal_max_q_tiles(self) -> int:
        from .ops import gqa_prefill  # the prefill spec's device-plan policy
        from .plan import DEAL_MAX_Q_TILES_CHOICES

        return (gqa_prefill.DEAL_MAX_Q_TILES if self.causal and self.kind == "gqa_paged_prefill"
                else DEAL_MAX_Q_TILES_CHOICES[0])

    def _line_deal(self) -> bool:
        from .ops import gqa_decode  # the decode spec's page-size policy

        return self.kind == "gqa_paged_decode" and gqa_decode.line_deals(self.page_size, self.num_kv_heads)

    def can_implement(self) -> str | None:
        """None when a registered kernel builds this config, else why not: the shape rules every kernel of the
        kind shares (:meth:`shape_reason`), then the rules of the kernel registered for (kind, arch)."""
        if (reason := self.shape_reason()) is not None:
            return reason
        from .kernels import kernel_reason  # imports the kernel modules (the DSL) on first use

        return kernel_reason(self)

    def shape_reason(self) -> str | None:
        """The rules of the kind alone (no kernel consulted): what each kernel's ``check_config`` starts from."""
        if (reason := super().can_implement()) is not None:
            return reason
        from .ops import get_spec

        try:
            spec = get_spec(self.kind)
        except ValueError as exc:
            return str(exc)
        if self.num_kv_heads < 1 or self.num_qo_heads % self.num_kv_heads:
            return f"num_qo_heads={self.num_qo_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}"
        if self.probe and (self.kind, self.arch) not in (("mla_paged_prefill", "sm_90a"), ("gqa_paged_prefill", "sm_90a")):
            return f"probe={self.probe!r}: measurement builds exist for the sm_90a MLA and GQA prefill kernels only"
        if self.k_ahead and (self.kind, self.arch) != ("gqa_paged_prefill", "sm_90a"):
            return f"k_ahead={self.k_ahead}: a knob of the sm_90a GQA prefill kernel's row gathers only"
        if self.gather_warps not in (1, 4):
            return f"gather_warps={self.gather_warps}: 1 (the producer warp) or 4 (a producer warpgroup)"
        if self.gather_warps != 1 and ((self.arch != "sm_90a")
                                       or self.kind not in ("gqa_paged_decode", "gqa_paged_multi_token_decode")):
            return f"gather_warps={self.gather_warps}: a knob of the sm_90a GQA decode kernel's row gathers only"
        if self.row_segments is not None and self.arch != "sm_90a":
            return f"row_segments={self.row_segments}: a knob of the sm_90a cp.async row gathers only"
        if self.fused_merge and self.kind not in ("mla_paged_prefill", "gqa_paged_prefill"):
            return ("fused_merge: a knob of the MLA and GQA prefill kernels (the GQA decode kernels always fold their "
                    "merges)")
        if self.fused_merge and self.kind == "gqa_paged_prefill" and self.arch != "sm_90a":
            return "fused_merge: built for the sm_90a GQA prefill kernel only (the sm_100a one takes the combine launch)"
        if self.eager_combine and ((self.kind, self.arch) != ("mla_paged_prefill", "sm_90a") or self.fused_merge):
            return (f"eager_combine: a knob of the sm_90a MLA kernels' combine launch, without fused_merge (kind "
                    f"{self.kind}, arch {self.arch}, fused_merge {self.fused_merge})")
        if self.bf16_partials and (bf16_partials_reason := _bf16_partials_reason(self.kind, self.arch,
                                                                                  self.fused_merge,
                                                                                  self.eager_combine)):
            return f"bf16_partials: {bf16_partials_reason}"
        if self.cluster_merge and (self.cluster_merge not in (2, 4, 8) or (self.kind, self.arch) != (
                "mla_paged_prefill", "sm_90a") or self.fused_merge or self.eager_combine or self.bf16_partials):
            return (f"cluster_merge={self.cluster_merge}: 0, or 2, 4 or 8 CTAs a cluster for the sm_90a MLA decode "
                    f"kernel, without fused_merge, eager_combine or bf16_partials (kind {self.kind}, arch {self.arch})")
        if self.cluster_merge_flags and not self.cluster_merge:
            return ("cluster_merge_flags: the run-time check of the cluster merge's shape needs cluster_merge (the "
                    "cluster size), got cluster_merge=0")
        if self.dynamic_schedule and ((self.kind, self.arch) not in DYNAMIC_SCHEDULE_KERNELS or not self.causal):
            return ("dynamic_schedule: built for the causal GQA and MLA prefill kernels (sm_90a, sm_100a) only "
                    f"(kind {self.kind}, arch {self.arch}, causal {self.causal})")
        if self.late_claim and not self.dynamic_schedule:
            return "late_claim: a knob of the self-scheduling builds (dynamic_schedule=True) only"
        if not 0 <= self.rank_major_units <= 1024 or (self.rank_major_units and not self.dynamic_schedule):
            return (f"rank_major_units={self.rank_major_units}: a unit count a CTA (0..1024) of the self-scheduling "
                    "builds (dynamic_schedule=True) only")
        if self.line_schedule and (self.kind, self.arch) not in LINE_SCHEDULE_KERNELS:
            return (f"line_schedule: built for the GQA decode kernels and the MLA kernels' one-token decode (sm_90a, "
                    f"sm_100a) only (kind {self.kind}, arch {self.arch})")
        if self.scan_ids_per_thread not in (1, 2, 4, 8, 16) or (self.scan_ids_per_thread > 1
                                                                  and not self.line_schedule):
            return (f"scan_ids_per_thread={self.scan_ids_per_thread}: 1, 2, 4, 8 or 16 page ids in flight a thread, "
                    "a knob of the line builds (line_schedule=True) only")
        if self.uniform_line and not self.line_schedule:
            return "uniform_line: a knob of the line builds (line_schedule=True) only"
        if self.page_boxes and ((self.kind, self.arch) != ("mla_paged_prefill", "sm_90a")
                                or self.page_size < self.kv_tile):
            return (f"page_boxes: a knob of the sm_90a MLA kernels' TMA K stages at pages of >= kv_tile keys "
                    f"(kind {self.kind}, arch {self.arch}, page_size {self.page_size}, kv_tile {self.kv_tile})")
        if self.tile_q_rows not in (8, 16, 64, 128):
            return (f"tile_q_rows={self.tile_q_rows} must be 64 or 128 (one or two MMA warpgroups of 64 rows), or 8 "
                    "or 16 (one query token's heads as the N of a swapped product: the MLA decode kernel)")
        if not _is_pow2(self.kv_tile) or not 16 <= self.kv_tile <= 256:
            return f"kv_tile={self.kv_tile} must be a power of two in 16..256"
        if self.ctas_per_sm < 1:
            return f"ctas_per_sm={self.ctas_per_sm} must be >= 1"
        return spec.shape_reason(self)


def gqa_shape_reason(config: PagedAttentionConfig) -> str | None:
    """The shape rules of the GQA kinds (prefill and decode): one head_dim for q, k and v; paged pages."""
    if config.head_dim_qk != config.head_dim_v or config.head_dim_qk not in _GQA_HEAD_DIMS:
        return (f"GQA head_dim must be one of {_GQA_HEAD_DIMS} for q, k and v, got "
                f"{(config.head_dim_qk, config.head_dim_v)}")
    if not _is_pow2(config.page_size) or config.page_size > 128:
        return f"page_size={config.page_size} must be a power of two <= 128"
    if config.share_scores or config.score_warpgroup:
        knob = "share_scores" if config.share_scores else "score_warpgroup"
        return f"{knob} is a variant of the sm_90a MLA prefill kernel only"
    return None


#: ``PagedAttentionConfig.early_dependents`` of every default config. Why: without it the combine launch (device
#: plans always make one) is dispatched only when the attention grid completes; device-planned GQA prefill ran 1.2-3.2
#: us behind the host plan of the same tiles in session 17 with the combine's grid already capped. Built in session
#: 17, not run on a GPU: False until its A/B (``tools/ab_policy.py early_dependents``)
EARLY_DEPENDENTS = False


#: ``PlanConfig.even_pieces`` of every default config: device plans cut a batch of equal one-tile requests in even
#: pieces, as host plans do, not where the line's edges fall (MLA decode 64 x 8192: halves, 128 partials, not 3
#: pieces a request; GQA decode 16 x 2048: 128 items, not 186). H200, session 19 (``tools/ab_policy.py
#: even_pieces``, one process), device-planned call off -> on, us: MLA decode 64 x 8192 160.5 -> 157.2 (page 64),
#: 162.9 -> 160.1 (page 1); decode 1 x 3232 13.4 -> 10.1, 16 x 2048 31.1 -> 28.1 (page 64); the device-planned call
#: now equals the host-planned one on every such row
EVEN_PIECES = True


#: ``PlanConfig.max_slack_keys`` of every default config (0: the slacks stay W / 32 and W / 8, uncapped). Built in
#: session 19, not run on a GPU: the device plan of MLA prefill 16K takes whole-tile cuts 3.1% above the mean (the
#: host LPT 0.1%; session 19's bench: device-planned 8414 against 8181 us planned); capped at 1024 keys the cuts
#: split it, 1.004 with 102 merges, and no other bench row's device plan changes (the twin, on the CPU)
MAX_SLACK_KEYS = 0


#: ``PlanConfig.rank_deal_max_q_tiles`` of every causal default config (0: off). Built in session 24: the device
#: planner ranks the q tiles of a small batch past its sort's keys (``kernels/common/rank_sort.py``), so MLA prefill
#: 1 x 16384 (4096 q tiles) is dealt instead of cut (the twin's busiest CTA 1.0315 -> 1.0024 of the mean); no other
#: bench row's plan changes. H200, session 25: correct (GPU tests, sanitizer), but its A/B stayed within the +-1%
#: the same plan moves between arms (device-planned 8021 -> 8137 us, default 8083 -> 8116): off
RANK_DEAL_MAX_Q_TILES = 0


#: The kinds whose default configs' plans take ``PlanConfig.deal_first``: device plans make the sorted deal before
#: the cuts and keep it with no cuts made when its busiest CTA is within W + W / 8 (``plan_partition.deals_first``),
#: so the planning CTA skips its cuts phase, their vote and the partial slots' scan on the batches the deal takes.
#: Session 25: no plan of the bench's 66 prefill and MLA prefill rows or of 400 drawn batches changes (the twin), 49
#: of the 66 skip the cuts. H200 (``tools/ab_policy.py deal_first``, 200 runs, twice): the planner in-kernel at GQA
#: prefill 8 x 992 12.54 -> 11.10 us, its default call 170.1 -> 168.1 / 168.4 us (4 x 512 / 4096 -1.9, h20 8 x 992
#: -1.5; 1 x 992 at h16/kv1, which cuts first, +0.6); MLA prefill's planner is faster too (the seed 10.56 -> 8.70 us
#: in-kernel) but its default calls ran +1.1..+1.4 us slower (the seed, 1 / 1028); the deal's code at one call site
#: (``device_planner.DEAL_ONE_SITE``) took back 0.5 us of that; the rest is not understood yet: MLA stays off
DEAL_FIRST_KINDS = ("gqa_paged_prefill",)


#: The kinds whose default configs' plans take ``PlanConfig.lap_turn``: the sorted deal rotates each lap's CTA order
#: past the CTAs that drew the last lap's longest cost (``plan_partition.turned_deal``) instead of the serpentine's
#: fixed turn, where that balances better, in deals of at most ``LAP_TURN_MAX_LAPS`` laps. Session 27 (per-CTA
#: stamps): at GQA prefill 8 x 992 the serpentine's busiest CTA (72 kv tiles against a mean of 65.9) ends 149.3 us
#: after the release, the lap deal's 140.4. Session 28 (H200, ``tools/ab_policy.py lap_turn``, 100 runs, the landed
#: build): the default call 8 x 992 169.7 -> 160.0 us, 4 x 992 91.8 -> 89.2, 16 x 992 303.1 -> 300.0; device-planned
#: 152.8 -> 144.6, 79.5 -> 76.1, 284.9 -> 278.2 (an earlier build: h16/kv1 79.4 -> 76.0, h20 101.2 -> 99.6). The
#: planner pays 3.3 k cycles for it at 4 x 992, 6.4 k at 16 x 992 (``docs/perf/h200-lap-turn.json``)
LAP_TURN_KINDS: tuple = ("gqa_paged_prefill",)


#: The kinds whose default call's planner-free route (``dynamic_schedule``) builds with ``late_claim``: the load role
#: claims its next unit after the current unit's last key tile is issued, not as its loads begin, so the longest units
#: do not pair up on the first CTAs at one or two units a CTA (``tools/dynamic_schedule_model.py --claim``). Session
#: 37 (H200; GPU tiers, memcheck and racecheck clean; ``tools/ab_policy.py late_claim``, 50 runs, early -> late, the
#: default call): GQA prefill 1 x 992 29.4 -> 24.8 us, ragged 12 122.7 -> 105.9, h5/kv1 8 x 992 39.4 -> 36.9, many-unit
#: rows within run noise (8 x 992 144.8 -> 141.6); MLA prefill (one unit a CTA) 1 / 1028 61.3 -> 47.9, 20 / 3842
#: 103.0 -> 91.4, the seed 38.5 -> 36.8 (``docs/perf/h200-late-claim.json``)
SELF_SCHEDULING_KINDS = ("gqa_paged_prefill", "mla_paged_prefill")  # the kinds with a dynamic_schedule build
#: (kind, arch) of the kernels with a ``line_schedule`` build (the MLA decode entry's one-token configs are the MLA
#: prefill kind's: the swapped decode kernel on sm_90a, the 64-row tile on sm_100a)
LINE_SCHEDULE_KERNELS = (("gqa_paged_decode", "sm_90a"), ("gqa_paged_decode", "sm_100a"),
                         ("mla_paged_prefill", "sm_90a"), ("mla_paged_prefill", "sm_100a"))
LATE_CLAIM_KINDS: tuple[str, ...] = SELF_SCHEDULING_KINDS


@contextlib.contextmanager
def late_claim_policy(enabled: bool = True):
    """Inside the block both causal prefill kinds' planner-free routes claim late (or, off, early) whatever
    ``LATE_CLAIM_KINDS`` says (GPU tests, A/Bs, sanitizer cases)."""
    from .ops import policy

    with policy(globals(), LATE_CLAIM_KINDS=SELF_SCHEDULING_KINDS if enabled else ()):
        yield


#: Page ids a thread of a line build checks per pass (``PagedAttentionConfig.scan_ids_per_thread``), the default
#: call's, by the CTAs' share of ``kv_indices`` (its length, a shape: no index is read): ``LINE_SCAN_BATCHED_IDS``
#: (the batched scan, its first chunk loaded at the kernel's entry) from ``LINE_SCAN_BATCHED_MIN_IDS_PER_CTA`` ids a
#: CTA (about two passes of one id a thread), else 1. Session 41 (H200, ``tools/ab_policy.py line_scan``, one process,
#: default call 1 -> 8 ids a pass, us; ``docs/perf/h200-line-scan.json``): the rows of 3+ passes gain, MLA decode page
#: 1 the ragged 64 333.0 -> 325.5 (plan-once 319.1), 64 x 8192 165.2 -> 162.6, 128 x 4096 161.7 -> 158.8, GQA 128 x
#: 4096 269.5 -> 266.1, the ragged 37 104.4 -> 103.1, 64 x 2048 81.5 -> 80.9; the rows under one pass (every page-64
#: row, page 1 up to 16 x 4096) lose +0.1..+0.8 (MLA ragged 64 page 64 +1.5), so they keep 1
LINE_SCAN_BATCHED_IDS = 8
LINE_SCAN_BATCHED_MIN_IDS_PER_CTA = 512
#: None: by the share (above); a count: every line build's (``line_scan_policy``: GPU tests, A/Bs, sanitizer cases)
LINE_SCAN_IDS_PER_THREAD: int | None = None


#: The kinds whose default-call line builds take a uniform batch's closed form (``PagedAttentionConfig.uniform_line``;
#: the MLA decode's line build is the one-token ``mla_paged_prefill`` config). Session 42's A/B (H100, one process,
#: default call, off -> on, ``docs/perf/h100-line-uniform.json``): GQA decode faster on all 16 uniform rows (-0.4..-1.6
#: us; pages 64 and 1, h20/kv4 and h8/kv1, 1..128 requests), its ragged controls -0.3..+0.8; MLA decode mixed (-0.7 to
#: +0.6: the 1- and 2-request rows slower, 16 x 4096 page 1, 64 x 8192 and 128 x 4096 faster), so GQA only
LINE_UNIFORM_KINDS: tuple[str, ...] = ("gqa_paged_decode",)
LINE_BUILD_KINDS = ("gqa_paged_decode", "mla_paged_prefill")


@contextlib.contextmanager
def line_uniform_policy(enabled: bool = True):
    """Inside the block the default call's line builds of both kinds take (or, off, none takes) the uniform closed
    form, whatever ``LINE_UNIFORM_KINDS`` says (GPU tests, A/Bs, sanitizer cases)."""
    from .ops import policy

    with policy(globals(), LINE_UNIFORM_KINDS=LINE_BUILD_KINDS if enabled else ()):
        yield


def line_scan_ids(page_ids: int, num_ctas: int) -> int:
    """Page ids a pass of the default call's line build over ``page_ids`` ids (``len(kv_indices)``) on ``num_ctas``
    CTAs (the policy above)."""
    if LINE_SCAN_IDS_PER_THREAD is not None:
        return LINE_SCAN_IDS_PER_THREAD
    return LINE_SCAN_BATCHED_IDS if page_ids >= LINE_SCAN_BATCHED_MIN_IDS_PER_CTA * max(num_ctas, 1) else 1


@contextlib.contextmanager
def line_scan_policy(ids_per_thread: int):
    """Inside the block the default call's line builds check ``ids_per_thread`` page ids a pass (GPU tests, A/Bs,
    sanitizer cases)."""
    from .ops import policy

    with policy(globals(), LINE_SCAN_IDS_PER_THREAD=int(ids_per_thread)):
        yield


#: The kinds whose planner-free route (``dynamic_schedule``) builds with ``rank_major_units`` =
#: ``RANK_MAJOR_MAX_UNITS_PER_CTA``: a uniform batch of few units a CTA is taken longest first across its requests.
#: Session 39 (H200; GPU tier 15 passed; ``tools/ab_policy.py rank_major``, one process, page 64, default call off ->
#: on, us): h5/kv1 8 x 992 36.6 -> 32.1 (plan-once 30.9), h6/kv1 39.8 -> 34.8 (33.8); rows the model ties 8 x 128 /
#: 2048 62.1 -> 63.2, 4 x 512 / 4096 216.1 -> 217.4, the request-major control 8 x 992 141.7 -> 142.5
#: (``docs/perf/h200-rank-major.json``). GQA only: the MLA route's A/B has not run
RANK_MAJOR_KINDS: tuple[str, ...] = ("gqa_paged_prefill",)
RANK_MAJOR_MAX_UNITS_PER_CTA = 4  # 8 x 992 at h5/kv1 is 2.4, h16/kv1 7.5 (request-major there models 1.02x)


@contextlib.contextmanager
def rank_major_policy(enabled: bool = True):
    """Inside the block both causal prefill kinds' planner-free routes take uniform batches of few units a CTA
    rank-major (or, off, request-major) whatever ``RANK_MAJOR_KINDS`` says (GPU tests, A/Bs, sanitizer cases)."""
    from .ops import policy

    with policy(globals(), RANK_MAJOR_KINDS=SELF_SCHEDULING_KINDS if enabled else ()):
        yield


#: The kinds whose host plans (``plan_*()``, and the plan a ``check_indices=True`` call caches) launch the planner-free
#: build (``dynamic_schedule``, with the kind's ``late_claim``) in place of their work items, for a batch the default
#: call would route there and where the cost model, which the host plan can run on the lengths, says the build is no
#: slower (``plan_units.self_schedule_wins``: at least ``ROUTE_PLAN_MIN_UNITS_PER_CTA`` units a CTA, the modelled
#: busiest CTA no higher than the plan's). Why: at many units a CTA the route beats the plan's kernel. Session 42's
#: same-process A/B of the plan-once call (H100, ``docs/perf/h100-route-plans.json``): GQA prefill 8 x 992
#: 146.4 -> 142.0 us, 32 x 992 561.5 -> 532.9, 4 x 512 / 4096 221.2 -> 217.5, h32/kv16 8 x 992 170.2 -> 150.1, MLA
#: 1 x 16384 8727 -> 8474; the rows the rule passes up unchanged (h5/kv1 and h6/kv1, which the rank-major model alone
#: took, ran +0.9 us there: the rule now asks the request-major model too)
ROUTE_PLAN_KINDS: tuple[str, ...] = SELF_SCHEDULING_KINDS
ROUTE_PLAN_MIN_UNITS_PER_CTA = 2
ROUTE_PLAN_MAX_UNITS = 16384  # the model's host time, ~0.5 us a unit, stays under ~9 ms (32 x 992: 7936 units, ~4 ms)


@contextlib.contextmanager
def route_plan_policy(enabled: bool = True):
    """Inside the block both causal prefill kinds' host plans may launch the planner-free build (or, off, never do)
    whatever ``ROUTE_PLAN_KINDS`` says (GPU tests, A/Bs)."""
    from .ops import policy

    with policy(globals(), ROUTE_PLAN_KINDS=SELF_SCHEDULING_KINDS if enabled else ()):
        yield


@contextlib.contextmanager
def lap_turn_policy(enabled: bool = True):
    """Inside the block GQA prefill default configs' plans take ``lap_turn=enabled`` (GPU tests, A/Bs)."""
    from .ops import policy

    with policy(globals(), LAP_TURN_KINDS=("gqa_paged_prefill",) if enabled else ()):
        yield


@contextlib.contextmanager
def deal_first_policy(enabled: bool = True):
    """Inside the block every causal default config's plans take ``deal_first=enabled`` (GPU tests, A/Bs)."""
    from .ops import policy

    with policy(globals(), DEAL_FIRST_KINDS=("gqa_paged_prefill", "mla_paged_prefill") if enabled else ()):
        yield


@contextlib.contextmanager
def rank_deal_policy(most: int = 4096):
    """Inside the block every causal default config's plans take ``rank_deal_max_q_tiles=most`` (GPU tests, A/Bs)."""
    from .ops import policy

    with policy(globals(), RANK_DEAL_MAX_Q_TILES=int(most)):
        yield


@contextlib.contextmanager
def max_slack_keys_policy(keys: int):
    """Inside the block every default config's plans take ``max_slack_keys=keys`` (A/Bs, GPU tests, sanitizer)."""
    from .ops import policy

    with policy(globals(), MAX_SLACK_KEYS=int(keys)):
        yield


@contextlib.contextmanager
def even_pieces_policy(on: bool):
    """Inside the block every default config's plans take ``even_pieces=on`` (A/Bs, GPU tests, sanitizer cases)."""
    from .ops import policy

    with policy(globals(), EVEN_PIECES=bool(on)):
        yield


@contextlib.contextmanager
def early_dependents_policy(on: bool):
    """Inside the block every default config takes ``early_dependents=on`` (A/Bs, GPU tests, sanitizer cases)."""
    from .ops import policy  # the spec policies' save / clear caches / restore

    with policy(globals(), EARLY_DEPENDENTS=bool(on)):
        yield


#: ``PagedAttentionConfig.bf16_partials`` of every default config where a kernel builds it. Why: the split items of
#: a batch end together and store their fp32 partials at once (MLA decode page 64 16 x 4096: 128 CTAs x 32 KiB at the
#: tail), and the combine that follows reads them all back: ~4 us of 34.3 where fa3 takes 34.2 in all. Measured,
#: session 21 (H200, one process, ``tools/ab_policy.py bf16_partials``; GPU tests 30 passed, memcheck/racecheck clean):
#: within noise, planned page 64 / page 1, us: MLA decode 16 x 4096 34.7 -> 34.2 / 35.3 -> 35.0, 64 x 8192 158.3 ->
#: 157.9 / 160.8 -> 160.4, 1 x 4096 15.8 -> 15.9 / 15.6 -> 15.8; device-planned within +-0.1; MLA prefill and GQA
#: prefill rows with merges +-0.8. The partials are written to and read from L2 (4 MiB at 16 x 4096): their bytes
#: are not what the tail waits on (prediction was 16 x 4096 -0.7). Off
BF16_PARTIALS = False


def _bf16_partials_reason(kind: str, arch: str, fused_merge: bool, eager_combine: bool) -> str | None:
    if arch != "sm_90a" or kind not in ("mla_paged_prefill", "gqa_paged_prefill"):
        return f"built for the sm_90a MLA and GQA prefill kernels only (kind {kind}, arch {arch})"
    if fused_merge or eager_combine:
        return "the in-kernel fold and the eager combine read fp32 partials (fused_merge / eager_combine must be off)"
    return None


@contextlib.contextmanager
def bf16_partials_policy(on: bool):
    """Inside the block every default config that can takes ``bf16_partials=on`` (A/Bs, GPU tests, sanitizer)."""
    from .ops import policy

    with policy(globals(), BF16_PARTIALS=bool(on)):
        yield


def default_paged_config(kind: str, *, arch: str, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
                         head_dim_v: int, page_size: int, causal: bool, spec=None) -> PagedAttentionConfig:
    """The tuned tile geometry for a problem: the kind's policy (``OpSpec.default_tiles``; the tuning notebooks
    print lines for it), or ``spec``'s (an entry's own policy over the same kind, e.g. MLA decode's one-token
    tiles). Raises ValueError for an unknown kind."""
    from .ops import get_spec

    policy = (spec or get_spec(kind)).default_tiles
    tiles = policy(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size)
    if BF16_PARTIALS and _bf16_partials_reason(kind, arch, tiles.get("fused_merge", False),
                                               tiles.get("eager_combine", False)) is None:
        tiles = {**tiles, "bf16_partials": True}
    return PagedAttentionConfig(
        arch=arch, kind=kind, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_v, page_size=page_size, causal=causal, **{"early_dependents": EARLY_DEPENDENTS, **tiles},
    )
