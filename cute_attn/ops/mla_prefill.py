"""mla_paged_prefill: causal absorbed-MLA prefill over a paged latent cache (DeepSeek-V3/R1).

The FlashInfer-Bench definitions ``mla_paged_prefill_causal_h16_ckv512_kpe64_ps1`` and ``..._ps64``: every head
shares one latent KV row per key; logits are the ckv + kpe wide dot product and V is ckv itself. The ps64
definition adds ``kv_last_page_len`` before ``sm_scale``; the entry takes both orders (``page_size_1_order``), and
the spec's functions take 8 inputs (ps1 order) or 9 (``kv_last_page_len`` possibly None at page size 1).
"""

from __future__ import annotations

import contextlib
import numbers

import numpy as np
import torch

from .. import reference, testing, validate
from ..api import DevicePlan, plan_for, run
from . import OpSpec, policy, shapes_promise_units

ARG_NAMES = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
             "sm_scale", "output", "lse")
MLA_DIMS = (576, 512)  # (ckv + kpe, ckv)


def page_size_1_order(kv_last_page_len, sm_scale, output, lse) -> tuple:
    """``(kv_last_page_len, sm_scale, output, lse)`` of a call in either FlashInfer-Bench order.

    The ps64 definitions pass ``kv_last_page_len`` before ``sm_scale``; the ps1 ones have none. A number where
    ``kv_last_page_len`` goes is the ps1 order's ``sm_scale``: the arguments after it move up one place."""
    if kv_last_page_len is None or isinstance(kv_last_page_len, torch.Tensor) \
            or not isinstance(kv_last_page_len, numbers.Real):
        return kv_last_page_len, sm_scale, output, lse
    if lse is not None:
        raise TypeError("too many positional arguments: the page-size-1 order is (..., kv_indices, sm_scale, output, "
                        "lse), the paged one (..., kv_indices, kv_last_page_len, sm_scale, output, lse)")
    return None, kv_last_page_len, sm_scale, output


def canonical_inputs(args: tuple) -> tuple:
    """The 9 inputs ``(..., kv_indices, kv_last_page_len | None, sm_scale)`` of 8 (ps1 order) or 9 inputs."""
    if len(args) == 8:
        return (*args[:7], None, args[7])
    return tuple(args)


def check(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None, sm_scale=None,
          output=None, lse=None, *, check_indices: bool = True
          ) -> tuple[validate.PagedProblem, validate.HostIndices | None]:
    """Rules of ``mla_paged_prefill``: one latent KV (``ckv``) shared by every head, pages of 1..128 rows.

    ``kv_last_page_len`` (int32 ``[batch]``, FlashInfer-Bench's ps64 order) is required at page size > 1 and
    optional at page size 1 (then every request's key count is its page count; the ps1 order omits it)."""
    kv_last_page_len, sm_scale, output, lse = page_size_1_order(kv_last_page_len, sm_scale, output, lse)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        validate.dense(name, t, torch.bfloat16, 3)
    total_q, num_heads, ckv_dim = q_nope.shape
    if tuple(q_pe.shape[:2]) != (total_q, num_heads):
        raise ValueError(f"q_pe.shape[:2] must equal q_nope.shape[:2] {(total_q, num_heads)}, got {tuple(q_pe.shape)}")
    kpe_dim = q_pe.shape[2]
    num_pages, page_size = ckv_cache.shape[:2]
    if page_size < 1:
        raise ValueError(f"ckv_cache.shape[1] (page_size) must be >= 1, got {page_size}")
    validate.check_dim("ckv_cache", ckv_cache, 2, ckv_dim, "q_nope's head dim")
    if tuple(kpe_cache.shape) != (num_pages, page_size, kpe_dim):
        raise ValueError(f"kpe_cache must have shape {(num_pages, page_size, kpe_dim)}, got {tuple(kpe_cache.shape)}")
    if num_heads < 1:
        raise ValueError(f"q_nope must have >= 1 head, got {num_heads}")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        validate.dense(name, t, torch.int32, 1)
    batch = qo_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError("qo_indptr must have batch_size + 1 >= 1 entries")
    validate.check_dim("kv_indptr", kv_indptr, 0, batch + 1, "len(qo_indptr)")
    if kv_last_page_len is None:
        if page_size != 1:
            raise ValueError(f"kv_last_page_len is required at page_size {page_size} (ckv_cache.shape[1]): pass it "
                             "before sm_scale, as FlashInfer-Bench's paged MLA definitions do")
    else:
        validate.dense("kv_last_page_len", kv_last_page_len, torch.int32, 1)
        validate.check_dim("kv_last_page_len", kv_last_page_len, 0, batch, "batch_size = len(qo_indptr) - 1")
    validate.check_sm_scale(sm_scale)
    named = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, qo_indptr=qo_indptr,
                 kv_indptr=kv_indptr, kv_indices=kv_indices)
    if kv_last_page_len is not None:
        named["kv_last_page_len"] = kv_last_page_len
    device = validate.same_device(named)
    validate.check_outputs(output, lse, total_q, num_heads, ckv_dim, device, named)
    problem = validate.PagedProblem(batch, total_q, num_heads, 1, ckv_dim + kpe_dim, ckv_dim, page_size, num_pages,
                                    device, num_kv_slots=kv_indices.shape[0] * page_size)
    host = None
    if check_indices:
        if kv_last_page_len is not None:
            host = validate.paged_indices(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages,
                                          total_q)
            return problem, host
        qo, kvp = validate.host_ints(qo_indptr), validate.host_ints(kv_indptr)
        validate.check_indptr("qo_indptr", qo)
        if qo[-1] != total_q:
            raise ValueError(f"qo_indptr[-1] ({qo[-1]}) must equal total_q = q_nope.shape[0] ({total_q})")
        validate.check_indptr("kv_indptr", kvp)
        if kvp[-1] > kv_indices.numel():  # a longer buffer is fine (CUDA graphs: one buffer at capacity)
            raise ValueError(f"kv_indptr[-1] ({kvp[-1]}) must be at most len(kv_indices) ({kv_indices.numel()})")
        validate.check_page_ids("kv_indices", kv_indices[: int(kvp[-1])], num_pages, "token row")
        host = validate.HostIndices(qo_indptr=qo, kv_indptr=kvp, kv_lens=np.diff(kvp))
    return problem, host


# the caches are plain contiguous tensors to the rules, with no alignment rule
def signature(q_nope, q_pe, ckv, kpe, qo, kvp, kvi, *rest):
    last = rest[0] if len(rest) == 2 else None  # (kv_last_page_len, sm_scale) or (sm_scale,)
    sig = (q_nope.__class__, q_nope.shape, q_nope.is_contiguous(), q_nope.dtype, q_nope.device,
           q_pe.__class__, q_pe.shape, q_pe.is_contiguous(), q_pe.dtype, q_pe.device,
           ckv.__class__, ckv.shape, ckv.is_contiguous(), ckv.dtype, ckv.device,
           kpe.__class__, kpe.shape, kpe.is_contiguous(), kpe.dtype, kpe.device,
           qo.__class__, qo.shape, qo.is_contiguous(), qo.dtype, qo.device, qo.data_ptr(), qo._version,
           kvp.__class__, kvp.shape, kvp.is_contiguous(), kvp.dtype, kvp.device, kvp.data_ptr(), kvp._version,
           kvi.__class__, kvi.shape, kvi.is_contiguous(), kvi.dtype, kvi.device, kvi.data_ptr(), kvi._version)
    if last is None:
        return sig + (None,)
    return sig + (last.__class__, last.shape, last.is_contiguous(), last.dtype, last.device, last.data_ptr(),
                  last._version)


#: sm_90a: how the two consumer warpgroups split a tile's work, by name (the knobs of each in
#: ``SM90_CONSUMER_SPLITS``). "full_s": both compute all of S = Q K^T, each half of O (kernels/sm90/mla_prefill.py);
#: "shared_s": each computes S for half the keys, P shared through smem (``share_scores``, mla_prefill_shared_s.py);
#: "score_wg": one computes all of S and the softmax, the other only its half of O (``score_warpgroup``,
#: mla_prefill_score_wg.py); "score_wg_ovl": the same, each PV GEMM of the score warpgroup issued right before the
#: next tile's S GEMM (``intra_wg_overlap``); "score_wg_sepi": score_wg with O written through the item's last K stage (``smem_epilogue``, 16-byte stores).
#: The H200 A/B (tools/mla_prefill_variants.py) picks it: this line flips the public entries, plan_* and the
#: registered configs.
SM90_CONSUMERS = "score_wg_sepi"  # H200 A/B, session 13: 1.09-1.40x score_wg (itself 1.05-1.15x shared_s, session 12)
SM90_CONSUMER_SPLITS = {"full_s": {}, "shared_s": dict(share_scores=True), "score_wg": dict(score_warpgroup=True),
                        "score_wg_ovl": dict(score_warpgroup=True, intra_wg_overlap=True),
                        # the score_wg split with O written through the item's last K stage (16-byte stores)
                        "score_wg_sepi": dict(score_warpgroup=True, smem_epilogue=True)}
#: every knob a split sets, and its value where a split does not set it
CONSUMER_KNOBS = dict(share_scores=False, score_warpgroup=False, intra_wg_overlap=False, smem_epilogue=False)
#: sm_90a, batches of long items (:func:`keys_per_item` >= ``LONG_ITEM_KEYS``): the split without the smem epilogue.
#: Holding the item's last K stage for O costs long items more than the 16-byte stores save. H200, session 14, one
#: process, both orders: 1 / 16384 / 16387 8095-8432 us score_wg against 8745-9070 score_wg_sepi (-7%), 22 / 22 / 17759
#: (807 keys an item) 19.8 against 20.5; sepi wins at 1 / 1028 (524 keys an item: 47.3 against 52.3) and on every
#: batch of shorter items (1.09-1.45x). The threshold sits between those two measured points
SM90_LONG_ITEM_CONSUMERS = "score_wg"
LONG_ITEM_KEYS = 640
#: sm_90a: split-KV partials folded in the kernel by the last CTA of each merge (``PagedAttentionConfig.fused_merge``)
#: instead of the combine launch. Correct on the H200 (GPU tier under ``fused_merge_policy(True)``: 30 passed;
#: memcheck/racecheck clean) but slower, so off: session 15, one process (``docs/perf/h200-mla-fused-merge.json``),
#: MLA decode 64 x 8192 164.7 -> 168.4 us (page 64), 1 x 4096 18.8 -> 22.0, 16 x 4096 35.2 -> 36.9, 128 x 4096 (no
#: merges) 156.9 -> 157.3. The fold (``common/decode_merge.fold_merge``, written for GQA's 128-column rows) reads a
#: 512-column row with 4-byte loads, two slots in flight, on the one CTA that arrives last: a 16-slot merge is ~8
#: dependent L2 round trips on one SM, where the combine launch spreads the same reads over the grid
FUSED_MERGE = False
#: sm_90a, pages of >= kv_tile keys: a K stage of one page's rows as 9 kv_tile-row TMA boxes instead of 72 8-row
#: ones (``PagedAttentionConfig.page_boxes``). Built in session 19: one elected thread issues the stage, and at
#: MLA decode 16 x 4096 page 64 a CTA moved 26 GB/s against the 31 it reaches at 128 x 4096 (ncu: 59% of DRAM
#: peak over the kernel, no eligible warp 77% of cycles), so the issue chain looked part of each stage's turnaround.
#: Measured, session 20 (H200, one process, ``tools/ab_policy.py page_boxes``; GPU tests 27 passed, memcheck clean):
#: slower where it was to help, planned page 64 16 x 4096 34.4 -> 34.9 us, 64 x 8192 155.5 -> 156.3, 128 x 4096
#: 150.7 -> 151.6 (1 x 4096 15.9 -> 15.6). A 64-row box walks one 128-byte column of 64 rows 1152 bytes apart, the
#: 8-row boxes cover whole rows in order: the DRAM access order, not the issue count, is what the stage waits on. Off
PAGE_BOXES = False
#: sm_90a: the combine folds each merge as soon as its slots are in (``PagedAttentionConfig.eager_combine``; the
#: attention CTAs count their split items and release the combine launch at their start) instead of after the whole
#: attention grid: the combine was a fixed 3.8-4.4 us after the attention kernel on MLA decode page 64 (session 18,
#: ``tools/kernel_breakdown.py``: 16 x 4096 3.8 of 34.5 us, 64 x 8192 4.4 of 154.3), where fa3 takes 34.2 and 154.2
#: in all. Measured, session 20 (H200, one process, ``tools/ab_policy.py eager_combine``; GPU tests 41 passed,
#: memcheck/racecheck clean): ~1 us slower on every batch with merges, planned page 64 16 x 4096 34.5 -> 35.7 us,
#: 64 x 8192 158.2 -> 158.7, 1 x 4096 15.8 -> 16.9, MLA prefill seed 34.6 -> 35.8. Equal pieces end together, so the
#: last merge still waits for the grid's last CTA; the poll and the CTAs' fence and atomic only add. Off
EAGER_COMBINE = False


#: the default call (no plan) of causal sm_90a MLA prefill runs the self-scheduling build
#: (``PagedAttentionConfig.dynamic_schedule``: every CTA checks the batch's index rules and scans its page ids, then the
#: load role takes whole (request, q tile) units from a counter and hands each to the consumers in a ring;
#: ``common/mla.load_units``) when the shapes promise at least DYNAMIC_MIN_UNITS_PER_CTA units a CTA, or when the
#: batch is tiny (at most DYNAMIC_TINY_KEY_SLOTS key slots: its longest unit costs less than the planner); else the
#: device planner. Why: the device planner costs ~10-12 us a call, and at many units a counter over longest-first
#: units is as balanced as the host plan (``tools/dynamic_schedule_model.py``). H200, session 36 (``tools/bench.py
#: --kernel mla``, cold call minus the warm default call, cold L2, 50 runs; GPU tier, memcheck and racecheck clean):
#: planner-free / device planner: 1 / 43 / 46 (11 units) +1.6 / +10.3 us, 1 / 1028 / 1038 (257) +14.1 / +11.2,
#: 28 / 1954 / 2044 (489) +4.5 / +12.3, 20 / 3842 / 3916 (961) +12.0 / +15.8, 22 / 22 / 17759 (22) +47.9 / +8.2;
#: 56 / 8987 / 14390 (2247) default call 220 us planner-free against 278 on the device planner (plan-once 224).
#: Session 37: with ``config.LATE_CLAIM_KINDS`` the floor drops from 2 to 1 (bench beside fa3, cold - plan-once:
#: 1 / 1028 +11.2 -> +0.4 us, 20 / 3842 +12.1 -> -0.5; 22 / 22 / 17759, 22 units, stays on the device planner, +9.2)
DYNAMIC_SCHEDULE = True
DYNAMIC_MIN_UNITS_PER_CTA = 1
DYNAMIC_TINY_KEY_SLOTS = 256
#: the archs whose default call may take it: sm_100a has the twin build (``kernels/sm100/mla_prefill.py``), compiled
#: and PTX-checked only; its default call stays on the device planner until it has run on a Blackwell GPU
DYNAMIC_SCHEDULE_ARCHS = ("sm_90a",)


def self_schedule(config, problem, num_ctas: int) -> bool:
    """``OpSpec.self_schedule``: the self-scheduling build for this default call (module policy above)."""
    tiny = 0 < problem.num_kv_slots <= DYNAMIC_TINY_KEY_SLOTS
    min_units = 0 if tiny else DYNAMIC_MIN_UNITS_PER_CTA
    return DYNAMIC_SCHEDULE and shapes_promise_units(config, problem, num_ctas, min_units, DYNAMIC_SCHEDULE_ARCHS)


@contextlib.contextmanager
def dynamic_schedule_policy(enabled: bool):
    """Inside the block the default call takes (or never takes) the self-scheduling build whatever
    ``DYNAMIC_SCHEDULE`` says (A/Bs, GPU tests, sanitizer cases)."""
    with policy(globals(), DYNAMIC_SCHEDULE=bool(enabled)):
        yield bool(enabled)


def keys_per_item(problem) -> float:
    """A causal batch's mean keys a q tile sees, from shapes alone: (key slots - total_q / 2) / batch (each request's
    rows see its prefix plus, on average, half its own queries). An over-allocated ``kv_indices`` (a graph captured at
    capacity) reads as long: the other split, which is as correct and at most ~10% slower on short items."""
    return (problem.num_kv_slots - problem.total_q / 2) / max(problem.batch_size, 1)


def workload_tiles(config, problem) -> dict:
    """The consumer split for this batch: ``SM90_LONG_ITEM_CONSUMERS`` where the items are long (sm_90a, 64-row
    tiles of the split ``SM90_CONSUMERS`` names), else no change."""
    if config.arch != "sm_90a" or config.tile_q_rows != 64 or SM90_LONG_ITEM_CONSUMERS == SM90_CONSUMERS:
        return {}
    if keys_per_item(problem) < LONG_ITEM_KEYS:
        return {}
    return {**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[SM90_LONG_ITEM_CONSUMERS]}


@contextlib.contextmanager
def consumer_split(name: str):
    """Inside the block every public MLA entry (prefill, decode, plan_*) builds the sm_90a split ``name`` whatever
    ``SM90_CONSUMERS`` and ``SM90_LONG_ITEM_CONSUMERS`` say, for every batch (A/Bs, the GPU tier's fixture, sanitizer
    cases)."""
    if name not in SM90_CONSUMER_SPLITS:
        raise ValueError(f"unknown consumer split {name!r}: one of {', '.join(SM90_CONSUMER_SPLITS)}")
    with policy(globals(), SM90_CONSUMERS=name, SM90_LONG_ITEM_CONSUMERS=name):
        yield name


def default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> dict:
    """One 64-row tile of packed (token, head) rows x 64 gathered key rows (sm_90a: the consumers' split of the work
    that ``SM90_CONSUMERS`` names, and ``FUSED_MERGE``)."""
    tiles = dict(tile_q_rows=64, kv_tile=64)
    if arch == "sm_90a":
        tiles.update(SM90_CONSUMER_SPLITS[SM90_CONSUMERS], fused_merge=FUSED_MERGE,
                     page_boxes=page_boxes(page_size, tiles["kv_tile"]), eager_combine=eager_combine(FUSED_MERGE))
    return tiles


def eager_combine(fused_merge: bool) -> bool:
    """``PagedAttentionConfig.eager_combine`` of an sm_90a MLA config: ``EAGER_COMBINE`` unless the kernel folds its
    merges itself."""
    return EAGER_COMBINE and not fused_merge


@contextlib.contextmanager
def eager_combine_policy(enabled: bool):
    """Inside the block every public MLA entry (prefill, decode, plan_*) builds sm_90a configs with
    ``eager_combine=enabled`` (unless ``fused_merge``) whatever ``EAGER_COMBINE`` says (A/Bs, GPU tests, sanitizer
    cases)."""
    with policy(globals(), EAGER_COMBINE=bool(enabled)):
        yield bool(enabled)


def page_boxes(page_size: int, kv_tile: int) -> bool:
    """``PagedAttentionConfig.page_boxes`` of an sm_90a MLA config: ``PAGE_BOXES`` where a K stage is one page's
    rows."""
    return PAGE_BOXES and page_size >= kv_tile


@contextlib.contextmanager
def page_boxes_policy(enabled: bool):
    """Inside the block every public MLA entry (prefill, decode, plan_*) builds sm_90a configs at pages of >= 64
    keys with ``page_boxes=enabled`` whatever ``PAGE_BOXES`` says (A/Bs, GPU tests, sanitizer cases)."""
    with policy(globals(), PAGE_BOXES=bool(enabled)):
        yield bool(enabled)


@contextlib.contextmanager
def fused_merge_policy(enabled: bool):
    """Inside the block every public MLA entry (prefill, decode, plan_*) builds sm_90a configs with
    ``fused_merge=enabled`` whatever ``FUSED_MERGE`` says (the GPU tier and sanitizer cases of the fold before it is
    the default, A/Bs)."""
    with policy(globals(), FUSED_MERGE=bool(enabled)):
        yield bool(enabled)


def shape_reason(config) -> str | None:
    if (config.head_dim_qk, config.head_dim_v) != MLA_DIMS:
        return f"MLA head dims (qk, v) must be {MLA_DIMS}, got {(config.head_dim_qk, config.head_dim_v)}"
    if config.num_kv_heads != 1:
        return "MLA prefill shares one latent KV head (num_kv_heads 1)"
    ps = config.page_size
    if ps < 1 or ps > 128 or ps & (ps - 1):
        return f"MLA page_size={ps} must be a power of two in 1..128"
    return None


def strategy():
    """MLA cases: ragged runs with kv >= q per request, empty requests, page sizes 1, 16 and 64."""
    from hypothesis import strategies as st

    return st.tuples(testing.ragged_batches(max_q=128, max_kv=512), st.sampled_from((1, 16, 64))).map(
        lambda x: {"q_lens": x[0][0], "kv_lens": x[0][1], "page_size": x[1]})


SPEC = OpSpec(
    name="mla_paged_prefill", arg_names=ARG_NAMES, index_names=("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"),
    causal=True, check=check, signature=signature, reference=reference.mla_paged_prefill_ref,
    make_case=testing.make_mla_prefill_case, strategy=strategy, default_tiles=default_tiles, shape_reason=shape_reason,
    workload_tiles=workload_tiles, self_schedule=self_schedule,
    kernel_modules={"sm_90a": ".kernels.sm90.mla_prefill", "sm_100a": ".kernels.sm100.mla_prefill"},
)


def mla_paged_prefill(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None, sm_scale=None,
    output=None, lse=None, *, plan: DevicePlan | None = None, check_indices: bool = False, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Causal absorbed-MLA prefill over a paged latent cache. Returns ``(output, lse)``.

    Both FlashInfer-Bench argument orders: ``(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr,
    kv_indices, kv_last_page_len, sm_scale)`` (``..._ps64``) and, at page size 1, ``(..., kv_indices,
    sm_scale)`` (``..._ps1``: a number in ``kv_last_page_len``'s place is ``sm_scale``).

    Shapes and dtypes (row-major; every index tensor int32 on the same CUDA device):
        q_nope     [total_q, num_heads, 512] bf16      q_pe       [total_q, num_heads, 64] bf16
        ckv_cache  [num_pages, page_size, 512] bf16    kpe_cache  [num_pages, page_size, 64] bf16
        qo_indptr  [batch + 1]  query rows of request b: qo_indptr[b] .. qo_indptr[b+1]-1
        kv_indptr  [batch + 1]  page offsets into kv_indices
        kv_indices [kv_indptr[-1]] page ids in [0, num_pages)
        kv_last_page_len [batch] keys in each request's last page (1..page_size; 0 for a request with no page);
                   required at page_size > 1; omitted at page size 1, a request has as many keys as pages
        sm_scale   Python float > 0 (DeepSeek-V3: 0.1352337747812271)
        output, lse optional destinations [total_q, num_heads, 512] bf16 / [total_q, num_heads] fp32
    Key j of request b is slot j % page_size of page kv_indices[kv_indptr[b] + j // page_size].
    s = sm_scale * (q_nope . ckv + q_pe . kpe); output = softmax(s) @ ckv, bottom-right causal per request.
    ``lse`` is base 2 unless ``natural_lse=True``; a row that sees no key gets output 0 and lse -inf.

    Supported: 16 heads (any head count that packs into 64-row tiles), ckv 512 + kpe 64, page sizes 1, 2, 4, ...,
    128; sm_90a runs on Hopper (cp.async 16-byte row gathers), sm_100a is compiled and PTX-checked only, never run
    here. Needs a CUDA GPU. Plans: as :func:`gqa_paged_decode` (or :func:`plan_mla_paged_prefill` once, then
    ``plan=``). With ``check_indices=False`` and a ``plan=``, a page id outside ``[0, num_pages)`` is never read
    (that request's result is unspecified; the others are unaffected).
    """
    kv_last_page_len, sm_scale, output, lse = page_size_1_order(kv_last_page_len, sm_scale, output, lse)
    return run_mla(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                   output, lse, plan, check_indices, natural_lse, arch, num_sms)


def run_mla(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output,
            lse, plan, check_indices, natural_lse, arch, num_sms, spec=None):
    """``api.run`` with the MLA spec, or ``spec`` (the decode entry's one-token tiles; inputs in the canonical order,
    ``kv_last_page_len`` possibly None)."""
    inputs = (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    index = (qo_indptr, kv_indptr, kv_indices) if kv_last_page_len is None else \
        (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    return run(spec or SPEC, inputs, index, output, lse, plan, check_indices, natural_lse, arch, num_sms)


def plan_mla_paged_prefill(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None,
                           sm_scale=None, *, arch: str | None = None, num_sms: int | None = None, on_device: bool = False) -> DevicePlan:
    """Validate and plan one MLA prefill batch (reads the index tensors: one host sync) for ``plan=``."""
    kv_last_page_len, sm_scale, _, _ = page_size_1_order(kv_last_page_len, sm_scale, None, None)
    return plan_for(SPEC, (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                           sm_scale), arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["SPEC", "mla_paged_prefill", "plan_mla_paged_prefill", "check", "canonical_inputs", "page_size_1_order"]
