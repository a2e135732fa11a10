"""MLA decode's cluster merge on a GPU: split requests folded by their thread-block cluster, against the reference.

Under ``cluster_merge_policy(True)`` a host plan whose merges each fill a cluster (``plan_clusters.py``) runs the
sm_90a one-token kernel launched in clusters of 2, 4 or 8 CTAs (``kernels/common/cluster_merge.py``). Each case
asserts that its plan took that path (its config's ``cluster_merge``), then compares every element with the float32
reference: shuffled NaN-poisoned pools, NaN-prefilled outputs (a column no rank folds fails), a short request among
uniform ones, the host (``check_indices=True``) and ``plan=`` routes, and three calls in a row.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import reference, testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: (batch, keys a request, the cluster size of the host plan's shape at 16 heads): the bench's 16 x 4096 and 64 x 8192
#: shapes, and others the planner cuts the same way. 16 x 4096 takes its clusters of 8 only on a GPU that holds
#: sixteen at once (the H200 does not: the test then checks the combine path's result)
CLUSTER_BATCHES = ((16, 4096, 8), (4, 2048, 8), (8, 2048, 8), (33, 1000, 4), (64, 1000, 2), (66, 500, 2))


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn

    torch.cuda.init()
    cute_attn.clear_plan_cache()
    yield


def _run(kv_lens, page_size, num_heads, route, seed, expect_cluster=None, calls=1):
    """One batch under the policy on ``route`` ("plan" or "host"), ``calls`` times, each compared; returns the
    cluster size its plan ran with."""
    import cute_attn
    from cute_attn.ops.mla_decode import cluster_merge_policy

    case = testing.make_mla_decode_case(kv_lens, num_heads=num_heads, page_size=page_size, device="cuda", seed=seed)
    args = case.inputs()
    with cluster_merge_policy(True):
        plan = cute_attn.plan_mla_paged_decode(*args)
        if expect_cluster is not None:
            assert plan.config.cluster_merge == _fitting(expect_cluster, len(kv_lens), plan), plan.config.cache_key()
        for _ in range(calls):
            out, lse = case.new_outputs()  # NaN: an element never written fails
            if route == "plan":
                cute_attn.mla_paged_decode(*args, out, lse, plan=plan)
            else:
                cute_attn.clear_plan_cache()
                cute_attn.mla_paged_decode(*args, out, lse, check_indices=True)
            torch.cuda.synchronize()
            ref_out, ref_lse = reference.mla_paged_decode_ref(*args)
            testing.assert_close_benchmark(out, ref_out, "output")
            testing.assert_close_benchmark(lse, ref_lse, "lse")
    return plan.config.cluster_merge


def _fitting(k, batch, plan):
    """``k`` where this GPU holds the plan's ``batch`` clusters of ``k`` at once, else 0 (the combine path)."""
    import dataclasses

    from cute_attn.ops.mla_decode import cluster_capacity

    config = dataclasses.replace(plan.config, cluster_merge=k)
    return k if batch <= cluster_capacity(config, torch.device("cuda", torch.cuda.current_device())) else 0


@pytest.mark.parametrize("shape", CLUSTER_BATCHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("page_size", (1, 64))
@pytest.mark.parametrize("route", ("plan", "host"))
def test_cluster_merge_uniform_batches(shape, page_size, route):
    batch, keys, k = shape
    _run([keys] * batch, page_size, 16, route, seed=batch + keys + page_size, expect_cluster=k, calls=3)


@pytest.mark.parametrize("page_size", (1, 64))
def test_cluster_merge_eight_heads_and_a_short_request(page_size):
    """Kimi-K2's 8 heads (half the columns a rank), and one request 5 keys short of the rest (its last piece ends
    inside a page; the plan still fills each cluster)."""
    kv_lens = [4096] * 16
    kv_lens[3] -= 5
    _run(kv_lens, page_size, 8, "plan", seed=page_size + 3, expect_cluster=8)


def test_cluster_merge_plan_refresh_keeps_the_shape():
    """A cluster-merge DevicePlan refuses a refresh with a plan of another shape (its kernel would fold the wrong
    CTAs), and takes one of the same shape."""
    import numpy as np

    import cute_attn
    from cute_attn.ops.mla_decode import cluster_merge_policy
    from cute_attn.plan import plan_work

    case = testing.make_mla_decode_case([2048] * 8, num_heads=16, page_size=64, device="cuda", seed=5)
    with cluster_merge_policy(True):
        plan = cute_attn.plan_mla_paged_decode(*case.inputs())
    assert plan.config.cluster_merge == 8
    plan_config = plan.plan.config
    same = plan_work(plan_config, np.ones(8, int), np.full(8, 2048), capacity=plan.plan.capacity)
    plan.refresh(same)
    ragged = plan_work(plan_config, np.ones(8, int), np.arange(1, 9) * 300, capacity=plan.plan.capacity)
    with pytest.raises(ValueError, match="clusters"):
        plan.refresh(ragged)


@st.composite
def near_uniform_batches(draw):
    """Uniform batches of the sizes whose even pieces fill clusters, a few requests a little shorter."""
    batch, center = draw(st.sampled_from(((16, 4096), (8, 2048), (32, 1024), (64, 1024), (48, 600))))
    kv_lens = [center] * batch
    for i in draw(st.lists(st.integers(0, batch - 1), max_size=3, unique=True)):
        kv_lens[i] -= draw(st.integers(1, 70))
    return kv_lens


@settings(max_examples=12, deadline=None)
@given(kv_lens=near_uniform_batches(), page_size=st.sampled_from((1, 64)), num_heads=st.sampled_from((16, 8)))
def test_cluster_merge_drawn_batches(kv_lens, page_size, num_heads):
    """Whatever the plan (cluster-shaped or not), the policy's call equals the reference."""
    _run(kv_lens, page_size, num_heads, "plan", seed=sum(kv_lens) % 1000)


def test_cluster_merge_in_a_cuda_graph():
    """An engine's step: a cluster-merge plan (8 x 2048, clusters of 8) captured once with its launch, then new
    caches' contents and new queries each replay, and a refreshed plan of the same shape (new page ids): every replay
    equals the reference (the cluster launch is captured like any other)."""
    import numpy as np

    import cute_attn
    from cute_attn.plan import plan_work

    case = testing.make_mla_decode_case([2048] * 8, num_heads=16, page_size=64, device="cuda", seed=17)
    args = case.inputs()
    from cute_attn.ops.mla_decode import cluster_merge_policy

    with cluster_merge_policy(True):
        plan = cute_attn.plan_mla_paged_decode(*args)
    assert plan.config.cluster_merge == _fitting(8, 8, plan)
    out, lse = case.new_outputs()

    def step():
        cute_attn.mla_paged_decode(*args, out, lse, plan=plan)

    step()  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = np.random.default_rng(3)
    for replay in range(3):
        case.q_nope.normal_()
        case.q_pe.normal_()
        if replay == 2:  # the used (full) pages dealt to other requests: the plan's rows keep their shape
            order = torch.tensor(rng.permutation(case.kv_indices.numel()), device="cuda")
            case.kv_indices.copy_(case.kv_indices[order])
            plan.refresh(plan_work(plan.plan.config, np.ones(8, int), np.full(8, 2048), capacity=plan.plan.capacity))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.mla_paged_decode_ref(*args)
        testing.assert_close_benchmark(out, ref_out, f"replay {replay} output")
        testing.assert_close_benchmark(lse, ref_lse, f"replay {replay} lse")
