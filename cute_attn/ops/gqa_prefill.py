"""gqa_paged_prefill: causal (bottom-right) GQA prefill of ragged query runs against a paged KV cache.

The FlashInfer-Bench definition ``gqa_paged_prefill_causal_h32_kv4_d128_ps64`` (Qwen3-30B-A3B) and its family.
"""

from __future__ import annotations

import contextlib

import torch

from .. import reference, testing, validate
from ..api import DevicePlan, plan_for, run
from ..config import gqa_shape_reason
from ..plan import DEAL_MAX_Q_TILES_CHOICES
from . import OpSpec, policy, shapes_promise_units

ARG_NAMES = ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "sm_scale",
             "output", "lse")


def check(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
          *, check_indices: bool = True) -> tuple[validate.PagedProblem, validate.HostIndices | None]:
    """Rules of ``gqa_paged_prefill``; returns the problem and, when index values were read, their host copies."""
    batch, num_pages, page_size, num_kv_heads, head_dim = validate.check_paged_gqa_common(
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len
    )
    validate.dense("qo_indptr", qo_indptr, torch.int32, 1)
    validate.check_dim("qo_indptr", qo_indptr, 0, batch + 1, "len(kv_indptr)")
    validate.check_sm_scale(sm_scale)
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                 kv_indices=kv_indices, kv_last_page_len=kv_last_page_len)
    device = validate.same_device(named)
    total_q, num_qo_heads = q.shape[0], q.shape[1]
    validate.check_outputs(output, lse, total_q, num_qo_heads, head_dim, device, named)
    problem = validate.PagedProblem(batch, total_q, num_qo_heads, num_kv_heads, head_dim, head_dim, page_size,
                                    num_pages, device)
    host = None
    if check_indices:
        host = validate.paged_indices(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages,
                                      total_q)
    return problem, host


#: fitted to the H200's device-planned / host-planned prefill times over the bench's seven workloads (~300-380)
PREFILL_ITEM_OVERHEAD_KEYS = 320
#: sm_90a: split items' partials folded in the kernel by the last CTA of each merge (``PagedAttentionConfig.fused_merge``,
#: ``common/decode_merge.py``) instead of the combine launch, which a device plan always makes (the host cannot know
#: whether it split anything). Correct on the H200 (GPU tier: 9 passed; memcheck/racecheck clean) but no faster, so
#: off. Session 16, one process (``tools/ab_policy.py prefill_fold``, ``docs/perf/h200-prefill-fold.json``): the
#: device-planned call -0.4..-2.6 us on 8 of 12 rows, +0.6..+5.1 on the rest; the host-planned call, whose plans
#: mostly have no merges, +0.2..+4.8 us on all 12 (so the fused build's main loop itself is slower: one more named
#: barrier, ptxas spills 4 bytes at page 1; a first build that walked every CTA's items at its tail was 2-9 us slower)
FUSED_MERGE = False
#: host plans (``plan_*`` and ``check_indices=True`` calls) of whole q tiles dealt over the CTAs whatever the device
#: twin did (``PlanConfig.whole_deal``): "lap" (lap by lap onto the least loaded CTAs, where strictly better in the
#: model), "serpentine" (the twin's deal, always), "" (the twin's deal where it deals, else the LPT or the twin's cuts).
#: History: the serpentine measured 1-7% faster than the LPT at an equal model (session 15) and "lap" slower on every
#: row in session 20, before the kernel stopped zeroing V past each item's keys (session 22: -22% a call). Session 27
#: (H200): per-CTA stamps (``tools/cta_timeline.py``) put 8 x 992's last CTA at 149.3 us after the release under the
#: serpentine (72 kv tiles against a mean of 65.9: its fixed turn lands a lap's clump of equal costs on the CTAs
#: that drew the last one) and 140.4 under the lap deal; ``tools/ab_policy.py lap_deal`` (one process, 200 runs,
#: planned, us): 4 x 992 77.3 -> 73.6, 8 x 992 149.1 -> 141.3, 16 x 992 282.3 -> 280.8, 8 x 992 h16/kv1 77.5 ->
#: 73.7, h16/kv2 78.6 -> 73.4, h20/kv4 98.9 -> 97.0, h32/kv16 161.7 -> 159.0 (every arm checked against the reference).
#: "lap" takes the lap deal only where the model is strictly better (those rows, h32/kv8 and h40/kv10); ties keep the
#: twin's plan. Device plans keep the twin's rule (``PlanConfig.lap_turn`` is the device's lever, off until measured)
WHOLE_DEAL = "lap"
#: device plans take the same rule (``PlanConfig.deal_whole_cuts``: whole-tile cuts give way to the serpentine deal
#: within 1/16 of their busiest CTA; the planner then sorts where it kept the cuts before). H200, session 21 (one
#: process, ``tools/ab_policy.py device_whole_deal --pages 64 1``; GPU tests 4 passed, memcheck/racecheck clean on
#: deal-whole-cuts), off -> on, us: device-planned 8 x 992 h32/kv4 200.3 -> 192.2 (page 64), 208.8 -> 201.6 (page 1),
#: h32/kv8 194.7 -> 189.3, 205.9 -> 197.6; the default call 210.3 -> 205.4, 221.0 -> 217.3, 205.9 -> 201.6, 217.8 ->
#: 213.2; 8 x 128 / 2048 within noise (73.4 -> 72.5, default 81.5 -> 82.1). Prediction was 199.5 -> ~193, default ~-5
DEVICE_WHOLE_DEAL = True
#: the most q tiles a GQA prefill plan deals (``PlanConfig.deal_max_q_tiles``: the device's sort of 1024 or 2048 keys,
#: and its twin, which host plans take where it deals). Why 2048: 32 x 992 at h32/kv4 has 1984 q tiles, so with 1024
#: the device kept its cuts, 1.013 of the mean in the model against the deal's 1.006, but 9% slower on the H200
#: (session 21's bench: device-planned 764.9 us against the host LPT's 701.4). H200, session 22, one process
#: (``tools/ab_policy.py deal_2048``, ``docs/perf/h200-deal-2048.json``; GPU tests 19 passed, memcheck/racecheck clean
#: on deal-2048), 1024 -> 2048, us: 32 x 992 page 64 device-planned 725.1 -> 703.6, default 746.9 -> 732.1, planned
#: 710.6 -> 699.9; page 1 768.4 -> 731.9, 788.3 -> 770.7, 732.7 -> 731.6; a ragged batch of 1840 q tiles 718.4 ->
#: 684.4, 741.6 -> 714.7, 682.0 -> 679.5 (page 1 alike). The bigger sort costs ~7 us of planner span (default minus
#: device-planned 21.8 -> 28.5), more than the ~4 predicted
DEAL_MAX_Q_TILES = 2048
#: sm_90a page sizes whose row gathers copy K one tile ahead of V (``PagedAttentionConfig.k_ahead``: K_0, K_1, V_0,
#: K_2, V_1, ..., FA3's paged-KV order). Why: page-1 prefill runs 6-16% behind page 64 and FA4 (whose page 1 runs
#: at its page-64 time); with the intra-warpgroup overlap a consumer waits for K_{t+1} before V_t, and the producer
#: warps copied V_t first. Built in session 16, empty (off) until an A/B (``tools/ab_policy.py k_ahead``) says so
K_AHEAD_PAGE_SIZES: tuple[int, ...] = ()


@contextlib.contextmanager
def k_ahead_policy(page_sizes):
    """Inside the block sm_90a prefill configs at ``page_sizes`` take ``k_ahead`` whatever ``K_AHEAD_PAGE_SIZES``
    says (the GPU tier, sanitizer cases, A/Bs)."""
    with policy(globals(), K_AHEAD_PAGE_SIZES=tuple(page_sizes)):
        yield


@contextlib.contextmanager
def whole_deal_policy(mode: str):
    """Inside the block GQA prefill host plans take ``whole_deal=mode`` ("", "lap", "serpentine") whatever
    ``WHOLE_DEAL`` says (A/Bs, GPU tests)."""
    if mode not in ("", "lap", "serpentine"):
        raise ValueError(f"whole_deal must be '', 'lap' or 'serpentine', got {mode!r}")
    with policy(globals(), WHOLE_DEAL=mode):
        yield mode


@contextlib.contextmanager
def device_whole_deal_policy(enabled: bool):
    """Inside the block GQA prefill device plans take ``deal_whole_cuts=enabled`` whatever ``DEVICE_WHOLE_DEAL`` says
    (A/Bs, the device-planner tier, sanitizer cases)."""
    with policy(globals(), DEVICE_WHOLE_DEAL=bool(enabled)):
        yield bool(enabled)


@contextlib.contextmanager
def deal_max_q_tiles_policy(most: int):
    """Inside the block GQA prefill plans (device and host) deal batches of up to ``most`` (1024 or 2048) q tiles
    whatever ``DEAL_MAX_Q_TILES`` says (A/Bs, the device-planner tier, sanitizer cases)."""
    if most not in DEAL_MAX_Q_TILES_CHOICES:
        raise ValueError(f"deal_max_q_tiles must be 1024 or 2048, got {most!r}")
    with policy(globals(), DEAL_MAX_Q_TILES=int(most)):
        yield int(most)


#: the default call (no plan) of causal sm_90a GQA prefill runs the self-scheduling build
#: (``PagedAttentionConfig.dynamic_schedule``: index checks, then CTAs taking whole (request, q tile, KV head) units
#: from a counter; no planner, no combine) when the batch's shapes promise at least DYNAMIC_MIN_UNITS_PER_CTA units a
#: CTA (``ceil(total_q * group / rows) * kv_heads``, a lower bound of its units); else the device planner, whose splits
#: fill the grid. ``tools/dynamic_schedule_model.py`` models the balance (session 32). H200, session 33
#: (``tools/bench.py --kernel prefill``, one process beside FA4, cold L2, 100 runs), the cold call (new index
#: tensors) minus the plan-once call, with the first build (a separate index-check launch) / the in-kernel checks:
#: 1 x 992 +12.5 / +5.4 us, 4 x 992 +7.1 / +2.1, 8 x 992 +3.6 / -0.2, 16 x 992 -2.5 / -8.1, 32 x 992 -10.3 / -12.5,
#: 4 x 512 / 4096 +5.1 / -1.4, 8 x 128 / 2048 +4.1 / +0.0 (the device planner's default call: +10..+22). On since
#: session 36: the final build passed its GPU tier, memcheck and racecheck, and won every A/B row
#: (``tools/ab_policy.py dynamic_schedule``: default call on / off, e.g. ragged 12 121.8 / 149.9 us, h5/kv1 39.2 / 46.9)
DYNAMIC_SCHEDULE = True
DYNAMIC_MIN_UNITS_PER_CTA = 1
#: the archs whose default call may take it: sm_100a has the twin build (``kernels/sm100/gqa_prefill.py``, session
#: 34), compiled and PTX-checked only; its default call stays on the device planner until it has run on a Blackwell GPU
DYNAMIC_SCHEDULE_ARCHS = ("sm_90a",)


def self_schedule(config, problem, num_ctas: int) -> bool:
    """``OpSpec.self_schedule``: the self-scheduling build for this default call (module policy above)."""
    return DYNAMIC_SCHEDULE and shapes_promise_units(config, problem, num_ctas, DYNAMIC_MIN_UNITS_PER_CTA,
                                                     DYNAMIC_SCHEDULE_ARCHS)


@contextlib.contextmanager
def dynamic_schedule_policy(enabled: bool):
    """Inside the block the default call takes (or never takes) the self-scheduling build whatever
    ``DYNAMIC_SCHEDULE`` says (A/Bs, GPU tests)."""
    with policy(globals(), DYNAMIC_SCHEDULE=bool(enabled)):
        yield bool(enabled)


#: sm_90a configs' ``PagedAttentionConfig.probe`` (measurement builds; "" in every default): "cta_stamps" records each
#: CTA's entry, release and end times in scratch (``tools/cta_timeline.py`` sets it through :func:`probe_policy`)
PROBE = ""


@contextlib.contextmanager
def probe_policy(probe: str):
    """Inside the block every public GQA prefill entry builds sm_90a configs with ``probe=probe`` (measurement tools)."""
    with policy(globals(), PROBE=str(probe)):
        yield


@contextlib.contextmanager
def fused_merge_policy(enabled: bool):
    """Inside the block every public GQA prefill entry builds sm_90a configs with ``fused_merge=enabled`` whatever
    ``FUSED_MERGE`` says (the GPU tier and sanitizer cases of the fold, A/Bs)."""
    with policy(globals(), FUSED_MERGE=bool(enabled)):
        yield bool(enabled)


# Unrolled on purpose: the fast path calls this once per call (api.py explains what each field stands for).
def signature(q, k, v, qo, kvp, kvi, last, sm_scale):
    return (q.__class__, q.shape, q.is_contiguous(), q.dtype, q.device,
            k.__class__, k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15,
            v.__class__, v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15,
            qo.__class__, qo.shape, qo.is_contiguous(), qo.dtype, qo.device, qo.data_ptr(), qo._version,
            kvp.__class__, kvp.shape, kvp.is_contiguous(), kvp.dtype, kvp.device, kvp.data_ptr(), kvp._version,
            kvi.__class__, kvi.shape, kvi.is_contiguous(), kvi.dtype, kvi.device, kvi.data_ptr(), kvi._version,
            last.__class__, last.shape, last.is_contiguous(), last.dtype, last.device, last.data_ptr(), last._version)


def default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> dict:
    """128 packed rows x 128 keys; on sm_90a the FA3 intra-warpgroup overlap and the shared-memory epilogue
    (measured on the H200: n32 852 -> 707 us, docs/perf-history.md; the flags mean nothing on sm_100a).

    head_dim 256: 128 rows x 64 keys on both arches (one 64 KB Q stage and 128 KB of K/V stages; sm_90a: O is 128
    fp32 registers per consumer thread, S and P of a 64-key tile 48 more), so pages 1..64 (a page is one TMA box
    inside the key tile: page 128 is refused with that reason). sm_90a keeps the overlap but not the smem
    epilogue: with a single Q stage the epilogue would hold the only Q buffer and delay the next item's Q load
    (not measured yet, docs/perf-history.md "Prefill head_dim 256").

    An item costs the planner 320 key-equivalents, not the default 128: with 128 the device planner's contiguous
    cuts gave some CTAs 4x the items of others, and device-planned prefill ran 1.16-1.5x its host-planned time
    on the H200 (docs/perf-history.md, session 7)."""
    kv_tile = 64 if head_dim_qk == 256 else 128
    tiles = dict(tile_q_rows=128, kv_tile=kv_tile, item_overhead_keys=PREFILL_ITEM_OVERHEAD_KEYS)
    if arch == "sm_90a":
        tiles.update(intra_wg_overlap=True, smem_epilogue=head_dim_qk != 256, fused_merge=FUSED_MERGE)
        if PROBE:
            tiles.update(probe=PROBE)
        if page_size in K_AHEAD_PAGE_SIZES:
            tiles.update(k_ahead=True)
    return tiles


def strategy():
    """Prefill cases: ragged runs, empty requests, one long request among short ones (kv >= q)."""
    return testing.ragged_batches().map(lambda lens: {"q_lens": lens[0], "kv_lens": lens[1]})


SPEC = OpSpec(
    name="gqa_paged_prefill", arg_names=ARG_NAMES,
    index_names=("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"), causal=True, check=check,
    signature=signature, reference=reference.gqa_paged_prefill_ref, make_case=testing.make_gqa_prefill_case,
    strategy=strategy, default_tiles=default_tiles, shape_reason=gqa_shape_reason, self_schedule=self_schedule,
    kernel_modules={"sm_90a": ".kernels.sm90.gqa_prefill", "sm_100a": ".kernels.sm100.gqa_prefill"},
)


def gqa_paged_prefill(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = False, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Causal GQA prefill over a paged KV cache. Returns ``(output, lse)`` (written in place if given).

    Shapes and dtypes (NHD, row-major; every index tensor int32 on the same CUDA device):
        q                 [total_q, num_qo_heads, head_dim]          bf16, contiguous
        k_cache, v_cache  [num_pages, page_size, num_kv_heads, head_dim] bf16; pages may be strided
                          (16-byte aligned page stride and base: ``kv[:, 0]`` / ``kv[:, 1]`` of one tensor work)
        qo_indptr         [batch + 1]   request b's query rows are qo_indptr[b] .. qo_indptr[b+1]-1
        kv_indptr         [batch + 1]   page offsets into kv_indices; [0] == 0, non-decreasing
        kv_indices        [kv_indptr[-1]] page ids in [0, num_pages)
        kv_last_page_len  [batch]       keys in each request's last page: 1..page_size (0 for no pages)
        sm_scale          Python float > 0
        output, lse       optional destinations [total_q, num_qo_heads, head_dim] bf16 / [total_q, num_qo_heads] fp32
    The mask is bottom-right causal per request: query i (0-based in its request) sees keys j <= i + (Lkv - Lq).
    ``lse`` is base 2 unless ``natural_lse=True``; a row that sees no key gets output 0 and lse -inf.

    Supported (sm_90a runs on Hopper; sm_100a is compiled and PTX-checked only, never run here): head_dim 64,
    128 and 256, page sizes 1..128 (powers of two; 1..64 at head_dim 256, whose key tile is 64 keys), GQA groups
    that divide 128 packed rows (1, 2, 4, 8, 16; sm_100a: head_dim 128 and 256). A shape no kernel builds raises ValueError with the kernel's reason. Needs a CUDA GPU.

    Plans: as :func:`gqa_paged_decode` (cached on the index tensors' identity and version; or plan once with
    :func:`plan_gqa_paged_prefill` and pass ``plan=`` to every layer).
    """
    return run(SPEC, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
               (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), output, lse, plan, check_indices, natural_lse,
               arch, num_sms)


def plan_gqa_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                           *, arch: str | None = None, num_sms: int | None = None, on_device: bool = False) -> DevicePlan:
    """Validate and plan one prefill batch (reads the index tensors: one host sync) for ``plan=``.

    Takes the arguments of :func:`gqa_paged_prefill` (outputs omitted); the plan serves every layer of the batch.
    """
    return plan_for(SPEC, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
                    arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["SPEC", "gqa_paged_prefill", "plan_gqa_paged_prefill", "check", "fused_merge_policy", "k_ahead_policy"]
