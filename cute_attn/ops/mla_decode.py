"""mla_paged_decode: absorbed-MLA decode over a paged latent cache, 1..4 query tokens per request.

FlashInfer-Bench's ``mla_paged_decode_h16_ckv512_kpe64_ps1`` / ``..._h8_..._ps1`` (no ``kv_last_page_len``) and
``..._h16_..._ps64`` (``kv_last_page_len`` before ``sm_scale``) argument orders, both taken positionally as
:func:`cute_attn.mla_paged_prefill` takes them. It is the MLA prefill kind with few queries per request: one
query sees every key of its request, which is exactly the bottom-right causal mask, so it runs the MLA prefill
kernel with ``qo_indptr = 0, 1, ..., batch`` (one cached tensor per batch size and device, so the plan cache
keys on a stable object; it is allocated at the first call of a batch size, so make that call outside
CUDA-graph capture).

Multi-token decode (MTP / speculative decoding): ``qo_indptr=`` (keyword; the definitions have none) gives
each request 1..4 query tokens, the request's last ``q_len`` positions, causal among themselves (bottom-right:
query ``i`` of ``q_len`` sees keys ``j <= kv_len - q_len + i``). A 64-row tile holds 4 tokens x 16 heads, so
every request is one tile. The rule ``1 <= q_len <= 4`` reads ``qo_indptr``'s values (one host sync), once
per tensor state (like the plan cache: identity, data pointer, version), and not with ``check_indices=False``.

A kernel of its own (split-KV at the bandwidth wall, FlashMLA's job) is issue 11's; this entry gives engines
and FlashInfer-Bench the decode argument order now.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import numpy as np
import torch

from .. import validate
from ..api import DevicePlan, plan_for
from . import mla_prefill

MAX_QUERIES_PER_REQUEST = 4  # MTP / speculative decoding: one 64-row tile of 16 heads
#: sm_90a, one query token per request: the swapped-product kernel (``kernels/sm90/mla_decode.py``: heads as the
#: wgmma N, no padding rows) instead of the 64-row prefill tile; flipping this line flips the entry and its plan_*
SM90_SWAPPED = True
_SWAPPED_HEADS = (8, 16)  # kernels/sm90/mla_decode.HEAD_COUNTS
#: split chunks of at least 256 keys: a batch-1 call of 4096 keys becomes 16 CTAs instead of 64 one-tile CTAs, whose
#: 64-way merge read back 2 MB of fp32 partials (a 4.7 MB cache). H200, session 12 (``tools/sweep_many.py``, one
#: process): 1 x 4096 24.5 -> 19.3 us at page 64, 24.7 -> 20.2 at page 1 (128: 19.4; 512: 24.9 / 27.4). Batches of
#: >= 16 x 4096 already cut chunks longer than this, so only small batches change.
ONE_TOKEN_MIN_CHUNK_KEYS = 256
#: sm_90a swapped kernel: the consumer warpgroups split S^T's 576 dims and add each other's partial
#: (``share_scores``; ``kernels/sm90/mla_decode.py``), instead of both computing all of it: 18 + 16 instead of 36 + 16
#: wgmma a warpgroup a tile, so a K stage is held for less. H200, session 18 (``tools/sweep_many.py``, one process,
#: planned calls): page 64 128 x 4096 155.1 -> 150.9 us, 64 x 8192 160.3 -> 157.4, 16 x 4096 34.9 -> 34.4, 1 x 4096
#: 18.5 -> 17.4; page 1 128 x 4096 154.8 -> 154.0, 64 x 8192 161.2 -> 159.8
SM90_SPLIT_SCORES = True
#: sm_90a swapped kernel: K stages of 32 keys (4 stages, three loading while the consumers hold one: 108 KiB in flight
#: an SM) instead of 64 (2 stages: 72 KiB in flight); S^T still runs as one 64-row tile (``kernels/sm90/mla_decode.py``,
#: short stages). Session 32 measured an SM of the 64-key kernel at ~36 GB/s alone and the 128-CTA 16 x 4096 page-64
#: row at 26 GB/s a CTA under ncu (busy 22.4 of 27.6 us), below the ~31 GB/s a CTA of the 4.0 TB/s rows: a stage's
#: turnaround (~5.6 us for two) sets it. Expected (session 39, not run): 16 x 4096 page 64 planned 34.2 -> ~31.5 us
#: (busy 22.4 -> ~19.5), 1 x 4096 -0.5, the 4.0 TB/s rows (128 x 4096, 64 x 8192) unchanged within 1%, unless a 32-key
#: stage is held over half as long as a 64-key one (then those rows lose). A cluster build (host plans of 64 x 8192)
#: keeps its piece beside the ring and fits three short stages: 72 KiB in flight, as now. **Refuted** (session 39, H200,
#: ``ab_policy mla_short_stages``, planned, off -> on, us): 16 x 4096 page 64 34.3 -> 35.9, 1 x 4096 15.7 -> 19.7,
#: 128 x 4096 153.2 -> 184.8, 64 x 8192 153.6 -> 184.3 (correct: GPU tier 37 passed, racecheck clean): the
#: consumers' hold, not the loads, sets the rate once a stage is 32 keys (``docs/perf/h200-short-stages.json``)
SM90_SHORT_STAGES = False
#: sm_90a one-token configs: split items folded in-kernel by the last CTA of each merge (``fused_merge``, with the
#: 16-byte wide-row fold, ``common/decode_merge.fold_wide_merge``) instead of the combine launch; None: the MLA prefill
#: kind's ``FUSED_MERGE`` (off). The combine launch is 3.8-4.6 us of the page-64 planned calls with merges (session
#: 18, ``tools/kernel_breakdown.py``: 1 x 4096 4.3 of 17.2, 16 x 4096 3.8 of 34.5, 64 x 8192 4.4 of 154.3), but the
#: wide fold did not win it back (H200, session 18, one process, planned, page 64): 64 x 8192 156.3 -> 156.1 us,
#: 16 x 4096 34.6 -> 36.2, 1 x 4096 17.4 -> 19.8 (correct: GPU tests 34 passed, memcheck/racecheck clean). A merge of
#: n slots is n x 32 KiB read by the one CTA that arrives last, where the combine spreads them over the grid
SM90_FUSED_MERGE: bool | None = None
#: sm_90a one-token configs: a host plan whose merges each fill a thread-block cluster of 2, 4 or 8 CTAs (the even
#: pieces of a uniform batch: 16 x 4096 cut 8 ways, 64 x 8192 2 ways; ``plan_clusters.py``) runs the kernel launched in
#: clusters, which folds each split request in distributed shared memory (``kernels/common/cluster_merge.py``): no
#: partials in global memory and no combine launch, the ~4 us the combine took after the attention grid (session 18,
#: ``tools/kernel_breakdown.py``: 16 x 4096 3.8 of 34.5 us, 64 x 8192 4.4 of 154.3; fa3 34.2 / 154.2). Device plans
#: (the default call) keep the combine: their shape is not known on the host. Measured, session 31 (H200, one process,
#: ``tools/ab_policy.py cluster_merge``, planned, off -> on, us): 64 x 8192 157.3 -> 153.3 (page 64), 160.6 -> 156.0
#: (page 1); 12 x 2048 20.3 -> 19.8 / 20.4 -> 19.6; 2 x 2048 15.4 -> 14.9 / 15.4 -> 14.8; batches without the shape
#: unchanged. 16 x 4096 (16 clusters of 8) ran 34.6 -> 51.1 before the capacity check: the H200 holds 15 clusters of
#: 8 at once (66 of 2, 30 of 4), so it keeps the combine
SM90_CLUSTER_MERGE = True


def cluster_tiles(config, plan, device) -> dict:
    """``{"cluster_merge": k}`` where ``SM90_CLUSTER_MERGE`` is on, ``config`` is the sm_90a one-token kernel's,
    ``plan`` has the cluster shape (``plan_clusters.cluster_merge_size``) and its clusters fit on ``device`` at once
    (:func:`cluster_capacity`); else no change."""
    from ..plan_clusters import cluster_merge_size, clusters_used

    k = cluster_merge_size(plan) if SM90_CLUSTER_MERGE else 0
    if not k:
        return {}
    clustered = dataclasses.replace(config, cluster_merge=k)  # the knob's own rules say which configs build it
    if clustered.can_implement() is not None or clusters_used(plan, k) > cluster_capacity(clustered, device):
        return {}
    return {"cluster_merge": k}


#: sm_90a one-token configs of device plans (the default call, ``plan_*(on_device=True)``): the kernel launched in
#: clusters of 2 whatever the plan, each cluster checking at run time whether it holds one whole merge
#: (``cluster_merge_flags``): those fold in shared memory and are flagged for the combine launch, which a device plan
#: always makes and which skips them. The device planner's even pieces of a uniform batch cut 64 x 8192 in 2 pieces
#: on neighbouring CTAs, the shape; 16 x 4096's 8 pieces a request do not fold in pairs and keep the combine.
#: Measured, session 32 (H200, one process, ``tools/ab_policy.py device_cluster_merge``, 100 runs, off -> on, us):
#: 64 x 8192 device-planned 154.8 -> 154.1 (page 64), 158.2 -> 156.6 (page 1), default call 163.1 -> 162.9 /
#: 165.9 -> 164.6; small batches' default call +0.3..+0.9 (1 x 4096, 2 x 2048, 16 x 2048). Why so little
#: (``tools/kernel_breakdown.py --device-clusters``): the fold adds 2.1-2.8 us to the attention kernel (152.2 -> 155.0)
#: and the combine a device plan must launch still takes 2.3 us after it with nothing to fold (5.5 with the merges).
#: Host plans gain 4 us because they drop that launch. Off
SM90_DEVICE_CLUSTER_MERGE = False
DEVICE_CLUSTER_SIZE = 2  # 66 clusters of 2 fit on the H200's 132 SMs: every device plan's grid in one wave


def device_cluster_config(config):
    """``config`` with the device plans' run-time-checked clusters (:data:`SM90_DEVICE_CLUSTER_MERGE`) where its
    kernel builds them, else ``config`` (what :func:`device_cluster_tiles` picks, without the device's checks)."""
    if not SM90_DEVICE_CLUSTER_MERGE:  # plan_*(on_device=True) asks every call: no config built while off
        return config
    clustered = dataclasses.replace(config, cluster_merge=DEVICE_CLUSTER_SIZE, cluster_merge_flags=True)
    return clustered if clustered.can_implement() is None else config


def device_cluster_tiles(config, device, num_ctas: int) -> dict:
    """``OpSpec.device_plan_tiles``: ``{"cluster_merge": 2, "cluster_merge_flags": True}`` where
    :func:`device_cluster_config` takes ``config``, the grid is whole clusters and they all fit on ``device`` at once;
    else no change."""
    clustered = device_cluster_config(config)
    if clustered is config or num_ctas % DEVICE_CLUSTER_SIZE \
            or num_ctas // DEVICE_CLUSTER_SIZE > cluster_capacity(clustered, device):
        return {}
    return {"cluster_merge": DEVICE_CLUSTER_SIZE, "cluster_merge_flags": True}


@contextlib.contextmanager
def device_cluster_merge_policy(enabled: bool):
    """Inside the block device plans of the sm_90a one-token configs take the run-time-checked clusters
    (``enabled``) or not, whatever ``SM90_DEVICE_CLUSTER_MERGE`` says (A/Bs, the GPU tier, sanitizer cases)."""
    from . import policy

    with policy(globals(), SM90_DEVICE_CLUSTER_MERGE=bool(enabled)):
        yield bool(enabled)


def cluster_capacity(config, device) -> int:
    """Clusters of ``config.cluster_merge`` CTAs of its kernel that ``device`` runs at once (0 off a CUDA device).
    H200 (session 31): sixteen clusters of 8 did not fit (16 x 4096 ran 34.6 -> 51.1 us)."""
    if device.type != "cuda":
        return 0
    from ..cluster_capacity import max_active_clusters
    from ..kernels.sm90.mla_prefill import NUM_THREADS, smem_bytes

    index = device.index if device.index is not None else torch.cuda.current_device()
    return max_active_clusters(index, config.cluster_merge, NUM_THREADS, smem_bytes(config))


@contextlib.contextmanager
def cluster_merge_policy(enabled: bool):
    """Inside the block the decode entry's sm_90a one-token host plans of the cluster shape run the cluster fold
    (``enabled``) or the combine launch, whatever ``SM90_CLUSTER_MERGE`` says (A/Bs, the GPU tier, sanitizer cases)."""
    from . import policy

    with policy(globals(), SM90_CLUSTER_MERGE=bool(enabled)):
        yield bool(enabled)


def one_token_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> dict:
    """The MLA prefill kind's tiles, or (sm_90a, ``SM90_SWAPPED``, 8 or 16 heads) one token a tile."""
    if arch == "sm_90a" and SM90_SWAPPED and num_qo_heads in _SWAPPED_HEADS:
        fused_merge = mla_prefill.FUSED_MERGE if SM90_FUSED_MERGE is None else SM90_FUSED_MERGE
        kv_tile = 32 if SM90_SHORT_STAGES else 64
        return dict(tile_q_rows=num_qo_heads, kv_tile=kv_tile, share_scores=SM90_SPLIT_SCORES,
                    min_chunk_keys=ONE_TOKEN_MIN_CHUNK_KEYS, page_boxes=mla_prefill.page_boxes(page_size, kv_tile),
                    fused_merge=fused_merge, eager_combine=mla_prefill.eager_combine(fused_merge))
    return mla_prefill.default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size)


@contextlib.contextmanager
def split_scores_policy(enabled: bool):
    """Inside the block the decode entry's sm_90a one-token configs take ``share_scores=enabled`` whatever
    ``SM90_SPLIT_SCORES`` says (A/Bs, the GPU tier, sanitizer cases)."""
    from . import policy

    with policy(globals(), SM90_SPLIT_SCORES=bool(enabled)):
        yield bool(enabled)


@contextlib.contextmanager
def short_stages_policy(enabled: bool):
    """Inside the block the decode entry's sm_90a one-token configs take 32-key K stages (``enabled``) or 64-key ones
    whatever ``SM90_SHORT_STAGES`` says (A/Bs, the GPU tier, sanitizer cases)."""
    from . import policy

    with policy(globals(), SM90_SHORT_STAGES=bool(enabled)):
        yield bool(enabled)


@contextlib.contextmanager
def decode_fused_merge_policy(enabled: bool | None):
    """Inside the block the decode entry's sm_90a one-token configs take ``fused_merge=enabled`` (None: the prefill
    kind's) whatever ``SM90_FUSED_MERGE`` says (A/Bs, the bench, GPU tests)."""
    from . import policy

    with policy(globals(), SM90_FUSED_MERGE=enabled):
        yield enabled


#: The default call (no plan) of one-token MLA decode runs the swapped kernel's ``line_schedule`` build
#: (``kernels/common/line_schedule.py``: every CTA derives its own stretch of the cost line, without the sorted deal,
#: and folds its split items in the kernel; no planner, no combine launch). Session 39 (H200): GPU tier and
#: memcheck / racecheck clean. Session 40 (``tools/ab_policy.py mla_line_schedule``, one process, H100 SXM: the H200s
#: were not lent; default call off -> on, us): 64 x 8192 page 64 228.9 -> 222.4 (cold - warm +10.9 -> +4.5), page 1
#: 233.8 -> 231.7 (+10.1 -> +7.4), 128 x 4096 224.4 -> 218.9 / 230.5 -> 228.9, 16 x 4096 51.2 -> 48.3 / 52.9 -> 50.0,
#: 1 x 4096 -0.4 / -0.7, 2..16 x 2048 -2.1..-3.6; slower on one row, the ragged 64 at page 1: 469.0 -> 474.9 (cold -
#: warm +8.4 -> +14.2; page 64 454.2 -> 452.8). On: 15 of 16 rows faster, issue 9's bound met on all but that row
#: (``docs/perf/h100-mla-line.json``)
SM90_LINE_SCHEDULE = True


def line_schedule(config, problem, num_ctas: int) -> bool:
    """``OpSpec.self_schedule`` of the one-token spec: the ``line_schedule`` build for this default call (the policy
    above), where the swapped kernel builds it and the batch fits its table."""
    if not SM90_LINE_SCHEDULE or config.arch != "sm_90a":
        return False
    line = dataclasses.replace(config, line_schedule=True)
    if line.can_implement() is not None:
        return False
    from ..kernels.sm90.mla_prefill import NUM_THREADS, line_table_requests

    return problem.batch_size <= line_table_requests(line) and num_ctas + 1 <= NUM_THREADS


@contextlib.contextmanager
def line_schedule_policy(enabled: bool):
    """Inside the block the one-token default call takes (or never takes) the ``line_schedule`` build whatever
    ``SM90_LINE_SCHEDULE`` says (GPU tests, A/Bs, sanitizer cases)."""
    from . import policy

    with policy(globals(), SM90_LINE_SCHEDULE=bool(enabled)):
        yield bool(enabled)


#: the MLA prefill kind with one-token tiles: the spec of the decode entry's one-query-per-request calls (one token
#: a tile is the swapped decode kernel: its planner-free build is ``line_schedule``, not ``dynamic_schedule``'s units)
ONE_TOKEN_SPEC = dataclasses.replace(mla_prefill.SPEC, default_tiles=one_token_tiles, plan_tiles=cluster_tiles,
                                     device_plan_tiles=device_cluster_tiles, self_schedule=line_schedule,
                                     self_schedule_knobs={"line_schedule": True},
                                     self_schedule_policy=lambda: SM90_LINE_SCHEDULE,
                                     self_schedule_when_reused=False)

_ONE_PER_REQUEST: dict[tuple[int, torch.device], torch.Tensor] = {}
_CHECKED_QO: dict[tuple, weakref.ref] = {}  # qo_indptr states whose q_len rule passed


def _batch(q_nope, kv_indptr) -> int:
    for name, t, ndim in (("q_nope", q_nope, 3), ("kv_indptr", kv_indptr, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return kv_indptr.shape[0] - 1


def _qo_indptr(q_nope, kv_indptr) -> torch.Tensor:
    """``0, 1, ..., batch`` on the inputs' device; the decode rules first, in the decode arguments' names."""
    batch = _batch(q_nope, kv_indptr)
    if q_nope.shape[0] != batch:
        raise ValueError(f"q_nope.shape[0] must equal batch_size = len(kv_indptr) - 1 ({batch}): one query per "
                         f"request (pass qo_indptr= for 1..{MAX_QUERIES_PER_REQUEST}), got shape "
                         f"{tuple(q_nope.shape)}")
    key = (batch, kv_indptr.device)
    indptr = _ONE_PER_REQUEST.get(key)
    if indptr is None:
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=kv_indptr.device)
        # never evicted: a captured CUDA graph reads this very tensor at every replay (one small tensor a batch
        # size); not kept when made inside a capture, whose fill of it runs only at replay time
        capturing = indptr.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _ONE_PER_REQUEST[key] = indptr
    return indptr


def check_queries(q_nope, kv_indptr, qo_indptr, *, check_indices: bool) -> None:
    """The multi-token rules: ``qo_indptr`` int32 ``[batch + 1]``; every request has 1..4 query tokens."""
    batch = _batch(q_nope, kv_indptr)
    validate.dense("qo_indptr", qo_indptr, torch.int32, 1)
    validate.check_dim("qo_indptr", qo_indptr, 0, batch + 1, "len(kv_indptr)")
    total_q = q_nope.shape[0]
    if not batch <= total_q <= MAX_QUERIES_PER_REQUEST * batch:
        raise ValueError(f"q_nope.shape[0] ({total_q}) must be in batch_size .. {MAX_QUERIES_PER_REQUEST} x "
                         f"batch_size ({batch} .. {MAX_QUERIES_PER_REQUEST * batch}): 1..{MAX_QUERIES_PER_REQUEST} "
                         "query tokens per request")
    if not check_indices:
        return
    key = (id(qo_indptr), qo_indptr.data_ptr(), qo_indptr._version, qo_indptr.device)
    ref = _CHECKED_QO.get(key)
    if ref is not None and ref() is qo_indptr:
        return
    qo = validate.host_ints(qo_indptr)
    validate.check_indptr("qo_indptr", qo)
    q_lens = np.diff(qo)
    bad = (q_lens < 1) | (q_lens > MAX_QUERIES_PER_REQUEST)
    if bad.any():
        b = int(np.nonzero(bad)[0][0])
        raise ValueError(f"qo_indptr gives request {b} {q_lens[b]} query tokens: decode takes 1.."
                         f"{MAX_QUERIES_PER_REQUEST} per request (use mla_paged_prefill for more)")
    if qo[-1] != total_q:
        raise ValueError(f"qo_indptr[-1] ({qo[-1]}) must equal total_q = q_nope.shape[0] ({total_q})")
    if len(_CHECKED_QO) >= 64:
        _CHECKED_QO.clear()
    _CHECKED_QO[key] = weakref.ref(qo_indptr)


def _queries(q_nope, kv_indptr, qo_indptr, check_indices) -> torch.Tensor:
    if qo_indptr is None:
        return _qo_indptr(q_nope, kv_indptr)
    validate.check_flag("check_indices", check_indices)
    check_queries(q_nope, kv_indptr, qo_indptr, check_indices=check_indices)
    return qo_indptr


def mla_paged_decode(
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len=None, sm_scale=None, output=None,
    lse=None, *, qo_indptr: torch.Tensor | None = None, plan: DevicePlan | None = None, check_indices: bool = False,
    natural_lse: bool = False, arch: str | None = None, num_sms: int | None = None,
):
    """Absorbed-MLA decode over a paged latent cache. Returns ``(output, lse)``.

    Argument orders: ``(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)``
    (FlashInfer-Bench ``..._ps64``) or, at page size 1, ``(..., kv_indices, sm_scale)`` (``..._ps1``).

    Shapes and dtypes (row-major; index tensors int32 on the same CUDA device):
        q_nope [total_q, num_heads, 512] bf16   q_pe [total_q, num_heads, 64] bf16   (total_q = batch without
            qo_indptr)
        ckv_cache [num_pages, page_size, 512] bf16    kpe_cache [num_pages, page_size, 64] bf16
        kv_indptr [batch + 1] page offsets into kv_indices; kv_indices [kv_indptr[-1]] page ids in [0, num_pages)
        kv_last_page_len [batch] keys in each last page (required at page_size > 1)
        sm_scale Python float > 0; output [total_q, num_heads, 512] bf16, lse [total_q, num_heads] fp32 (optional)
        qo_indptr (keyword) [batch + 1]: request b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1, 1..4 of
            them, the last positions of the request, causal among themselves (bottom-right)
    One query per request (no ``qo_indptr``) sees every key. ``lse`` is base 2 unless ``natural_lse=True``; a
    request with no keys, or a query that sees none, gets output 0 and lse -inf. Runs the MLA prefill kernel
    (sm_90a on Hopper; sm_100a compiled only); needs a CUDA GPU. Plans: as :func:`cute_attn.gqa_paged_decode`, or
    :func:`plan_mla_paged_decode` once and ``plan=`` per layer (with the same ``qo_indptr=``).
    """
    kv_last_page_len, sm_scale, output, lse = mla_prefill.page_size_1_order(kv_last_page_len, sm_scale, output, lse)
    qo = _queries(q_nope, kv_indptr, qo_indptr, check_indices)
    spec = ONE_TOKEN_SPEC if qo_indptr is None else mla_prefill.SPEC
    return mla_prefill.run_mla(q_nope, q_pe, ckv_cache, kpe_cache, qo, kv_indptr, kv_indices, kv_last_page_len,
                               sm_scale, output, lse, plan, check_indices, natural_lse, arch, num_sms, spec=spec)


def plan_mla_paged_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_last_page_len=None,
                          sm_scale=None, *, qo_indptr: torch.Tensor | None = None, arch: str | None = None,
                          num_sms: int | None = None, on_device: bool = False) -> DevicePlan:
    """Validate and plan one MLA decode batch (reads the index tensors: one host sync) for ``plan=``."""
    kv_last_page_len, sm_scale, _, _ = mla_prefill.page_size_1_order(kv_last_page_len, sm_scale, None, None)
    qo = _queries(q_nope, kv_indptr, qo_indptr, True)
    spec = ONE_TOKEN_SPEC if qo_indptr is None else mla_prefill.SPEC
    return plan_for(spec, (q_nope, q_pe, ckv_cache, kpe_cache, qo, kv_indptr, kv_indices,
                                       kv_last_page_len, sm_scale), arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["mla_paged_decode", "plan_mla_paged_decode", "check_queries", "MAX_QUERIES_PER_REQUEST"]
