"""Float32 references of the three definitions: the judge of every kernel and of the planner.

Independent of the kernels and of the planner: each request is handled whole, in fp32 computed from
the bf16 inputs, with a single cast to bf16 at the end (the definitions' reference arithmetic).
Vectorised torch, on whatever device the inputs live; long requests are processed in query chunks so
the logits never exceed ``_MAX_LOGITS`` elements.

Conventions (``../shared/spec/definitions.md``):
- causal masks are bottom-right aligned per request: query row ``i`` sees keys ``j <= i + (Lkv - Lq)``;
- LSE is base 2 (``logsumexp / ln 2``) unless ``natural_lse=True``;
- a row that sees no key gets output 0 and lse ``-inf``.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = [
    "attend",
    "merge_partials",
    "gqa_paged_prefill_ref",
    "gqa_paged_decode_ref",
    "mla_paged_prefill_ref",
    "mla_paged_decode_ref",
    "gather_paged_kv",
]

LOG2E = 1.0 / math.log(2.0)
_MAX_LOGITS = 1 << 27  # elements of one fp32 logits chunk (512 MiB)


@contextlib.contextmanager
def _exact_fp32_matmul():
    """TF32 would put the reference at ~1e-3 error, the same size as the tolerance it judges."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    *,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    causal_offset: int | None = None,
    natural_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [Lq, Hq, Dqk]`` over ``k [Lk, Hkv, Dqk]``, ``v [Lk, Hkv, Dv]`` in fp32.

    Query head ``h`` reads KV head ``h // (Hq // Hkv)``. With ``causal_offset`` set, query position
    ``q_pos[i]`` sees key position ``k_pos[j]`` iff ``k_pos[j] <= q_pos[i] + causal_offset`` (positions
    default to ``arange``). Returns fp32 ``(out [Lq, Hq, Dv], lse [Lq, Hq])``; the output is normalised
    over the keys given, so partial results over disjoint key ranges merge with :func:`merge_partials`.
    """
    lq, hq, _ = q.shape
    lk, hkv, dv = v.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    group = hq // hkv
    out = torch.zeros(lq, hq, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((lq, hq), -math.inf, dtype=torch.float32, device=q.device)
    if lq == 0 or lk == 0:
        return out, lse
    qf = q.float().reshape(lq, hkv, group, -1)
    kf = k.float()
    vf = v.float()
    if causal_offset is not None:
        q_pos = torch.arange(lq, device=q.device) if q_pos is None else q_pos.to(q.device)
        k_pos = torch.arange(lk, device=q.device) if k_pos is None else k_pos.to(q.device)
    rows_per_chunk = max(1, _MAX_LOGITS // max(1, lk * hq))
    with _exact_fp32_matmul():
        for r0 in range(0, lq, rows_per_chunk):
            r1 = min(lq, r0 + rows_per_chunk)
            # logits [Hkv, G, rows, Lk]
            s = torch.einsum("qhgd,khd->hgqk", qf[r0:r1], kf) * sm_scale
            if causal_offset is not None:
                visible = k_pos[None, :] <= (q_pos[r0:r1, None] + causal_offset)
                s = s.masked_fill(~visible, -math.inf)
            row_lse = torch.logsumexp(s, dim=-1)  # natural log, -inf where nothing is visible
            seen = torch.isfinite(row_lse)
            p = torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None])
            p = torch.where(seen[..., None], p, 0.0)
            o = torch.einsum("hgqk,khd->qhgd", p, vf).reshape(r1 - r0, hq, dv)
            out[r0:r1] = o
            chunk_lse = row_lse.permute(2, 0, 1).reshape(r1 - r0, hq)
            lse[r0:r1] = chunk_lse if natural_lse else chunk_lse * LOG2E
    return out, lse


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor], *, natural_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge normalised partial results over disjoint key sets (the combine step's math).

    ``-inf`` is the identity: a partial that saw no key contributes nothing, and if no partial saw a key
    the row stays (0, -inf).
    """
    lse_all = torch.stack([x.float() for x in lses])
    scale = 1.0 if natural_lse else math.log(2.0)
    lse_nat = lse_all * scale
    total = torch.logsumexp(lse_nat, dim=0)
    seen = torch.isfinite(total)
    weights = torch.where(seen, torch.exp(lse_nat - torch.where(seen, total, 0.0)), 0.0)
    out = sum(w[..., None] * o.float() for w, o in zip(weights, outs))
    return out, total / scale


def gather_paged_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Token rows ``0..length-1`` of one request: token t is slot ``t % page_size`` of page ``pages[t // page_size]``.

    ``cache`` is ``[num_pages, page_size, ...]``; only valid slots are read, so poison in unused slots
    cannot reach the result.
    """
    page_size = cache.shape[1]
    rows = cache[pages.long()].reshape(pages.numel() * page_size, *cache.shape[2:])
    return rows[:length]


def _as_list(x: torch.Tensor) -> list[int]:
    return [int(v) for v in x.detach().to("cpu", torch.int64).tolist()]


def _paged_kv_lens(kv_indptr, kv_last_page_len, page_size: int) -> list[int]:
    pages = _as_list(kv_indptr)
    last = _as_list(kv_last_page_len)
    lens = []
    for b in range(len(pages) - 1):
        n = pages[b + 1] - pages[b]
        lens.append(0 if n == 0 else (n - 1) * page_size + last[b])
    return lens


def _finish(out32: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out32.to(torch.bfloat16), lse.float()


def gqa_paged_prefill_ref(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
    *, causal: bool = True, natural_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``gqa_paged_prefill_causal_*``: q ``[total_q, Hq, D]``, caches ``[pages, page_size, Hkv, D]``."""
    page_size = k_cache.shape[1]
    qo = _as_list(qo_indptr)
    kvp = _as_list(kv_indptr)
    kv_lens = _paged_kv_lens(kv_indptr, kv_last_page_len, page_size)
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b, lkv in enumerate(kv_lens):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        pages = kv_indices[kvp[b] : kvp[b + 1]]
        k = gather_paged_kv(k_cache, pages, lkv)
        v = gather_paged_kv(v_cache, pages, lkv)
        offset = (lkv - (q1 - q0)) if causal else None
        out[q0:q1], lse[q0:q1] = attend(q[q0:q1], k, v, sm_scale, causal_offset=offset, natural_lse=natural_lse)
    return _finish(out, lse)


def gqa_paged_decode_ref(
    q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, *, natural_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``gqa_paged_decode_*``: one query per request, every key visible."""
    batch = q.shape[0]
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
    return gqa_paged_prefill_ref(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
        causal=False, natural_lse=natural_lse,
    )


def mla_paged_prefill_ref(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, *rest,
    causal: bool = True, natural_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``mla_paged_prefill_causal_*``: absorbed MLA, one latent KV shared by every head.

    ``rest`` is ``(sm_scale,)`` (the ps1 order: a request has as many keys as pages) or ``(kv_last_page_len,
    sm_scale)`` (the ps64 order; ``None`` at page size 1 reads as the ps1 order). Caches are ``[num_pages,
    page_size, dim]``: key ``j`` is slot ``j % page_size`` of page ``kv_indices[kv_indptr[b] + j // page_size]``.
    Logits are the ``ckv + kpe`` wide dot product; V is ``ckv`` itself.
    """
    if len(rest) not in (1, 2):
        raise TypeError(f"expected (sm_scale) or (kv_last_page_len, sm_scale) after kv_indices, got {len(rest)} values")
    kv_last_page_len, sm_scale = (None, rest[0]) if len(rest) == 1 else rest
    page_size = ckv_cache.shape[1]
    qo = _as_list(qo_indptr)
    kvp = _as_list(kv_indptr)
    if kv_last_page_len is None:
        if page_size != 1:
            raise ValueError(f"kv_last_page_len is required at page_size {page_size}")
        kv_lens = [kvp[b + 1] - kvp[b] for b in range(len(kvp) - 1)]
    else:
        kv_lens = _paged_kv_lens(kv_indptr, kv_last_page_len, page_size)
    q_cat = torch.cat([q_nope, q_pe], dim=-1)
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], ckv_cache.shape[-1], dtype=torch.float32, device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
    for b, lkv in enumerate(kv_lens):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        pages = kv_indices[kvp[b] : kvp[b + 1]]
        ckv = gather_paged_kv(ckv_cache, pages, lkv)[:, None, :]  # [lkv, 1, ckv]
        k = torch.cat([ckv, gather_paged_kv(kpe_cache, pages, lkv)[:, None, :]], dim=-1)
        offset = (lkv - (q1 - q0)) if causal else None
        out[q0:q1], lse[q0:q1] = attend(q_cat[q0:q1], k, ckv, sm_scale, causal_offset=offset, natural_lse=natural_lse)
    return _finish(out, lse)


def mla_paged_decode_ref(
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, *rest,
    qo_indptr: torch.Tensor | None = None, natural_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``mla_paged_decode_*``, in the definitions' argument orders (no ``qo_indptr``).

    ``rest`` is ``(sm_scale,)`` (ps1 order) or ``(kv_last_page_len, sm_scale)`` (ps64 order). One query per request
    sees every key of its request; ``qo_indptr=`` (1..4 queries per request, the request's last positions) makes
    them causal among themselves, bottom-right. Both are the MLA prefill reference's causal mask, because a
    request's last query sees all of its keys.
    """
    if qo_indptr is None:
        qo_indptr = torch.arange(q_nope.shape[0] + 1, dtype=torch.int32)
    return mla_paged_prefill_ref(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, *rest,
                                 causal=True, natural_lse=natural_lse)
