"""The sm_90a absorbed-MLA paged prefill kernel on a GPU, through the public API, against the fp32 reference.

Pools hold NaN in every row no request owns and outputs are NaN-prefilled, so a kernel that gathers a wrong
row, multiplies a NaN V row by a masked zero, or skips an element fails. Pools are kept small (``num_pages``)
so the file stays fast.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # every test with each consumer split of the sm_90a kernel (full_s, shared_s, score_wg); conftest.py
    pytest.mark.usefixtures("mla_consumers"),
]

LN_2 = math.log(2.0)
SPARE_ROWS = 97  # pool rows no request owns (NaN)


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _case(q_lens, kv_lens, seed=0, **kw):
    kw.setdefault("num_pages", sum(kv_lens) + SPARE_ROWS)
    return testing.make_mla_prefill_case(q_lens, kv_lens, device="cuda", seed=seed, **kw)


def _compare(case, out, lse, natural_lse):
    ref_out, ref_lse = case.reference()
    if natural_lse:
        ref_lse = ref_lse * LN_2
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")


def _check(case, natural_lse: bool = False):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.mla_paged_prefill(*case.inputs(), out, lse, natural_lse=natural_lse)
    torch.cuda.synchronize()
    _compare(case, out, lse, natural_lse)
    return out, lse


def _split(batch: int, total_q: int, total_kv: int, seed: int) -> tuple[list[int], list[int]]:
    """A random per-request split of a recorded workload (batch / total_q / total_kv) with kv_len >= q_len."""
    rng = np.random.default_rng(seed)

    def parts(total, n, at_least):
        cuts = np.sort(rng.integers(0, total - n * at_least + 1, size=n - 1))
        return [int(x) + at_least for x in np.diff(np.concatenate([[0], cuts, [total - n * at_least]]))]

    q_lens = parts(total_q, batch, 1 if total_q >= batch else 0)
    extra = parts(total_kv - total_q, batch, 0)
    return q_lens, [q + e for q, e in zip(q_lens, extra)]


RECORDED = [(1, 1, 34), (4, 4, 121), (1, 10, 12), (1, 43, 46), (3, 69, 90), (2, 123, 185), (5, 473, 491),
            (1, 1028, 1038), (28, 1954, 2044)]


@pytest.mark.parametrize("batch, total_q, total_kv", RECORDED, ids=lambda x: str(x))
def test_recorded_workloads(batch, total_q, total_kv):
    q_lens, kv_lens = _split(batch, total_q, total_kv, seed=total_kv)
    assert sum(q_lens) == total_q and sum(kv_lens) == total_kv and all(k >= q for q, k in zip(q_lens, kv_lens))
    _check(_case(q_lens, kv_lens, seed=total_q))


def test_empty_requests():
    # requests with no query, a request with no key, keys ending inside a 64-key tile
    _check(_case([0, 5, 0, 40, 3], [0, 70, 3, 40, 0], seed=1))


def test_kv_len_below_q_len_rows_see_no_key():
    # bottom-right causal: the first q_len - kv_len rows see no key: output 0, lse -inf
    out, lse = _check(_case([100, 40, 9], [30, 0, 9], seed=2))
    assert torch.isinf(lse[:70]).all() and (out[:70] == 0).all()
    assert torch.isfinite(lse[70:100]).all()


def test_natural_lse():
    _check(_case([300, 50], [1000, 50], seed=3), natural_lse=True)


@pytest.mark.parametrize("merge", ["combine", "fused_merge", "eager_combine", "bf16_partials"])
def test_long_request_split_and_combined(merge):
    # few query rows over many keys: the planner splits the KV range, the combine kernel (with fused_merge, the last
    # CTA of each merge; with eager_combine, the combine folding each merge once its slots are in) merges the
    # partials; then the same batch planned on the device (the default call)
    import cute_attn
    from cute_attn.config import bf16_partials_policy
    from cute_attn.ops.mla_prefill import eager_combine_policy, fused_merge_policy

    case = _case([8, 2], [9000, 3000], seed=4)
    with fused_merge_policy(merge == "fused_merge"), eager_combine_policy(merge == "eager_combine"), \
            bf16_partials_policy(merge == "bf16_partials"):
        plan = cute_attn.plan_mla_paged_prefill(*case.inputs())
        assert plan.plan.num_merges > 0 and plan.config.fused_merge == (merge == "fused_merge")
        assert plan.config.eager_combine == (merge == "eager_combine")
        assert plan.config.bf16_partials == (merge == "bf16_partials")
        out, lse = case.new_outputs()
        cute_attn.mla_paged_prefill(*case.inputs(), out, lse, plan=plan, natural_lse=True)
        torch.cuda.synchronize()
        _compare(case, out, lse, natural_lse=True)
        out, lse = case.new_outputs()
        cute_attn.mla_paged_prefill(*case.inputs(), out, lse, natural_lse=True)
        torch.cuda.synchronize()
        _compare(case, out, lse, natural_lse=True)


def test_large_pool_scattered_rows():
    # rows scattered over a pool much larger than the batch (the real pool is ~1M rows)
    _check(_case([17, 64, 1], [500, 64, 2000], seed=5, num_pages=200_000))


@settings(max_examples=15)
@given(batch=testing.ragged_batches(max_batch=8, max_q=300, max_kv=1200))
def test_ragged_batches_match_reference(batch):
    q_lens, kv_lens = batch
    _check(_case(q_lens, kv_lens, seed=sum(q_lens) + len(q_lens)))


# ------------------------------------------------------------------------------------ kv_tile variant
@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1028], [1038]),              # a recorded workload
    ([100, 40, 9, 0], [30, 0, 9, 5]),  # rows that see no key, an empty request
    ([8, 2], [9000, 3000]),        # split items: partials + combine
], ids=str)
def test_kv_tile_32_variant(q_lens, kv_lens, mla_consumers):
    """Plan with a kv_tile 32 config (4 stages) and run its kernel on the same inputs."""
    if mla_consumers != "full_s":
        pytest.skip(f"{mla_consumers} builds kv_tile 64 only")
    from cute_attn.api import DevicePlan, _num_ctas
    from cute_attn.kernels import find_launcher
    from cute_attn.plan import plan_work

    import cute_attn

    case = _case(q_lens, kv_lens, seed=6)
    config = dataclasses.replace(cute_attn.plan_mla_paged_prefill(*case.inputs()).config, kv_tile=32)
    plan = plan_work(config.plan_config(_num_ctas(config, case.q_nope.device, None)), np.asarray(q_lens),
                     np.asarray(kv_lens))
    device_plan = DevicePlan.upload(config, plan, case.q_nope.device)
    out, lse = case.new_outputs()
    find_launcher(config)(device_plan, *case.inputs(), out, lse, natural_lse=False)
    torch.cuda.synchronize()
    _compare(case, out, lse, natural_lse=False)


def test_the_variant_under_test_is_the_one_launched(mla_consumers):
    import cute_attn
    from cute_attn.ops.mla_prefill import CONSUMER_KNOBS, SM90_CONSUMER_SPLITS

    case = _case([5, 70], [9, 200], seed=7)
    plan = cute_attn.plan_mla_paged_prefill(*case.inputs())
    knobs = {**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[mla_consumers]}
    assert {k: getattr(plan.config, k) for k in CONSUMER_KNOBS} == knobs
    _check(case)
