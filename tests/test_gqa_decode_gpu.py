"""The sm_90a GQA decode kernel on a GPU, through the public API, against the fp32 reference.

Pools are shuffled and NaN-poisoned (unused pages and each last page's tail), outputs are NaN-prefilled,
so a kernel that reads a wrong slot or skips an element fails.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_TOTAL_KV = 250_000  # keeps the fp32 reference and the pools small


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn
    import cute_attn.kernels.sm90.gqa_decode  # noqa: F401  registers the launcher (no other kernel module needed)

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def _run(case, **kw):
    import cute_attn

    out, lse = case.new_outputs()
    cute_attn.gqa_paged_decode(*case.inputs(), out, lse, **kw)
    torch.cuda.synchronize()
    return out, lse


def _check(case, **kw):
    out, lse = _run(case, **kw)
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, "output")
    testing.assert_close_benchmark(lse, ref_lse, "lse")
    return out, lse, ref_lse


def _case(kv_lens, **kw):
    return testing.make_gqa_decode_case(kv_lens, device="cuda", **kw)


def test_seed_case_batch1_51_pages():
    # 3232 keys = 50 full pages + 32: the planner splits it over the CTAs, the kernel's fused merge folds.
    _check(_case([3232], extra_pages=1))


@pytest.mark.parametrize("kv_lens", [[32768], [3232], [32768, 5], [2048] * 16], ids=lambda k: f"{len(k)}x{k[0]}")
def test_heavy_splits_fold_in_kernel(kv_lens):
    import cute_attn

    case = _case(kv_lens, seed=len(kv_lens) + kv_lens[0])
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs())
    if len(kv_lens) <= 2:
        assert plan.plan.num_merges >= 4 and plan.plan.num_partials >= 8  # every KV head splits
    _check(case, plan=plan)
    assert (plan.merge_counters == 0).all()  # the last CTA of each merge reset its counter


def test_same_device_plan_three_times():
    """The merge counters must be zero again after each launch: every call folds correctly."""
    import cute_attn

    case = _case([3232, 9000], seed=12)
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs())
    assert plan.plan.num_merges
    ref_out, ref_lse = case.reference()
    for call in range(3):
        out, lse = _run(case, plan=plan)
        testing.assert_close_benchmark(out, ref_out, f"output (call {call})")
        testing.assert_close_benchmark(lse, ref_lse, f"lse (call {call})")
        assert (plan.merge_counters == 0).all(), f"call {call} left merge counters set"


@pytest.mark.parametrize("order", ["more_then_fewer", "fewer_then_more"])
def test_one_device_plan_refreshed_between_plans(order):
    """CUDA-graph style: one DevicePlan sized for the largest batch, refreshed with plans that have more
    and fewer merges in turn; counters left by one plan must not leak into the next."""
    import cute_attn
    from cute_attn.api import DevicePlan
    from cute_attn.plan import PlanCapacity, plan_work

    many = _case([32768, 20000, 7000, 3232], seed=13)  # heavy splits: many merges
    few = _case([3232], seed=14)  # one merge per KV head
    config = cute_attn.plan_gqa_paged_decode(*few.inputs()).config
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count * config.ctas_per_sm
    plan_config = config.plan_config(num_ctas)
    capacity = PlanCapacity.for_limits(plan_config, max_batch=4, max_total_q=4)
    plans = {name: plan_work(plan_config, [1] * len(c.kv_lens), c.kv_lens, capacity=capacity)
             for name, c in (("many", many), ("few", few))}
    assert plans["many"].num_merges > plans["few"].num_merges > 0
    device_plan = DevicePlan.allocate(config, capacity, num_ctas, "cuda")
    sequence = ["many", "few", "many", "few"] if order == "more_then_fewer" else ["few", "many", "few", "many"]
    for name in sequence:
        case = many if name == "many" else few
        device_plan.refresh(plans[name])
        _check(case, plan=device_plan)
        assert (device_plan.merge_counters == 0).all()


def test_cuda_graph_replays():
    """Captured once, replayed three times: the fused merge leaves the counters zero for the next replay."""
    import cute_attn

    case = _case([3232, 70], seed=15)
    plan = cute_attn.plan_gqa_paged_decode(*case.inputs())
    out, lse = case.new_outputs()
    ref_out, ref_lse = case.reference()

    def run():
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse, plan=plan, check_indices=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm the launch path outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for replay in range(3):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        testing.assert_close_benchmark(out, ref_out, f"output (replay {replay})")
        testing.assert_close_benchmark(lse, ref_lse, f"lse (replay {replay})")
    assert (plan.merge_counters == 0).all()


@pytest.mark.parametrize("kv_lens", [[1], [64], [64 * 37], [128, 64, 4096, 1]], ids=str)
def test_short_and_page_multiple_lengths(kv_lens):
    _check(_case(kv_lens, seed=len(kv_lens)))


def test_kv_views_of_one_combined_tensor():
    _check(testing.interleave_kv(_case([3232, 70, 1], seed=11)))


def test_zero_page_requests():
    _, lse, _ = _check(_case([0, 100, 0, 3000, 0], seed=3))
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()


def test_only_empty_requests():
    out, lse, _ = _check(_case([0, 0], seed=4))
    assert (out == 0).all()


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(8, 8), (16, 8), (32, 8), (32, 4), (20, 4)], ids=str)
def test_group_sizes(num_qo_heads, num_kv_heads):
    _check(_case([1000, 77, 0, 2049, 64], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, seed=5))


def test_many_items_per_cta():
    # Few CTAs: each runs many items, so the K/V ring wraps across item boundaries.
    _check(_case([700, 64, 1, 5000, 333, 0, 129] * 6, seed=6), num_sms=3)


def test_natural_lse():
    case = _case([3232, 17], seed=7)
    _, lse = _run(case, natural_lse=True)
    _, ref_lse = case.reference()
    testing.assert_close_benchmark(lse, ref_lse * math.log(2.0), "lse")


def test_hypothesis_batches():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    batches = st.integers(1, 256).flatmap(
        lambda b: testing.decode_batches(max_batch=b, max_kv=min(32768, MAX_TOTAL_KV // b))
    )

    @settings(max_examples=25)
    @given(kv_lens=batches, seed=st.integers(0, 2**16))
    def check(kv_lens, seed):
        import cute_attn

        cute_attn.clear_plan_cache()
        _check(_case(kv_lens, seed=seed))

    check()
