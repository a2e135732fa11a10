"""Compile-only tests of the one compile path (no GPU needed), for both arches."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cute_attn import arch as arch_mod
from cute_attn import compile as compile_mod
from cute_attn.compile import (
    STATS,
    clear_memory_cache,
    compile_kernel,
    compile_kernel_with_info,
    compile_to_ptx,
    disk_key,
    registered_configs,
)
from cute_attn.kernels.common.page_gather import PageGatherConfig

ARCHS = ["sm_90a", "sm_100a"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One cache dir for the module so each arch compiles only once."""
    return tmp_path_factory.mktemp("cute_attn_cache")


@pytest.fixture(autouse=True)
def _isolated_cache(shared_cache, monkeypatch):
    monkeypatch.setenv(compile_mod.CACHE_DIR_ENV, str(shared_cache))
    clear_memory_cache()
    yield
    clear_memory_cache()


def _config(arch: str, **kw) -> PageGatherConfig:
    return PageGatherConfig(arch=arch, page_size=16, num_kv_heads=8, head_dim=128, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_with_tma_for_each_arch(arch):
    info = compile_kernel_with_info(_config(arch))
    assert info.source in ("compiled", "disk")
    assert callable(info.fn)
    assert info.object_path.is_file() and info.object_path.suffix == ".o"
    ptx = compile_to_ptx(_config(arch))
    assert f".target {arch}" in ptx
    # TMA load (completes on an mbarrier) and TMA store
    assert "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
    assert "mbarrier.try_wait.parity" in ptx


def test_memory_cache_returns_same_object():
    config = _config("sm_90a")
    first = compile_kernel(config)
    hits = STATS["memory_hit"]
    again = compile_kernel(_config("sm_90a"))  # equal, not identical, config
    assert again is first
    assert STATS["memory_hit"] == hits + 1


def test_disk_round_trip_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_mod.CACHE_DIR_ENV, str(tmp_path))
    config = _config("sm_100a")
    compiled = STATS["compiled"]
    assert compile_kernel_with_info(config).source == "compiled"
    assert STATS["compiled"] == compiled + 1
    clear_memory_cache()
    info = compile_kernel_with_info(config)
    assert info.source == "disk"
    assert STATS["compiled"] == compiled + 1  # nothing was recompiled
    assert callable(info.fn)
    assert "cp.async.bulk.tensor" in compile_to_ptx(config)
    assert STATS["compiled"] == compiled + 1


def test_disk_round_trip_fresh_process(shared_cache):
    compile_kernel(_config("sm_90a"))  # make sure the .o exists
    code = (
        "from cute_attn.kernels.common.page_gather import PageGatherConfig\n"
        "from cute_attn.compile import compile_kernel_with_info, STATS\n"
        "i = compile_kernel_with_info(PageGatherConfig(arch='sm_90a', page_size=16,"
        " num_kv_heads=8, head_dim=128))\n"
        "print(i.source, STATS['compiled'], type(i.fn).__name__)\n"
    )
    env = dict(os.environ, **{compile_mod.CACHE_DIR_ENV: str(shared_cache)})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-3:] == ["disk", "0", "Function"], res.stdout


def test_corrupt_object_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_mod.CACHE_DIR_ENV, str(tmp_path))
    config = _config("sm_90a")
    info = compile_kernel_with_info(config)
    info.object_path.write_bytes(b"not an object file")
    clear_memory_cache()
    assert compile_kernel_with_info(config).source == "compiled"


def test_cache_key_changes_with_every_field():
    base = _config("sm_90a")
    variants = [
        dataclasses.replace(base, arch="sm_100a"),
        dataclasses.replace(base, page_size=32),
        dataclasses.replace(base, num_kv_heads=4),
        dataclasses.replace(base, head_dim=64),
        dataclasses.replace(base, dtype="fp16"),
    ]
    keys = {base.cache_key()} | {v.cache_key() for v in variants}
    assert len(keys) == len(variants) + 1
    assert len({disk_key(base)} | {disk_key(v) for v in variants}) == len(variants) + 1
    assert base.cache_key() == _config("sm_90a").cache_key()  # stable
    assert base.cache_key().startswith("page_gather(")


def test_disk_key_covers_sources_and_versions():
    material = compile_mod.key_material(_config("sm_90a"))
    for needle in ("nvidia-cutlass-dsl=", "apache-tvm-ffi=", "sources=", "arch=sm_90a"):
        assert needle in material


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(head_dim=4), "multiple of 16 bytes"),
        (dict(page_size=512), "TMA box limit"),
        (dict(dtype="fp8"), "dtype"),
        (dict(arch="sm_80"), "not supported"),
    ],
)
def test_can_implement_rejects_with_reason(kwargs, needle):
    fields = dict(arch="sm_90a", page_size=16, num_kv_heads=8, head_dim=128)
    fields.update(kwargs)
    config = PageGatherConfig(**fields)
    reason = config.can_implement()
    assert reason is not None and needle in reason
    with pytest.raises(ValueError, match=needle):
        compile_kernel(config)


def test_registered_configs_lists_page_gather():
    for arch in ARCHS:
        configs = registered_configs(arch)
        assert any(isinstance(c, PageGatherConfig) and c.arch == arch for c in configs)
        assert all(c.can_implement() is None for c in configs)


def test_resolve_arch_and_sm_count(monkeypatch):
    monkeypatch.delenv(arch_mod.ARCH_ENV, raising=False)
    monkeypatch.delenv(arch_mod.SM_COUNT_ENV, raising=False)
    assert arch_mod.resolve_arch("sm_90a") == "sm_90a"
    assert arch_mod.resolve_arch("sm100a") == "sm_100a"
    monkeypatch.setenv(arch_mod.ARCH_ENV, "sm_90")
    assert arch_mod.resolve_arch(None) == "sm_90a"
    monkeypatch.delenv(arch_mod.ARCH_ENV)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pass arch"):
            arch_mod.resolve_arch(None)
    with pytest.raises(ValueError, match="unsupported arch"):
        arch_mod.resolve_arch("sm_80")
    assert arch_mod.sm_count("sm_90a") == 132
    assert arch_mod.sm_count("sm_100a") == 148
    assert arch_mod.sm_count(100) == 100
    monkeypatch.setenv(arch_mod.SM_COUNT_ENV, "7")
    assert arch_mod.sm_count("sm_100a") == 7
