"""Shared test setup: the hypothesis profile (ci or fuzz), the `gpu` marker's skip rule, and MKL's reproducible mode."""

import os

# The CPU float32 reference's einsums run on MKL, whose results may depend on the operands' memory alignment (its
# conditional numerical reproducibility): a request's reference alone and inside its batch differed in ~1 of 8
# processes (tests/test_batch_invariance_plans.py). This mode makes them alignment-independent; read lazily by MKL,
# so it holds although torch may already be imported. A value set by the caller wins.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402

from cute_attn.testing import load_hypothesis_profile

load_hypothesis_profile()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install must skip the tier, not crash collection
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def module_compile_cache(tmp_path_factory):
    """One compile cache per test module: each config compiles once there, never from a stale cache."""
    return tmp_path_factory.mktemp("cute_attn_cache")


@pytest.fixture
def isolated_compile_cache(module_compile_cache, monkeypatch):
    """Point the compile path at the module's cache, with the in-memory cache cleared around the test."""
    from cute_attn.compile import CACHE_DIR_ENV, clear_memory_cache

    monkeypatch.setenv(CACHE_DIR_ENV, str(module_compile_cache))
    clear_memory_cache()
    yield module_compile_cache
    clear_memory_cache()


def _mla_consumer_splits() -> list[str]:
    from cute_attn.ops.mla_prefill import SM90_CONSUMER_SPLITS

    return list(SM90_CONSUMER_SPLITS)


@pytest.fixture(params=_mla_consumer_splits())
def mla_consumers(request):
    """Run a test with each of the sm_90a MLA prefill kernel's consumer splits (``ops.mla_prefill.SM90_CONSUMERS``:
    both warpgroups compute all of S; S split by keys; one score warpgroup, its PV GEMMs in order or each issued
    just before the next S GEMM, or with O through the last K stage), whatever the default is: every
    public MLA entry (prefill, decode, plan_*) then builds it (``ops.mla_prefill.consumer_split``). Select one with
    ``-k shared_s`` and the like."""
    from cute_attn.ops.mla_prefill import consumer_split

    with consumer_split(request.param):
        yield request.param
