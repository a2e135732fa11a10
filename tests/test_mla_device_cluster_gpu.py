"""MLA decode's device plans in clusters of 2 checked at run time, on a GPU, against the float32 reference.

Under ``device_cluster_merge_policy(True)`` (off by default: session 32 measured it at -0.7..-1.6 us on 64 x 8192's
device plans and +0.3..+0.9 us on small batches' default calls) the default call and
``plan_mla_paged_decode(..., on_device=True)`` of the sm_90a one-token configs launch the kernel in clusters of 2
(``cluster_merge_flags``, ``ops/mla_decode.device_cluster_tiles``): a cluster that holds one whole merge (its two CTAs
the merge's two slots) folds it in shared memory and flags it; every other split item stores its global partial, and
the combine that follows skips the flagged merges. Each case compares every element (shuffled
NaN-poisoned pools, NaN-prefilled outputs: a merge both folded and skipped, or neither, fails) and checks that the
kernel's flags equal the host mirror of its check (``plan_clusters.merges_held_by_clusters``) on the plan the device
made. ``num_sms`` makes small grids, so the device planner's even pieces come in pairs at small batches.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _checked_clusters():
    """The device plans' checked clusters (``device_cluster_merge_policy``: off by default), fresh plan caches."""
    from cute_attn.ops.mla_decode import device_cluster_merge_policy

    torch.cuda.init()
    with device_cluster_merge_policy(True):
        yield


def _held_on_host(plan) -> np.ndarray:
    """The mirror of the kernel's check on the plan the device made (downloaded)."""
    from cute_attn.plan_clusters import merges_held_by_clusters

    merge_indptr = plan.merge_indptr.cpu().numpy()
    num_merges = int(np.count_nonzero(np.diff(merge_indptr)))  # the plan's merges are a prefix of the capacity
    work_indptr = plan.work_indptr.cpu().numpy()
    made = types.SimpleNamespace(num_merges=num_merges, work_indptr=work_indptr, items=plan.items.cpu().numpy(),
                                 merge_indptr=merge_indptr,
                                 config=types.SimpleNamespace(num_ctas=work_indptr.size - 1))
    return merges_held_by_clusters(made, plan.config.cluster_merge)


def _run(kv_lens, page_size, num_heads, num_sms, seed, expect_held=None, calls=2):
    """The device-planned route (``plan=`` a plan made on the device) and the default call, each compared with the
    reference; the flags after the ``plan=`` call equal the host mirror. Returns how many merges folded in pairs."""
    import cute_attn

    case = testing.make_mla_decode_case(kv_lens, num_heads=num_heads, page_size=page_size, device="cuda", seed=seed)
    args = case.inputs()
    ref_out, ref_lse = case.reference()
    plan = cute_attn.plan_mla_paged_decode(*args, on_device=True, num_sms=num_sms)
    assert (plan.config.cluster_merge, plan.config.cluster_merge_flags) == (2, True), plan.config.cache_key()
    for call in range(calls):
        out, lse = case.new_outputs()  # NaN: an element never written fails
        cute_attn.mla_paged_decode(*args, out, lse, plan=plan)
        torch.cuda.synchronize()
        testing.assert_close_benchmark(out, ref_out, f"plan= call {call} output")
        testing.assert_close_benchmark(lse, ref_lse, f"plan= call {call} lse")
    held = _held_on_host(plan)
    flags = plan.scratch()[2].cpu().numpy()[: held.size]
    assert (flags != 0).tolist() == held.tolist(), "the kernel's flags differ from the host mirror of its check"
    if expect_held is not None:
        assert held.all() if expect_held else not held.any(), held
    for call in range(calls):
        out, lse = case.new_outputs()
        cute_attn.mla_paged_decode(*args, out, lse, num_sms=num_sms)
        torch.cuda.synchronize()
        testing.assert_close_benchmark(out, ref_out, f"default call {call} output")
        testing.assert_close_benchmark(lse, ref_lse, f"default call {call} lse")
    cute_attn.raise_on_device_error()
    return int(held.sum())


#: (batch, keys a request, SMs, every merge folded in pairs?): two even pieces a request on neighbouring CTAs (the
#: bench's 64 x 8192 on 132 SMs), four or more (no pair holds a whole merge: the combine folds them all)
BATCHES = ((64, 8192, None, True), (4, 2048, 8, True), (6, 1000, 12, True), (2, 2048, 8, False),
           (16, 4096, None, False), (128, 4096, None, None))


@pytest.mark.parametrize("shape", BATCHES, ids=lambda s: f"{s[0]}x{s[1]}-sms{s[2]}")
@pytest.mark.parametrize("page_size", (1, 64))
def test_device_plans_fold_whole_pairs(shape, page_size):
    batch, keys, num_sms, held = shape
    _run([keys] * batch, page_size, 16, num_sms, seed=batch + keys + page_size, expect_held=held)


@pytest.mark.parametrize("page_size", (1, 64))
def test_pairs_beside_the_combine_in_one_launch(page_size):
    """Eight heads; most requests two pieces, a few shorter ones whole or cut otherwise: folded pairs and combined
    merges in the same launch, each merge once."""
    kv_lens = [2048] * 10 + [100, 700, 3000]
    _run(kv_lens, page_size, 8, 26, seed=page_size + 11)


@st.composite
def batches(draw):
    """Uniform batches whose device plans come in pairs, some requests shortened or emptied, and ragged ones."""
    if draw(st.booleans()):
        batch, keys = draw(st.sampled_from(((4, 2048), (8, 1024), (6, 3000), (12, 700))))
        kv_lens = [keys] * batch
        for i in draw(st.lists(st.integers(0, batch - 1), max_size=2, unique=True)):
            kv_lens[i] = draw(st.integers(0, keys - 1))
        return kv_lens, 2 * batch
    return draw(st.lists(st.integers(0, 5000), min_size=1, max_size=12)), draw(st.sampled_from((8, 16, 24)))


@settings(max_examples=12, deadline=None)
@given(drawn=batches(), page_size=st.sampled_from((1, 64)), num_heads=st.sampled_from((16, 8)))
def test_drawn_batches(drawn, page_size, num_heads):
    kv_lens, num_sms = drawn
    _run(kv_lens, page_size, num_heads, num_sms, seed=sum(kv_lens) % 997, calls=1)


def test_a_captured_decode_step_replays_pairs_and_merges():
    """An engine's step captured once (device plan + attention + combine), replayed with batches whose plans fold in
    pairs, combine, or both: every replay equals the reference (the flags are written every launch)."""
    import cute_attn

    max_batch, page_size, num_sms = 12, 64, 24
    shape = testing.make_mla_decode_case([4096] * max_batch, page_size=page_size, device="cuda", seed=1)
    q_nope, q_pe = shape.q_nope.clone(), shape.q_pe.clone()
    ckv, kpe = shape.ckv_cache, shape.kpe_cache
    ckv.normal_()  # every page may be drawn below: no NaN poison here
    kpe.normal_()
    kv_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(ckv.shape[0], dtype=torch.int32, device="cuda")
    last = torch.ones(max_batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_nope)
    lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device="cuda")
    rng = np.random.default_rng(7)

    def load(lens):
        testing.refill_page_table(lens, page_size, kv_indptr, kv_indices, last, rng, empty_last=1)
        q_nope.normal_()
        q_pe.normal_()

    def step():
        cute_attn.mla_paged_decode(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, last, shape.sm_scale, out, lse,
                                   num_sms=num_sms)

    load([4096] * max_batch)
    step()  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([4096] * 12, [1500] * 12, [9000, 3, 700] * 4, [2048] * 12, [4096] * 11 + [0]):
        load(lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        case = testing.MlaDecodeCase(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, kv_indptr=kv_indptr,
                                     kv_indices=kv_indices[: int(kv_indptr[-1])], kv_last_page_len=last,
                                     sm_scale=shape.sm_scale, kv_lens=lens, page_size=page_size,
                                     qo_indptr=shape.qo_indptr, q_lens=shape.q_lens)
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, f"{lens[:3]} output")
        testing.assert_close_benchmark(lse, ref_lse, f"{lens[:3]} lse")
    cute_attn.raise_on_device_error()
