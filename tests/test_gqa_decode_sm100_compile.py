"""sm_100a GQA paged decode: compile-only checks (CPU; there is no Blackwell GPU to run it on).

Compiles the registered configs through the one compile path and inspects the PTX for the tcgen05 /
TMEM / TMA instructions the design relies on, plus the kernel's own shared-memory and TMEM budgets.
"""

import re

import pytest

from cute_attn.compile import compile_kernel, compile_kernel_with_info, compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels import find_launcher
from cute_attn.kernels.sm100 import gqa_decode

ARCH = "sm_100a"
CONFIGS = gqa_decode.configs(ARCH)


pytestmark = pytest.mark.usefixtures("isolated_compile_cache")


def test_definition_config_is_registered():
    definition = default_paged_config("gqa_paged_decode", arch=ARCH, num_qo_heads=20, num_kv_heads=4,
                                      head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)
    assert definition in CONFIGS
    assert find_launcher(definition) is gqa_decode.launch
    assert gqa_decode.configs("sm_90a") == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c.num_qo_heads}_kv{c.num_kv_heads}")
def test_compiles_with_tcgen05_tmem_and_tma(config):
    assert gqa_decode.check_config(config) is None
    info = compile_kernel_with_info(config)
    assert callable(info.fn) and info.object_path.suffix == ".o"
    assert compile_kernel(config) is info.fn  # memoised
    ptx = compile_to_ptx(config)
    assert f".target {ARCH}" in ptx
    for needle in (
        "tcgen05.mma.cta_group::1.kind::f16",  # S = Q.K^T (smem x smem) and O += P.V (P from TMEM)
        "tcgen05.alloc",
        "tcgen05.dealloc",
        "tcgen05.ld.sync.aligned.32x32b",  # S and O rows out of TMEM
        "tcgen05.st.sync.aligned.32x32b",  # P and the rescaled O back into TMEM
        "tcgen05.commit",
        "cp.async.bulk.tensor",  # TMA: Q tile, K/V pages
        "mbarrier.try_wait.parity",
        "ex2.approx",
        "fence.proxy.async.shared::cta",  # V tail zeroed in smem before the P.V MMA reads it
        "fence.acq_rel.gpu",  # fused merge: partials released before the arrival, acquired before the fold
    ):
        assert needle in ptx, needle
    assert re.search(r"\b(atom|red)\.global\S*\.add", ptx)  # the fused merge's arrival counter
    # P.V reads its A operand (P) from TMEM: "tcgen05.mma... [d_tmem], [a_tmem], b_desc, ..."
    assert re.search(r"tcgen05\.mma\S*\s+\[[^\]]+\],\s*\[", ptx)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c.num_qo_heads}_kv{c.num_kv_heads}")
def test_shared_memory_and_tmem_budgets(config):
    assert gqa_decode.smem_bytes(config) <= 227 * 1024
    used, allocated = gqa_decode.tmem_columns(config)
    assert used <= allocated <= 512
    assert allocated & (allocated - 1) == 0  # tcgen05.alloc takes a power of two >= 32


@pytest.mark.parametrize("change,words", [
    (dict(page_size=16), "page_size 64"),
    (dict(ctas_per_sm=2), "TMEM"),
    (dict(arch="sm_90a"), "sm_100a"),
    (dict(causal=True), "causal"),
])
def test_rejects_what_it_does_not_implement(change, words):
    import dataclasses

    config = dataclasses.replace(CONFIGS[0], **change)
    reason = gqa_decode.check_config(config)
    assert reason is not None and words in reason
    with pytest.raises(ValueError):
        gqa_decode.build(config)
