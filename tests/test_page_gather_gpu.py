"""Runs the TMA page gather on a GPU and compares bit-exactly with ``k_cache[page_ids]``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    from cute_attn.compile import CACHE_DIR_ENV, clear_memory_cache

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    clear_memory_cache()
    yield
    clear_memory_cache()


def _gather_fn(page_size: int, num_kv_heads: int, head_dim: int):
    from cute_attn.arch import resolve_arch
    from cute_attn.compile import compile_kernel
    from cute_attn.kernels.common.page_gather import PageGatherConfig

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    config = PageGatherConfig(
        arch=resolve_arch(None), page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    return compile_kernel(config)


def _bits(t):
    return t.view(torch.int16)


def _pool(num_pages, page_size, heads, dim, used, gen):
    """NaN everywhere except the pages in ``used``, which get random values."""
    pool = torch.full((num_pages, page_size, heads, dim), float("nan"), dtype=torch.bfloat16)
    pool[used] = torch.randn((len(used), page_size, heads, dim), generator=gen).to(torch.bfloat16)
    return pool.cuda()


@pytest.mark.parametrize(
    "page_size, heads, dim, num_pages, n",
    [(16, 8, 128, 97, 37), (16, 8, 128, 5, 1), (128, 2, 256, 9, 6)],
)
def test_gather_matches_indexing(page_size, heads, dim, num_pages, n):
    fn = _gather_fn(page_size, heads, dim)
    gen = torch.Generator().manual_seed(n * 1000 + num_pages)
    used = torch.randperm(num_pages, generator=gen)[:n]  # shuffled, distinct
    pool = _pool(num_pages, page_size, heads, dim, used, gen)
    page_ids = used.to(torch.int32).cuda()
    out = torch.full((n, page_size, heads, dim), 1234.0, dtype=torch.bfloat16, device="cuda")
    fn(pool, page_ids, out)
    torch.cuda.synchronize()
    expected = pool[page_ids.long()]
    assert not torch.isnan(expected).any()
    assert torch.equal(_bits(out), _bits(expected))


def test_same_function_serves_other_sizes_and_strided_pool():
    """One compile, different n / num_pages, and K as a strided view of a K/V pool."""
    page_size, heads, dim = 16, 8, 128
    fn = _gather_fn(page_size, heads, dim)
    gen = torch.Generator().manual_seed(7)
    for num_pages, n in [(300, 200), (3, 3)]:
        kv = torch.full((num_pages, 2, page_size, heads, dim), float("nan"), dtype=torch.bfloat16)
        used = torch.randperm(num_pages, generator=gen)[:n]
        kv[used, 0] = torch.randn((n, page_size, heads, dim), generator=gen).to(torch.bfloat16)
        kv = kv.cuda()
        k_cache = kv[:, 0]  # page stride 2 * page_size * heads * dim
        page_ids = used.to(torch.int32).cuda()
        out = torch.full((n, page_size, heads, dim), -7.0, dtype=torch.bfloat16, device="cuda")
        fn(k_cache, page_ids, out)
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(k_cache[page_ids.long()]))


def test_out_of_range_page_id_reads_zeros():
    page_size, heads, dim = 16, 8, 128
    fn = _gather_fn(page_size, heads, dim)
    gen = torch.Generator().manual_seed(3)
    pool = _pool(4, page_size, heads, dim, torch.arange(4), gen)
    page_ids = torch.tensor([2, 4, 1000], dtype=torch.int32, device="cuda")
    out = torch.full((3, page_size, heads, dim), 5.0, dtype=torch.bfloat16, device="cuda")
    fn(pool, page_ids, out)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out[0]), _bits(pool[2]))
    assert torch.count_nonzero(out[1:]) == 0
