"""``PagedAttentionConfig.early_dependents`` (``config.EARLY_DEPENDENTS``, ``config.early_dependents_policy``): each
attention CTA releases the next launch right after its own ``griddepcontrol.wait``, so the combine that follows a
device plan is dispatched while the attention grid runs. Compile-only on the CPU (both arches: the default build has
no release, the knob's has one, after the wait); on a GPU the device-planned calls that launch a combine still match
the float32 reference."""

import dataclasses

import pytest

from cute_attn import config as config_module
from cute_attn import testing
from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config, early_dependents_policy

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

KINDS = {  # kind: (heads, kv_heads, head_dim_qk, head_dim_v, page_size, causal)
    "gqa_paged_prefill": (32, 4, 128, 128, 64, True),
    "gqa_paged_decode": (20, 4, 128, 128, 64, False),
    "mla_paged_prefill": (16, 1, 576, 512, 1, True),
}


def _config(kind, arch):
    hq, hkv, dqk, dv, ps, causal = KINDS[kind]
    return default_paged_config(kind, arch=arch, num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=dqk, head_dim_v=dv,
                                page_size=ps, causal=causal)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_knob_releases_dependents_after_the_wait_and_the_default_does_not(kind, arch):
    default = _config(kind, arch)
    assert default.early_dependents is config_module.EARLY_DEPENDENTS is False
    assert "griddepcontrol.launch_dependents" not in compile_to_ptx(default)
    ptx = compile_to_ptx(dataclasses.replace(default, early_dependents=True))
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def test_the_policy_sets_every_default_config():
    with early_dependents_policy(True):
        assert all(_config(kind, "sm_90a").early_dependents for kind in KINDS)
    assert not any(_config(kind, "sm_90a").early_dependents for kind in KINDS)


GPU_CASES = {  # (entry name, case): device-planned default calls; all but decode's launch a combine after the
    # attention kernel (the GQA decode kernel folds its merges: its release has no combine to start)
    "gqa prefill 3 x ragged": ("gqa_paged_prefill", lambda: testing.make_gqa_prefill_case(
        [3, 40, 1], [40000, 300, 9000], device="cuda", seed=91)),
    "gqa prefill 1 x 992": ("gqa_paged_prefill", lambda: testing.make_gqa_prefill_case(
        [992], [992], device="cuda", seed=92)),
    "mla prefill 8 short": ("mla_paged_prefill", lambda: testing.make_mla_prefill_case(
        [179, 23, 43, 55, 43, 177, 191, 130], [186, 41, 109, 141, 167, 272, 243, 161], device="cuda", seed=93)),
    "mla decode 4 ragged": ("mla_paged_decode", lambda: testing.make_mla_decode_case(
        [4096, 0, 70, 9000], device="cuda", seed=94)),
    "gqa decode 7 ragged": ("gqa_paged_decode", lambda: testing.make_gqa_decode_case(
        [5000, 0, 1, 64, 9000, 130, 2048], device="cuda", seed=95)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_device_planned_calls_match_the_reference_with_early_dependents(name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import cute_attn

    entry_name, make = GPU_CASES[name]
    entry = getattr(cute_attn, entry_name)
    with early_dependents_policy(True):
        case = make()
        results = []
        for _ in range(2):  # twice, unsynchronised: the second call's planner follows the first call's combine
            out, lse = case.new_outputs()
            entry(*case.inputs(), out, lse)
            results.append((out, lse))
        torch.cuda.synchronize()
        for out, lse in results:
            ref_out, ref_lse = case.reference()
            testing.assert_close_benchmark(out, ref_out, f"{name} output")
            testing.assert_close_benchmark(lse, ref_lse, f"{name} lse")
        cute_attn.raise_on_device_error()
