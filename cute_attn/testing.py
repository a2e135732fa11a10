"""Test inputs that make wrong kernels fail loudly: ragged batches, shuffled pools, poison, garbage.

Case builders put each request's pages at random places in a pool larger than needed; every slot no
request owns (unused pages, the tail of each last page) holds NaN, so a kernel that reads past a
sequence end or a wrong page produces NaN and fails. ``new_outputs()`` returns outputs pre-filled with
NaN, so an element the kernel never writes fails too.

Hypothesis strategies generate the batches; ``load_hypothesis_profile()`` picks ``ci`` (derandomised,
CI-sized) or ``fuzz`` (thousands of examples) from ``CUTE_ATTN_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from . import reference

__all__ = [
    "GqaPrefillCase",
    "GqaDecodeCase",
    "MlaPrefillCase",
    "MlaDecodeCase",
    "make_gqa_prefill_case",
    "make_gqa_decode_case",
    "make_gqa_multi_token_decode_case",
    "make_mla_prefill_case",
    "make_mla_decode_case",
    "interleave_kv",
    "refill_page_table",
    "ragged_batches",
    "decode_batches",
    "multi_token_batches",
    "load_hypothesis_profile",
    "benchmark_mismatches",
    "assert_close_benchmark",
]

MLA_SM_SCALE = 0.1352337747812271  # DeepSeek-V3 workloads' value


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape, g, device) -> torch.Tensor:
    # Drawn on the target device (a 1 GB MLA pool would take seconds on the CPU) from a generator
    # seeded by the case's CPU generator, so one seed gives one case per device.
    device = torch.device(device)
    dev_gen = torch.Generator(device=device)
    dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    return torch.randn(shape, generator=dev_gen, dtype=torch.float32, device=device).to(torch.bfloat16)


def _int32(values, device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _indptr(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def _nan_outputs(shape_out, shape_lse, device):
    out = torch.full(shape_out, float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full(shape_lse, float("nan"), dtype=torch.float32, device=device)
    return out, lse


@dataclass
class _PagedPool:
    """Page ids of each request inside a shuffled pool; unused pages and tail slots are poisoned."""

    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]
    num_pages: int
    poison_slots: list[tuple[int, int]] = field(default_factory=list)  # (page, first poisoned slot)


def _shuffled_pool(kv_lens, page_size: int, extra_pages: int | None, g: torch.Generator) -> _PagedPool:
    pages_per_req = [math.ceil(n / page_size) for n in kv_lens]
    used = sum(pages_per_req)
    extra = max(2, used // 4) if extra_pages is None else extra_pages
    num_pages = used + extra
    perm = torch.randperm(num_pages, generator=g).tolist()
    indices = perm[:used]
    last = [0 if n == 0 else n - (p - 1) * page_size for n, p in zip(kv_lens, pages_per_req)]
    ptr = _indptr(pages_per_req)
    poison = [(pid, 0) for pid in perm[used:]]
    for b, n in enumerate(pages_per_req):
        if n and last[b] < page_size:
            poison.append((indices[ptr[b + 1] - 1], last[b]))
    return _PagedPool(ptr, indices, last, num_pages, poison)


def _poison(cache: torch.Tensor, slots: list[tuple[int, int]]) -> None:
    whole = [page for page, first in slots if first == 0]
    if whole:
        cache[torch.tensor(whole, device=cache.device)] = float("nan")
    for page, first_slot in slots:
        if first_slot:
            cache[page, first_slot:] = float("nan")


@dataclass
class GqaPrefillCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    sm_scale: float
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int

    def inputs(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.qo_indptr, self.kv_indptr, self.kv_indices,
                self.kv_last_page_len, self.sm_scale)

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _nan_outputs((self.q.shape[0], self.q.shape[1], self.v_cache.shape[-1]), self.q.shape[:2], self.q.device)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.gqa_paged_prefill_ref(*self.inputs())


@dataclass
class GqaDecodeCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    sm_scale: float
    kv_lens: list[int]
    page_size: int

    def inputs(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len,
                self.sm_scale)

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _nan_outputs((self.q.shape[0], self.q.shape[1], self.v_cache.shape[-1]), self.q.shape[:2], self.q.device)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.gqa_paged_decode_ref(*self.inputs())


@dataclass
class MlaPrefillCase:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    sm_scale: float
    q_lens: list[int]
    kv_lens: list[int]
    kv_last_page_len: torch.Tensor | None = None  # None: page size 1 in FlashInfer-Bench's ps1 order
    page_size: int = 1

    def inputs(self) -> tuple:
        """The ps1 order (no ``kv_last_page_len``) at page size 1, else the ps64 order (it before ``sm_scale``)."""
        head = (self.q_nope, self.q_pe, self.ckv_cache, self.kpe_cache, self.qo_indptr, self.kv_indptr,
                self.kv_indices)
        if self.kv_last_page_len is None:
            return (*head, self.sm_scale)
        return (*head, self.kv_last_page_len, self.sm_scale)

    def new_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _nan_outputs(self.q_nope.shape, self.q_nope.shape[:2], self.q_nope.device)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.mla_paged_prefill_ref(*self.inputs())


@dataclass
class MlaDecodeCase(MlaPrefillCase):
    """An MLA decode batch: one query per request; ``inputs()`` in the decode definitions' orders (no
    ``qo_indptr``: it stays on the case, ``0, 1, ..., batch``, for peers whose API takes one)."""

    def inputs(self) -> tuple:
        """ps1 order ``(..., kv_indices, sm_scale)`` at page size 1, else ``(..., kv_indices, kv_last_page_len,
        sm_scale)`` (ps64)."""
        head = (self.q_nope, self.q_pe, self.ckv_cache, self.kpe_cache, self.kv_indptr, self.kv_indices)
        if self.kv_last_page_len is None:
            return (*head, self.sm_scale)
        return (*head, self.kv_last_page_len, self.sm_scale)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.mla_paged_decode_ref(*self.inputs())


def _paged_caches(kv_lens, num_kv_heads, head_dim, page_size, extra_pages, g, device):
    pool = _shuffled_pool(kv_lens, page_size, extra_pages, g)
    shape = (pool.num_pages, page_size, num_kv_heads, head_dim)
    k_cache = _randn(shape, g, device)
    v_cache = _randn(shape, g, device)
    _poison(k_cache, pool.poison_slots)
    _poison(v_cache, pool.poison_slots)
    return pool, k_cache, v_cache


def make_gqa_prefill_case(
    q_lens, kv_lens, *, num_qo_heads: int = 32, num_kv_heads: int = 4, head_dim: int = 128,
    page_size: int = 64, device="cpu", seed: int = 0, extra_pages: int | None = None,
    sm_scale: float | None = None,
) -> GqaPrefillCase:
    """A ragged incremental-prefill batch; ``q_lens[b]`` queries of request b over ``kv_lens[b]`` keys."""
    if len(q_lens) != len(kv_lens):
        raise ValueError("q_lens and kv_lens must have one entry per request")
    g = _generator(seed)
    pool, k_cache, v_cache = _paged_caches(kv_lens, num_kv_heads, head_dim, page_size, extra_pages, g, device)
    q = _randn((sum(q_lens), num_qo_heads, head_dim), g, device)
    return GqaPrefillCase(
        q=q, k_cache=k_cache, v_cache=v_cache,
        qo_indptr=_int32(_indptr(q_lens), device),
        kv_indptr=_int32(pool.kv_indptr, device),
        kv_indices=_int32(pool.kv_indices, device),
        kv_last_page_len=_int32(pool.kv_last_page_len, device),
        sm_scale=float(sm_scale if sm_scale is not None else head_dim**-0.5),
        q_lens=[int(x) for x in q_lens], kv_lens=[int(x) for x in kv_lens], page_size=page_size,
    )


def make_gqa_decode_case(
    kv_lens, *, num_qo_heads: int = 20, num_kv_heads: int = 4, head_dim: int = 128, page_size: int = 64,
    device="cpu", seed: int = 0, extra_pages: int | None = None, sm_scale: float | None = None,
) -> GqaDecodeCase:
    """A decode batch: one query per request over ``kv_lens[b]`` keys (0 allowed: no pages)."""
    g = _generator(seed)
    pool, k_cache, v_cache = _paged_caches(kv_lens, num_kv_heads, head_dim, page_size, extra_pages, g, device)
    q = _randn((len(kv_lens), num_qo_heads, head_dim), g, device)
    return GqaDecodeCase(
        q=q, k_cache=k_cache, v_cache=v_cache,
        kv_indptr=_int32(pool.kv_indptr, device),
        kv_indices=_int32(pool.kv_indices, device),
        kv_last_page_len=_int32(pool.kv_last_page_len, device),
        sm_scale=float(sm_scale if sm_scale is not None else head_dim**-0.5),
        kv_lens=[int(x) for x in kv_lens], page_size=page_size,
    )


def make_gqa_multi_token_decode_case(
    q_lens, kv_lens, *, num_qo_heads: int = 20, num_kv_heads: int = 4, head_dim: int = 128, page_size: int = 64,
    device="cpu", seed: int = 0, extra_pages: int | None = None, sm_scale: float | None = None,
) -> GqaPrefillCase:
    """A multi-token (speculative) decode batch: ``q_lens[b]`` (1..8) draft tokens, the last positions of request
    b's ``kv_lens[b]`` keys. The prefill case with the decode definition's heads (its reference is prefill's)."""
    return make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, page_size=page_size, device=device, seed=seed,
                                 extra_pages=extra_pages, sm_scale=sm_scale)


def make_mla_prefill_case(
    q_lens, kv_lens, *, num_heads: int = 16, ckv_dim: int = 512, kpe_dim: int = 64, page_size: int = 1,
    num_pages: int | None = None, device="cpu", seed: int = 0, sm_scale: float = MLA_SM_SCALE,
    with_last_page_len: bool | None = None,
) -> MlaPrefillCase:
    """An absorbed-MLA prefill batch over a shuffled paged pool; slots no request owns hold NaN.

    Page size 1 (the default): the ps1 order, no ``kv_last_page_len`` unless ``with_last_page_len``; ``num_pages``
    is the pool's row count. Page size > 1: pages of each request at random places, NaN in unused pages and in
    the tail of every last page, ``kv_last_page_len`` set (the ps64 order); ``num_pages`` (default: used + a
    quarter) must hold every request's pages.
    """
    if len(q_lens) != len(kv_lens):
        raise ValueError("q_lens and kv_lens must have one entry per request")
    g = _generator(seed)
    total_q = sum(q_lens)
    if page_size == 1:
        total_kv = sum(kv_lens)
        num_pages = max(2 * total_kv, 8) if num_pages is None else num_pages
        if num_pages < total_kv:
            raise ValueError(f"num_pages ({num_pages}) must hold every key ({total_kv})")
        perm = torch.randperm(num_pages, generator=g)
        used = perm[:total_kv]
        ckv = _randn((num_pages, 1, ckv_dim), g, device)
        kpe = _randn((num_pages, 1, kpe_dim), g, device)
        unused = torch.ones(num_pages, dtype=torch.bool)
        unused[used] = False
        unused = unused.to(device)
        ckv[unused] = float("nan")
        kpe[unused] = float("nan")
        kv_indptr, kv_indices = _indptr(kv_lens), used.tolist()
        last = [min(1, int(n)) for n in kv_lens] if with_last_page_len else None
    else:
        used_pages = sum(math.ceil(n / page_size) for n in kv_lens)
        if num_pages is not None and num_pages < used_pages:
            raise ValueError(f"num_pages ({num_pages}) must hold every request's pages ({used_pages})")
        pool = _shuffled_pool(kv_lens, page_size, None if num_pages is None else num_pages - used_pages, g)
        ckv = _randn((pool.num_pages, page_size, ckv_dim), g, device)
        kpe = _randn((pool.num_pages, page_size, kpe_dim), g, device)
        _poison(ckv, pool.poison_slots)
        _poison(kpe, pool.poison_slots)
        kv_indptr, kv_indices = pool.kv_indptr, pool.kv_indices
        last = pool.kv_last_page_len if with_last_page_len is not False else None
    return MlaPrefillCase(
        q_nope=_randn((total_q, num_heads, ckv_dim), g, device),
        q_pe=_randn((total_q, num_heads, kpe_dim), g, device),
        ckv_cache=ckv, kpe_cache=kpe,
        qo_indptr=_int32(_indptr(q_lens), device),
        kv_indptr=_int32(kv_indptr, device),
        kv_indices=_int32(kv_indices, device),
        sm_scale=float(sm_scale),
        q_lens=[int(x) for x in q_lens], kv_lens=[int(x) for x in kv_lens],
        kv_last_page_len=None if last is None else _int32(last, device), page_size=page_size,
    )


def make_mla_decode_case(
    kv_lens, *, num_heads: int = 16, ckv_dim: int = 512, kpe_dim: int = 64, page_size: int = 1,
    num_pages: int | None = None, device="cpu", seed: int = 0, sm_scale: float = MLA_SM_SCALE,
) -> MlaDecodeCase:
    """An absorbed-MLA decode batch: one query per request over ``kv_lens[b]`` keys (0 allowed: no pages), in the
    pool :func:`make_mla_prefill_case` builds (shuffled, NaN wherever no request owns a slot); ``kv_last_page_len``
    exactly where the definition has it (page size > 1)."""
    case = make_mla_prefill_case([1] * len(kv_lens), kv_lens, num_heads=num_heads, ckv_dim=ckv_dim, kpe_dim=kpe_dim,
                                 page_size=page_size, num_pages=num_pages, device=device, seed=seed,
                                 sm_scale=sm_scale, with_last_page_len=page_size > 1)
    return MlaDecodeCase(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})


def with_edge_page_table(case, *, share: tuple[int, int] = (1, 2)):
    """The same GQA batch under a page table that is valid but sits on the edges a kernel can get wrong.

    - Request ``share[1]`` reads request ``share[0]``'s pages (prefix caching shares pages; the two must
      have one kv length): its own pages are left unused.
    - The pool's last page (id ``num_pages - 1``) holds the first page of the last request with pages:
      that page's contents and id are swapped with its old one's, so the batch means the same.
    Empty requests come from the lengths the caller built the case with.
    """
    a, b = share
    if case.kv_lens[a] != case.kv_lens[b]:
        raise ValueError(f"requests {a} and {b} must have one kv length to share pages")
    ptr = case.kv_indptr.tolist()
    indices = case.kv_indices.clone()
    indices[ptr[b]:ptr[b + 1]] = indices[ptr[a]:ptr[a + 1]]
    last_page = case.k_cache.shape[0] - 1
    owners = [r for r in range(len(ptr) - 1) if ptr[r + 1] > ptr[r] and r != b]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if owners:
        old = int(indices[ptr[owners[-1]]])
        if old != last_page:
            swap = torch.tensor([old, last_page], device=indices.device)
            for cache in (k_cache, v_cache):
                cache[swap] = cache[swap.flip(0)]
            is_old, is_last = indices == old, indices == last_page
            indices[is_old] = last_page
            indices[is_last] = old
    return dataclasses.replace(case, kv_indices=indices, k_cache=k_cache, v_cache=v_cache)


def refill_page_table(kv_lens, page_size: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                      kv_last_page_len: torch.Tensor, rng, *, empty_last: int = 0) -> None:
    """A new batch of ``kv_lens`` written in place into index tensors sized for capacity (a CUDA graph replays the
    same tensors): each request's pages drawn without repeats from the pool of ``kv_indices.numel()`` pages
    (``rng.permutation``, a numpy Generator), the unused tail of ``kv_indices`` 0, ``kv_last_page_len`` each
    request's last page fill (``empty_last`` for a request without pages: 0 or 1 both pass the rules)."""
    pages = [-(-n // page_size) for n in kv_lens]
    ids = rng.permutation(kv_indices.numel())[: sum(pages)]
    kv_indptr.copy_(torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32))
    kv_indices.zero_()
    kv_indices[: len(ids)] = torch.tensor(ids, dtype=torch.int32)
    kv_last_page_len.copy_(torch.tensor([(n - 1) % page_size + 1 if n else empty_last for n in kv_lens],
                                        dtype=torch.int32))


def interleave_kv(case):
    """The same case with K and V as the views ``kv[:, 0]`` / ``kv[:, 1]`` of one ``[pages, 2, ...]`` tensor.

    The layout engines use for a combined KV cache: pages are strided, rows stay compact.
    """
    kv = torch.empty((case.k_cache.shape[0], 2, *case.k_cache.shape[1:]), dtype=case.k_cache.dtype,
                     device=case.k_cache.device)
    kv[:, 0] = case.k_cache
    kv[:, 1] = case.v_cache
    return dataclasses.replace(case, k_cache=kv[:, 0], v_cache=kv[:, 1])


# ---------------------------------------------------------------------------------------------
# Comparison by the benchmark's rule
# ---------------------------------------------------------------------------------------------
def benchmark_mismatches(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-2, rtol: float = 1e-2):
    """Boolean mask of failing elements: NaN/inf where the reference is finite, or both errors too large.

    An element fails only if ``|x-y| > atol`` AND ``|x-y| / (|y| + 1e-8) > rtol``. Infinite reference
    values (lse = -inf of a row that sees no key) must be matched exactly.
    """
    x = actual.float()
    y = expected.float().to(x.device)
    finite_ref = torch.isfinite(y)
    diff = (x - y).abs()
    too_far = (diff > atol) & (diff / (y.abs() + 1e-8) > rtol)
    bad_finite = finite_ref & (too_far | ~torch.isfinite(x))
    bad_inf = ~finite_ref & (x != y)
    return bad_finite | bad_inf


def assert_close_benchmark(actual: torch.Tensor, expected: torch.Tensor, name: str = "output") -> None:
    bad = benchmark_mismatches(actual, expected)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        n = int(bad.sum())
        raise AssertionError(
            f"{name}: {n} of {bad.numel()} elements fail |x-y|>1e-2 and rel>1e-2; first at {idx}: "
            f"got {actual[tuple(idx)].item()}, expected {expected[tuple(idx)].item()}"
        )


# ---------------------------------------------------------------------------------------------
# Hypothesis strategies and profiles (hypothesis is a test dependency: imported lazily)
# ---------------------------------------------------------------------------------------------
def even_batches(*, max_batch: int = 8, max_q: int = 4, max_kv: int = 1024):
    """Strategy of ``(q_lens, kv_lens)``: requests of the same keys and few queries (decode-like), the batches
    ``PlanConfig.even_pieces`` cuts in even pieces; the q lengths may differ (one q tile each when short enough)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        batch = draw(st.integers(1, max_batch))
        kv = draw(st.integers(0, max_kv))
        q_lens = [draw(st.integers(min(1, kv), min(max_q, kv) if kv else 0)) for _ in range(batch)]
        return q_lens, [kv] * batch

    return build()


def ragged_batches(
    *, max_batch: int = 8, max_q: int = 256, max_kv: int = 1024, kv_at_least_q: bool = True,
    allow_empty: bool = True,
):
    """Strategy of ``(q_lens, kv_lens)``: ragged requests, empty ones, one long request among short ones."""
    from hypothesis import strategies as st

    min_q = 0 if allow_empty else 1

    @st.composite
    def build(draw):
        batch = draw(st.integers(1, max_batch))
        long_one = draw(st.booleans())
        q_lens, kv_lens = [], []
        for b in range(batch):
            hi_q = max_q if (long_one and b == 0) else max(min_q, max_q // 8)
            q = draw(st.integers(min_q, max(min_q, hi_q)))
            lo_kv = q if kv_at_least_q else 0
            if not allow_empty:
                lo_kv = max(lo_kv, 1)
            kv = draw(st.integers(min(lo_kv, max_kv), max(max_kv, lo_kv)))
            q_lens.append(q)
            kv_lens.append(kv)
        order = draw(st.permutations(range(batch)))
        return [q_lens[i] for i in order], [kv_lens[i] for i in order]

    return build()


def decode_batches(*, max_batch: int = 64, max_kv: int = 4096, allow_empty: bool = True):
    """Strategy of ``kv_lens`` for decode (one query per request)."""
    from hypothesis import strategies as st

    return st.lists(st.integers(0 if allow_empty else 1, max_kv), min_size=1, max_size=max_batch)


def multi_token_batches(*, max_batch: int = 32, max_q: int = 8, max_kv: int = 4096):
    """Strategy of ``(q_lens, kv_lens)`` for multi-token decode: 1..max_q tokens per request, kv_len >= q_len,
    and now and then one long request among short ones (it splits: partials and the fused merge)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        batch = draw(st.integers(1, max_batch))
        long_one = draw(st.booleans())
        q_lens = draw(st.lists(st.integers(1, max_q), min_size=batch, max_size=batch))
        kv_lens = []
        for b, q in enumerate(q_lens):
            hi = max_kv if (long_one and b == 0) else max(q, max_kv // 8)
            kv_lens.append(draw(st.integers(q, max(q, hi))))
        order = draw(st.permutations(range(batch)))
        return [q_lens[i] for i in order], [kv_lens[i] for i in order]

    return build()


def load_hypothesis_profile() -> str:
    """Register the ``ci`` and ``fuzz`` profiles and load the one named by ``CUTE_ATTN_HYPOTHESIS_PROFILE``."""
    from hypothesis import HealthCheck, settings

    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", derandomize=True, max_examples=60, print_blob=True, **common)
    settings.register_profile("fuzz", max_examples=3000, print_blob=True, **common)
    name = os.environ.get("CUTE_ATTN_HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name
