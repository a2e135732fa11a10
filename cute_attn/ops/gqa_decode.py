"""gqa_paged_decode: one query token per request against its whole paged KV cache (no mask).

The FlashInfer-Bench definition ``gqa_paged_decode_h20_kv4_d128_ps64`` (Qwen3-14B at TP2, group 5) and its family.
"""

from __future__ import annotations

import contextlib

from .. import reference, testing, validate
from ..api import DevicePlan, plan_for, run
from ..config import gqa_shape_reason
from . import OpSpec, policy

ARG_NAMES = ("q", "k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_last_page_len", "sm_scale", "output", "lse")
#: Device plans of decode deal whole tiles in line order when no worse than the contiguous cuts (``PlanConfig.line_deal``)
#: at these page sizes, and at any page size when a request has at least ``LINE_DEAL_MIN_KV_HEADS`` KV heads. Why: the
#: cuts give a CTA one request's KV heads in turn, the host LPT puts a request's heads on neighbouring CTAs at once,
#: so a cache row's heads are read together. Measured on the H200 (session 16, ``tools/ab_policy.py line_deal``, one
#: process; ``docs/perf/h200-line-deal.json``), device-planned call: page 1, 64 x 2048 h20/kv4 82.5 -> 77.5 us (host
#: plan 77.6), h24/kv8 153.0 -> 142.4, h32/kv16 279.5 -> 270.7; faster on 31 of 33 rows at pages 2..128 (up to
#: -27.5 us). But the deal's vote and laps cost the planner ~1.8 k cycles (~1 us: decode 64 x 2048 in-kernel 7.3 ->
#: 8.7 us), so the default call (a device plan every call) lost 0.4-1.6 us at pages >= 4 with 4 KV heads (the
#: seed's h20/kv4 page 64: 81.9 -> 82.8) and won with 8 or 16 (64 x 2048 h32/kv16 up to -3 us, 128 x 4096 up to
#: -23.7) and at pages 1 and 2 with any (h20/kv4 page 2 -3.9, page 1 -3.4)
LINE_DEAL_PAGE_SIZES: tuple[int, ...] = (1, 2)
LINE_DEAL_MIN_KV_HEADS: int | None = 8  # None: by page size only


DEFAULT_LINE_DEAL = (LINE_DEAL_PAGE_SIZES, LINE_DEAL_MIN_KV_HEADS)  # as landed (line_deal_policy changes the above)


def line_deals(page_size: int, num_kv_heads: int, policy_now: bool = True) -> bool:
    """Whether device plans of decode at this page size and KV head count take the line deal (the policy above, or
    with ``policy_now=False`` the landed one: what the planner-free decode's builds bake in)."""
    page_sizes, min_heads = (LINE_DEAL_PAGE_SIZES, LINE_DEAL_MIN_KV_HEADS) if policy_now else DEFAULT_LINE_DEAL
    return page_size in page_sizes or (min_heads is not None and num_kv_heads >= min_heads)


@contextlib.contextmanager
def line_deal_policy(page_sizes, min_kv_heads: int | None = None):
    """Inside the block device plans of decode take the line deal at ``page_sizes`` (and at any page size from
    ``min_kv_heads`` KV heads; None: by page size only) whatever the module's policy says (the GPU tier, A/Bs)."""
    with policy(globals(), LINE_DEAL_PAGE_SIZES=tuple(page_sizes), LINE_DEAL_MIN_KV_HEADS=min_kv_heads):
        yield


def check(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None, *,
          check_indices: bool = True) -> tuple[validate.PagedProblem, validate.HostIndices | None]:
    """Rules of ``gqa_paged_decode``: one query per request, so ``q.shape[0]`` is the batch size."""
    batch, num_pages, page_size, num_kv_heads, head_dim = validate.check_paged_gqa_common(
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len
    )
    validate.check_dim("q", q, 0, batch, "batch_size = len(kv_indptr) - 1")
    validate.check_sm_scale(sm_scale)
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, kv_indptr=kv_indptr, kv_indices=kv_indices,
                 kv_last_page_len=kv_last_page_len)
    device = validate.same_device(named)
    num_qo_heads = q.shape[1]
    validate.check_outputs(output, lse, batch, num_qo_heads, head_dim, device, named)
    problem = validate.PagedProblem(batch, batch, num_qo_heads, num_kv_heads, head_dim, head_dim, page_size,
                                    num_pages, device, num_kv_slots=kv_indices.shape[0] * page_size)
    host = None
    if check_indices:
        host = validate.paged_indices(None, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, batch)
    return problem, host


# Unrolled on purpose: the fast path calls this once per call (api.py explains what each field stands for).
def signature(q, k, v, kvp, kvi, last, sm_scale):
    return (q.__class__, q.shape, q.is_contiguous(), q.dtype, q.device,
            k.__class__, k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
            v.__class__, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
            kvp.__class__, kvp.shape, kvp.is_contiguous(), kvp.dtype, kvp.device, kvp.data_ptr(), kvp._version,
            kvi.__class__, kvi.shape, kvi.is_contiguous(), kvi.dtype, kvi.device, kvi.data_ptr(), kvi._version,
            last.__class__, last.shape, last.is_contiguous(), last.dtype, last.device, last.data_ptr(), last._version)


#: sm_90a page sizes whose row gathers (pages 1, 2) run on a producer warpgroup, a quarter of every stage's rows a warp
#: (``PagedAttentionConfig.gather_warps`` 4), instead of the one producer warp. Why: under ncu (session 22, 64 x 2048
#: h20/kv4, ``docs/perf/h200-ncu-decode-p1-p64.txt``) page 1 ran 73.1 us against page 64's 67.4 for the same DRAM
#: bytes and executed 3.3 M more warp instructions, about what the one producer warp issues (~418 a 64-key stage),
#: while the consumers waited on it. Measured in session 23 (``tools/ab_policy.py gather_warps``,
#: ``docs/perf/h200-gather-warps.json``), planned 64 x 2048: page 1 h20/kv4 78.7 -> 75.7 us, h24/kv8 144.9 -> 138.2,
#: h32/kv16 276.2 -> 264.8; page 2 alike
GATHER_WARPS_PAGE_SIZES: tuple[int, ...] = (1, 2)


@contextlib.contextmanager
def gather_warps_policy(page_sizes):
    """Inside the block sm_90a decode configs (both decode kinds) at ``page_sizes`` gather rows with four warps
    whatever ``GATHER_WARPS_PAGE_SIZES`` says (the GPU tier, sanitizer cases, A/Bs)."""
    with policy(globals(), GATHER_WARPS_PAGE_SIZES=tuple(page_sizes)):
        yield


def default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> dict:
    """The group's heads are the rows of one 64-row M tile; one page is one ring stage (kv_tile = page_size)
    for pages of 16..128 keys, and smaller pages (1, 2, 4, 8) fill a 64-key stage with 64 / page_size page
    boxes; split chunks >= 256 keys (with the merge fused into the kernel, batch 1 x 3232
    is fastest at 128-256: docs/perf/h200-decode-variants.json).

    sm_90a page 16: a 64-key stage of four page boxes, not one page per stage (H200, 64 x 2048: one page per stage
    81.5 us, page 8's stages of eight boxes 74.6, page 64 74.6; docs/perf-history.md, session 7).
    The sm_100a kernel builds page 16 one page per step only."""
    tiles = dict(tile_q_rows=64, kv_tile=64, min_chunk_keys=256)
    if 16 <= page_size <= 128 and not (arch == "sm_90a" and page_size == 16):
        tiles.update(kv_tile=page_size)
    if arch == "sm_90a" and page_size in GATHER_WARPS_PAGE_SIZES:
        tiles.update(gather_warps=4)
    return tiles


#: The default call (no plan) of decode runs the ``line_schedule`` build (``kernels/common/line_schedule.py``: every CTA
#: derives its own stretch of the device plan's cost line, the line deal included; no planner launch, no plan buffers)
#: where the kernel builds it (every page size; sm_90a) and the batch fits its table. Session 39 (H200; GPU tiers 42
#: passed, memcheck / racecheck clean on six cases; ``tools/ab_policy.py line_schedule``, one process, default call off
#: -> on, us): h20/kv4 page 64 64 x 2048 82.5 -> 78.9, 128 x 4096 266.1 -> 260.9, ragged 37 107.3 -> 100.9; h8/kv1
#: 16 x 2048 19.2 -> 15.1; page 16 alike (``docs/perf/h200-line-schedule.json``). The bench beside FlashInfer: cold -
#: warm span +2.5..+3.6 us on the seed's four rows (+6.3..+7.1 on the device planner)
LINE_SCHEDULE = True
LINE_SCHEDULE_ARCHS = ("sm_90a",)


def self_schedule(config, problem, num_ctas: int) -> bool:
    """``OpSpec.self_schedule``: the ``line_schedule`` build for this default call (the policy above)."""
    if not LINE_SCHEDULE or config.arch not in LINE_SCHEDULE_ARCHS:
        return False
    import dataclasses

    line = dataclasses.replace(config, line_schedule=True)
    if line.can_implement() is not None:
        return False
    if config.arch == "sm_90a":
        from ..kernels.sm90.gqa_decode import line_capacity
    else:
        from ..kernels.sm100.decode_config import line_capacity
    requests, threads = line_capacity(line)
    return problem.batch_size <= requests and num_ctas + 1 <= threads


@contextlib.contextmanager
def line_schedule_policy(enabled: bool):
    """Inside the block the default call of decode takes (or never takes) the ``line_schedule`` build whatever
    ``LINE_SCHEDULE`` says (GPU tests, A/Bs, sanitizer cases)."""
    with policy(globals(), LINE_SCHEDULE=bool(enabled)):
        yield bool(enabled)


def shape_reason(config) -> str | None:
    if (reason := gqa_shape_reason(config)) is not None:
        return reason
    if config.group_size > config.tile_q_rows:
        return f"decode packs the group ({config.group_size}) into one M tile of {config.tile_q_rows} rows"
    return None


def strategy():
    """Decode cases: ragged lengths, empty requests, one long request (splits and the fused merge)."""
    return testing.decode_batches().map(lambda kv_lens: {"kv_lens": kv_lens})


SPEC = OpSpec(
    name="gqa_paged_decode", arg_names=ARG_NAMES, index_names=("kv_indptr", "kv_indices", "kv_last_page_len"),
    causal=False, check=check, signature=signature, reference=reference.gqa_paged_decode_ref,
    make_case=testing.make_gqa_decode_case, strategy=strategy, default_tiles=default_tiles, shape_reason=shape_reason,
    kernel_modules={"sm_90a": ".kernels.sm90.gqa_decode", "sm_100a": ".kernels.sm100.gqa_decode"},
    self_schedule=self_schedule, self_schedule_knobs={"line_schedule": True},
    self_schedule_policy=lambda: LINE_SCHEDULE,
    self_schedule_when_reused=False,
)


def gqa_paged_decode(
    q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = False, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """GQA decode over a paged KV cache: one query token per request. Returns ``(output, lse)``.

    Shapes and dtypes (NHD, row-major; every index tensor int32 on the same CUDA device):
        q                 [batch, num_qo_heads, head_dim]            bf16, contiguous
        k_cache, v_cache  [num_pages, page_size, num_kv_heads, head_dim] bf16; pages may be strided
                          (16-byte aligned page stride and base: ``kv[:, 0]`` / ``kv[:, 1]`` of one tensor work)
        kv_indptr         [batch + 1]   page offsets into kv_indices; kv_indptr[0] == 0, non-decreasing
        kv_indices        [kv_indptr[-1]] page ids in [0, num_pages)
        kv_last_page_len  [batch]       keys in each request's last page: 1..page_size (0 for no pages)
        sm_scale          Python float > 0 (logits are sm_scale * q . k)
        output, lse       optional destinations: [batch, num_qo_heads, head_dim] bf16 and [batch, num_qo_heads]
                          fp32, written in place (else allocated and returned)
    Query head h reads KV head ``h // (num_qo_heads // num_kv_heads)``. ``lse`` is base 2 (FlashInfer's
    convention) unless ``natural_lse=True``. A request with no keys gets output 0 and lse -inf.

    Supported (sm_90a runs on Hopper; sm_100a is compiled and PTX-checked only, never run here): any GQA ratio
    whose group fits 64 rows, head_dim 64 / 128 / 256, page sizes 1..128 (powers of two; sm_100a: the same but
    page 128 with head_dim 256, which overflows its 512 TMEM columns).
    A shape no kernel builds raises ValueError with the kernel's reason before any work. Needs a CUDA GPU.

    Plans: without ``plan=``, the call plans (reading the index tensors: one host sync) and caches the plan on
    the index tensors' identity, data pointer and version counter, so the next call with the same, unmodified
    index tensors (every layer of a step) reuses it; a repeated call takes a fast path that skips re-validation.
    Engines can plan once per batch with :func:`plan_gqa_paged_decode` and pass ``plan=`` to every layer (with
    ``check_indices=False`` to skip re-reading the index values). A plan may serve several CUDA streams at once
    (its split-KV scratch is kept per stream); under ``torch.inference_mode`` index tensors have no version
    counter, so each call plans afresh.
    """
    return run(SPEC, (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
               (kv_indptr, kv_indices, kv_last_page_len), output, lse, plan, check_indices, natural_lse, arch, num_sms)


def plan_gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                          *, arch: str | None = None, num_sms: int | None = None, on_device: bool = False) -> DevicePlan:
    """Validate and plan one decode batch (reads the index tensors: one host sync) for ``plan=``.

    Takes the arguments of :func:`gqa_paged_decode` (outputs omitted); the plan holds the work lists and the
    split-KV scratch on the inputs' device and serves every layer with the same batch (same index tensors and
    shapes; other q / caches / outputs are fine). A shape no kernel builds raises ValueError before planning.
    """
    return plan_for(SPEC, (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
                    arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["SPEC", "gqa_paged_decode", "plan_gqa_paged_decode", "check"]
