"""Runners for tools/bench.py: cute_attn (ours), FlashInfer 0.7.2 and FlashAttention-4.

A runner's `setup(case)` does everything that must stay outside timing (imports, planning,
output allocation, page tables) and returns a `Prepared`: calling it runs the kernel once
and returns the raw result; `prepared.normalize(result)` turns that into
(output [T, H, Dv] bf16, lse [T, H] fp32 base 2) for checking only, so layout/base
conversions never land inside the timed call.

Missing peers and shapes a peer refuses raise `Unavailable` (reported as a skipped row);
our own `NotImplementedError` is also `Unavailable` ("not available").

Every runner takes its head layout and page size from the case's tensors (`_dims`), so any family definition
(`bench_workloads.parse_definition`: e.g. gqa_paged_decode_h20_kv4_d128_ps1) runs through the same entries; the
runner list is chosen by the definition's op (decode / prefill / mtp / mla / mla_decode).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

from bench_workloads import op_of

LN2 = math.log(2.0)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


class Unavailable(Exception):
    """The implementation cannot run this case (not installed, unsupported shape, not written yet)."""


class Prepared:
    def __init__(self, run: Callable[[], object], normalize: Optional[Callable] = None, note: str = ""):
        self.run = run
        self.normalize = normalize or (lambda r: (r[0], r[1]))
        self.note = note

    def __call__(self):
        return self.run()


def _dims(case) -> Dict[str, int]:
    """Head layout and page size as the case's tensors have them: what FlashInfer's plan() is given."""
    return dict(num_qo_heads=case.q.shape[1], num_kv_heads=case.k_cache.shape[2],
                head_dim=case.q.shape[2], page_size=case.k_cache.shape[1])


# ----------------------------------------------------------------------------- ours

_OUR_ENTRY = {  # definition op -> entry names, first found wins (the definition name is a fallback spelling)
    "prefill": ("gqa_paged_prefill",),
    "decode": ("gqa_paged_decode",),
    "mla": ("mla_paged_prefill",),
    "mtp": ("gqa_paged_multi_token_decode",),
    "mla_decode": ("mla_paged_decode",),  # the decode definitions' orders: no qo_indptr
}


CUTE_ATTN_MODES = {  # impl name -> how the call gets its plan
    "cute_attn": "default",  # what a caller gets: planned and checked on the GPU at every call, no host sync
    "cute_attn_planned": "planned",  # plan_*() once (host), plan= at every call: an engine's layers 2..L
    "cute_attn_device_planned": "device_planned",  # plan_*(on_device=True) once, plan= at every call
    "cute_attn_cold": "cold",  # the default with new index tensors every call (engine step, FlashInfer-Bench)
    "cute_attn_host_cold": "host_cold",  # check_indices=True with new index tensors: the old host-planned path
}
_INDEX_NAMES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")
_COLD_RING = 8  # index tensor sets cycled through: every call sees objects no cache has keyed on lately


def setup_cute_attn(kernel: str, case, mode: str = "default") -> Prepared:
    try:
        import cute_attn
    except ImportError as exc:
        raise Unavailable(f"not available: cannot import cute_attn ({exc})") from exc
    names = _OUR_ENTRY.get(op_of(kernel), ()) + (kernel,)
    fn = next((getattr(cute_attn, n) for n in names if hasattr(cute_attn, n)), None)
    if fn is None:
        raise Unavailable(f"not available: cute_attn has no {' / '.join(names)}")
    out, lse = case.new_outputs()
    args = tuple(case.inputs())
    kw = {}
    if mode == "planned":
        planner = getattr(cute_attn, f"plan_{fn.__name__}")
        kw = dict(plan=planner(*args))
    elif mode == "device_planned":
        planner = getattr(cute_attn, f"plan_{fn.__name__}")
        kw = dict(plan=planner(*args, on_device=True))
    elif mode == "host_cold":
        kw = dict(check_indices=True)
    if mode in ("cold", "host_cold"):
        index_tensors = [getattr(case, name, None) for name in _INDEX_NAMES]
        index = [i for i, a in enumerate(args) if any(a is t for t in index_tensors if t is not None)]
        ring = []
        for _ in range(_COLD_RING):
            fresh = list(args)
            for i in index:
                fresh[i] = args[i].clone()
            ring.append(tuple(fresh))
        turn = [0]

        def run():
            turn[0] = (turn[0] + 1) % _COLD_RING
            fn(*ring[turn[0]], out, lse, **kw)
            return out, lse
    else:
        def run():
            fn(*args, out, lse, **kw)  # destination passing: inputs (incl. sm_scale), then output, lse
            return out, lse

    try:
        run()  # first call compiles; a NotImplementedError here means "not written yet"
    except NotImplementedError as exc:
        raise Unavailable(f"not available: {exc or 'NotImplementedError'}") from exc
    return Prepared(run)


# ----------------------------------------------------------------------------- FlashInfer


def _flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise Unavailable(f"skipped: flashinfer not installed ({exc})") from exc
    return flashinfer


def _workspace(device):
    import torch

    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # zeroed: decode needs it


def _our_wrappers():
    """cute_attn.flashinfer: our FlashInfer-compatible wrappers, set up by the FlashInfer runners below (the
    ``cute_attn_wrapper`` rows: what an engine that swapped the import pays per layer)."""
    try:
        import cute_attn.flashinfer as wrappers
    except ImportError as exc:
        raise Unavailable(f"not available: cannot import cute_attn.flashinfer ({exc})") from exc
    return wrappers


def setup_flashinfer_prefill(case, backend: str, fi=None) -> Prepared:
    """BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=fa2|fa3); plan once; run with out/lse.
    FlashInfer's lse is base 2 by default (lse_base="log2"), layout [T, H] ("NH"). ``fi``: the module whose wrapper
    runs (default: flashinfer; ``_our_wrappers()`` for ours)."""
    import torch

    fi = fi or _flashinfer()
    d = _dims(case)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(case.q.device), "NHD", backend=backend)
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len,
           d["num_qo_heads"], d["num_kv_heads"], d["head_dim"], d["page_size"],
           causal=True, sm_scale=float(case.sm_scale),
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out, lse = case.new_outputs()
    kv = (case.k_cache, case.v_cache)

    def run():
        return w.run(case.q, kv, out=out, lse=lse, return_lse=True)

    return Prepared(run)


# FlashInfer's CUDA-core decode is templated on these group sizes (DISPATCH_GQA_GROUP_SIZE).
_FI_CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


def setup_flashinfer_decode(case, tensor_cores: bool, fi=None) -> Prepared:
    """BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=...); plan once; run.
    lse is base 2, [B, H]. ``fi``: as :func:`setup_flashinfer_prefill`."""
    import torch

    fi = fi or _flashinfer()
    d = _dims(case)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(case.q.device), "NHD",
                                              use_tensor_cores=tensor_cores)
    out, lse = case.new_outputs()
    kv = (case.k_cache, case.v_cache)

    def run():
        return w.run(case.q, kv, out=out, lse=lse, return_lse=True)

    try:
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len,
               d["num_qo_heads"], d["num_kv_heads"], d["head_dim"], d["page_size"],
               sm_scale=float(case.sm_scale),
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        run()  # the group-size dispatch fails at plan or first run; surface it as a skip
    except Exception as exc:
        group = d["num_qo_heads"] // d["num_kv_heads"]
        if not tensor_cores and group not in _FI_CUDA_CORE_GROUPS and not fi.__name__.startswith("cute_attn"):
            raise Unavailable(f"skipped: CUDA-core decode rejects group size {group}: "
                              f"{type(exc).__name__}: {exc}") from exc
        raise
    note = ""
    resolved = getattr(w, "resolved_backend", None)
    if isinstance(resolved, str):
        note = f"backend={resolved}"
    return Prepared(run, note=note)


def setup_flashinfer_mla(case, backend: str, causal: bool = True, fmla=None) -> Prepared:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=fa2|fa3), any page size the cache has.
    Prefill: causal. Decode: the case's qo_indptr (0, 1, ..., batch) with causal=False, the same mask for one
    query per request. kv_len_arr is each request's key count (not its page count: they differ above page 1).
    0.7.2 form: plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr),
    ..., query_layout="split", kv_cache_layout="split", lse_mode="base2") then
    run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=, lse=, return_lse=True).
    Older releases only have the flat positional plan/run; used when MLAPlanMetadata is absent (as in ours:
    ``fmla`` = ``_our_wrappers()``)."""
    import torch

    if fmla is None:
        _flashinfer()
        try:
            import flashinfer.mla as fmla
        except ImportError as exc:
            raise Unavailable(f"skipped: flashinfer.mla missing ({exc})") from exc
    num_heads, ckv_dim = case.q_nope.shape[1], case.q_nope.shape[2]
    kpe_dim = case.q_pe.shape[2]
    page_size = case.ckv_cache.shape[1]
    kv_len_arr = torch.tensor(case.kv_lens, dtype=torch.int32, device=case.kv_indptr.device)
    w = fmla.BatchMLAPagedAttentionWrapper(_workspace(case.q_nope.device), backend=backend)
    common = dict(num_heads=num_heads, head_dim_ckv=ckv_dim, head_dim_kpe=kpe_dim,
                  page_size=page_size, causal=causal, sm_scale=float(case.sm_scale),
                  q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out, lse = case.new_outputs()
    meta_cls = getattr(fmla, "MLAPlanMetadata", None)
    if meta_cls is not None:
        w.plan(metadata=meta_cls.csr(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr),
               query_layout="split", kv_cache_layout="split", lse_mode="base2", **common)
        query, kv = (case.q_nope, case.q_pe), (case.ckv_cache, case.kpe_cache)

        def run():
            return w.run(query=query, kv_cache=kv, out=out, lse=lse, return_lse=True)
    else:
        w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr, **common)

        def run():
            return w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache,
                         out=out, lse=lse, return_lse=True)

    return Prepared(run)


# ----------------------------------------------------------------------------- FA4


def _fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        raise Unavailable(f"skipped: flash_attn.cute (FA4) not installed ({exc})") from exc
    return flash_attn_varlen_func


def _page_table(kv_indptr, kv_indices):
    """[batch, max_pages] int32 page table from CSR; padding uses page 0 (a valid id, never read)."""
    import torch

    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    b = counts.numel()
    width = max(int(counts.max().item()) if b else 0, 1)
    table = torch.zeros(b, width, dtype=torch.int32, device=kv_indices.device)
    col = torch.arange(width, device=kv_indices.device)
    mask = col[None, :] < counts[:, None]
    table[mask] = kv_indices[: int(kv_indptr[-1].item())].to(torch.int32)
    return table.contiguous(), counts


def _finite_tails(cache, kv_indptr, kv_indices, last_len):
    """Copy of a [pages, page_size, ...] cache with the unused tail slots of each request's last
    page zeroed. FA4 documents that such rows must be finite (0 * NaN), while the bench poisons
    them with NaN; unused pages may stay NaN."""
    import torch

    out = cache.clone()
    counts = kv_indptr[1:] - kv_indptr[:-1]
    has = counts > 0
    last_pages = kv_indices[(kv_indptr[1:] - 1)[has].long()].long()
    slot = torch.arange(cache.shape[1], device=cache.device)
    dead = slot[None, :] >= last_len[has].long()[:, None]  # [n, page_size]
    tail = out[last_pages]
    tail[dead] = 0
    out[last_pages] = tail
    return out


def fa4_lse_to_base2(lse, heads_first: bool):
    """FA4 returns natural-log lse, [H, T] for varlen without qv; ours is base 2, [T, H]."""
    lse = lse.float()
    if heads_first:
        lse = lse.transpose(0, 1)
    return (lse / LN2).contiguous()


#: page sizes FA4's page-table path has run correctly at in this bench (H200, FA4 4.0.0b36): elsewhere a failure
#: is reported as "not available" rather than an error. Its page size is k_cache.shape[1] (no argument): the
#: TMA path at the kernel's tile width, a cp.async gather below it (``paged_kv_non_tma``).
FA4_KNOWN_PAGE_SIZES = (64,)


def setup_fa4_gqa(case, kernel: str) -> Prepared:
    """flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, max_seqlen_q=, seqused_k=,
    page_table=, softmax_scale=, causal=, return_lse=True). FA4's lse is natural log with
    layout [H, T] (varlen, no qv): normalised to base 2 [T, H] outside timing.
    Decode is the same call with one query per request (causal is then irrelevant).
    The page size is the cache's own (k_cache.shape[1]); at a page size FA4 has not run at here
    (FA4_KNOWN_PAGE_SIZES) a failing first call is "not available", not an error."""
    import torch

    fn = _fa4()
    causal = op_of(kernel) != "decode"
    page_size = case.k_cache.shape[1]
    table, counts = _page_table(case.kv_indptr, case.kv_indices)
    kv_lens = torch.where(counts > 0, (counts - 1) * page_size + case.kv_last_page_len.long(),
                          torch.zeros_like(counts)).to(torch.int32)
    if causal:
        cu_q = case.qo_indptr.to(torch.int32)
        max_q = int((cu_q[1:] - cu_q[:-1]).max().item())
    else:
        cu_q = torch.arange(case.q.shape[0] + 1, dtype=torch.int32, device=case.q.device)
        max_q = 1
    k = _finite_tails(case.k_cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    v = _finite_tails(case.v_cache, case.kv_indptr, case.kv_indices, case.kv_last_page_len)
    q, scale = case.q, float(case.sm_scale)

    @torch.inference_mode()
    def run():
        return fn(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=kv_lens,
                  page_table=table, softmax_scale=scale, causal=causal, return_lse=True)

    def normalize(r):
        return r[0], fa4_lse_to_base2(r[1], heads_first=True)

    if page_size not in FA4_KNOWN_PAGE_SIZES:
        try:
            run()  # compiles; a page size its page-table path refuses fails here
            torch.cuda.synchronize()
        except Exception as exc:
            raise Unavailable(f"not available: FA4's page-table path rejected page size {page_size}: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    return Prepared(run, normalize, note="fa4: last-page tail slots zeroed (FA4 needs finite rows)")


def setup_fa4_mla(case) -> Prepared:
    """FA4's absorbed-MLA path (q=q_pe, k=kpe, v=ckv, qv=q_nope) asserts a Blackwell GPU; on
    sm_90 head_dim_v is capped at 256, so there is no way to run a 512-wide V there."""
    import torch

    fn = _fa4()
    major = torch.cuda.get_device_capability(case.q_nope.device)[0]
    if major not in (10, 11):
        raise Unavailable(f"skipped: FA4 MLA (qv) path is Blackwell-only; sm_{major}x caps head_dim_v "
                          "at 256 and this definition has V=512")
    table, counts = _page_table(case.kv_indptr, case.kv_indices)
    cu_q = case.qo_indptr.to(torch.int32)
    max_q = int((cu_q[1:] - cu_q[:-1]).max().item())
    seqused = counts.to(torch.int32)
    n = case.ckv_cache.shape[0]
    k = case.kpe_cache.reshape(n, case.kpe_cache.shape[1], 1, case.kpe_cache.shape[-1])
    v = case.ckv_cache.reshape(n, case.ckv_cache.shape[1], 1, case.ckv_cache.shape[-1])
    scale = float(case.sm_scale)

    @torch.inference_mode()
    def run():
        return fn(case.q_pe, k, v, qv=case.q_nope, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                  seqused_k=seqused, page_table=table, softmax_scale=scale, causal=True,
                  return_lse=True)

    def normalize(r):
        return r[0], fa4_lse_to_base2(r[1], heads_first=False)  # with qv FA4's lse is [T, H]

    return Prepared(run, normalize)


# ----------------------------------------------------------------------------- registry


def runners_for(kernel: str) -> List[Tuple[str, Callable]]:
    """(impl name, setup(case) -> Prepared) in display order, ours first; by the definition's op, so every
    family member (any head layout / page size) gets the same peers."""
    op = op_of(kernel)
    ours = [(impl, lambda c, mode=mode: setup_cute_attn(kernel, c, mode)) for impl, mode in CUTE_ATTN_MODES.items()]
    wrapper = {"prefill": lambda c: setup_flashinfer_prefill(c, "auto", _our_wrappers()),
               "decode": lambda c: setup_flashinfer_decode(c, True, _our_wrappers()),
               "mla": lambda c: setup_flashinfer_mla(c, "auto", fmla=_our_wrappers()),
               "mla_decode": lambda c: setup_flashinfer_mla(c, "auto", causal=False, fmla=_our_wrappers())}.get(op)
    if wrapper is not None:  # our FlashInfer-compatible wrapper, planned once as FlashInfer's rows are
        ours.append(("cute_attn_wrapper", wrapper))
    if op == "prefill":
        return [*ours,
                ("flashinfer_fa2", lambda c: setup_flashinfer_prefill(c, "fa2")),
                ("flashinfer_fa3", lambda c: setup_flashinfer_prefill(c, "fa3")),
                ("fa4", lambda c: setup_fa4_gqa(c, kernel))]
    if op == "decode":
        return [*ours,
                ("flashinfer_tc", lambda c: setup_flashinfer_decode(c, True)),
                ("flashinfer_cuda_cores", lambda c: setup_flashinfer_decode(c, False)),
                ("fa4", lambda c: setup_fa4_gqa(c, kernel))]
    if op == "mtp":  # FlashInfer's paged prefill wrapper takes draft tokens as short causal runs
        return [*ours,
                ("flashinfer_fa2", lambda c: setup_flashinfer_prefill(c, "fa2")),
                ("flashinfer_fa3", lambda c: setup_flashinfer_prefill(c, "fa3"))]
    if op == "mla":
        return [*ours,
                ("flashinfer_fa2", lambda c: setup_flashinfer_mla(c, "fa2")),
                ("flashinfer_fa3", lambda c: setup_flashinfer_mla(c, "fa3")),
                ("fa4", setup_fa4_mla)]
    if op == "mla_decode":  # FA4 has no paged MLA decode
        return [*ours,
                ("flashinfer_fa2", lambda c: setup_flashinfer_mla(c, "fa2", causal=False)),
                ("flashinfer_fa3", lambda c: setup_flashinfer_mla(c, "fa3", causal=False))]
    raise ValueError(f"the bench has no runners for {kernel!r} ({op})")


# ----------------------------------------------------------------------------- checking


def reference(kernel: str, case):
    """(out, lse base 2) from cute_attn.reference, float32 math from the same inputs."""
    from cute_attn import reference as ref

    fn = {"prefill": ref.gqa_paged_prefill_ref, "decode": ref.gqa_paged_decode_ref, "mtp": ref.gqa_paged_prefill_ref,
          "mla": ref.mla_paged_prefill_ref, "mla_decode": ref.mla_paged_decode_ref}[op_of(kernel)]
    return fn(*case.inputs())


def _fails(x, y, atol: float = 1e-2, rtol: float = 1e-2):
    """FlashInfer-Bench's rule: an element fails iff |x-y| > atol AND |x-y|/(|y|+1e-8) > rtol."""
    diff = (x - y).abs()
    return (diff > atol) & (diff / (y.abs() + 1e-8) > rtol)


def check(result, ref) -> Tuple[bool, str]:
    """Compare normalised (out, lse) with the reference. Any NaN/inf in out fails; lse is compared
    on rows whose reference lse is finite (rows that see at least one key)."""
    import torch

    out, lse = result
    rout, rlse = ref
    if tuple(out.shape) != tuple(rout.shape):
        return False, f"out shape {tuple(out.shape)} != {tuple(rout.shape)}"
    o, r = out.float(), rout.float()
    if not torch.isfinite(o).all():
        return False, f"out has {int((~torch.isfinite(o)).sum())} non-finite"
    bad = int(_fails(o, r).sum())
    if bad:
        return False, f"out: {bad} elements fail, max |diff| {float((o - r).abs().max()):.3g}"
    if lse is None:
        return False, "no lse returned"
    l, rl = lse.float().reshape(rlse.shape), rlse.float()
    rows = torch.isfinite(rl)
    if not torch.isfinite(l[rows]).all():
        return False, "lse non-finite on rows that see keys"
    bad = int(_fails(l[rows], rl[rows]).sum())
    if bad:
        return False, f"lse: {bad} fail, max |diff| {float((l[rows] - rl[rows]).abs().max()):.3g}"
    return True, ""
