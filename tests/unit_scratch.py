"""What the planner-free prefill's GPU tiers share (``tests/test_dynamic_schedule_gpu.py``,
``tests/test_mla_dynamic_schedule_gpu.py``): a default call checked against the float32 reference, and the state its
last CTA must leave zero for the next launch."""

from __future__ import annotations


def route_scratch() -> list:
    """Every self-scheduling route's scratch now alive (api's route cache)."""
    from cute_attn import api

    return [s for hit in api._DEVICE_ROUTES.values() if getattr(hit.route, "schedules_itself", False)
            for s in hit.route.scratch.values()]


def assert_matches_reference(entry, case, what: str, num_sms=None) -> None:
    """``entry`` (a public prefill entry) on ``case`` with garbage-prefilled outputs: the float32 reference's by the
    benchmark's rule, no device error, and the self-scheduling route taken and left clean (the counter, the count
    out, the fault flag and the marks zero)."""
    import torch

    import cute_attn
    from cute_attn import testing

    out, lse = case.new_outputs()
    entry(*case.inputs(), out, lse, num_sms=num_sms)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, f"{what} output")
    testing.assert_close_benchmark(lse, ref_lse, f"{what} lse")
    cute_attn.raise_on_device_error()
    scratch = route_scratch()
    assert scratch, f"{what}: the call did not take the self-scheduling route"
    for s in scratch:
        assert not s.unit_state.any() and not s.request_faults.any(), f"{what}: scratch {s}"


def check_page_faults(entry, case, pool_pages: int) -> None:
    """Page ids outside the pool in requests 2 (past its end) and 0 (negative): those requests' rows 0 / lse -inf
    (every unit of them, whichever CTA took it), the others the reference's, the error word names kv_indices; the
    next clean call is right (marks cleared)."""
    import pytest
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.device_errors import DeviceIndexError

    ref_out, ref_lse = case.reference()
    kvp = case.kv_indptr.tolist()
    saved = case.kv_indices.clone()
    for k, b in enumerate((2, 0)):
        rows = slice(int(case.qo_indptr[b]), int(case.qo_indptr[b + 1]))
        ref_out[rows], ref_lse[rows] = 0, float("-inf")
        case.kv_indices[kvp[b + 1] - 1] = -3 if k else pool_pages + 7
    out, lse = case.new_outputs()
    entry(*case.inputs(), out, lse)
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, "faulted output")
    testing.assert_close_benchmark(lse, ref_lse, "faulted lse")
    with pytest.raises(DeviceIndexError, match="kv_indices"):
        cute_attn.raise_on_device_error()
    case.kv_indices.copy_(saved)
    assert_matches_reference(entry, case, "clean again")


def check_hostile_calls(entry, case, max_examples: int) -> None:
    """Every corruption the hostile module draws (page ids, indptrs, last page lengths): no error at the call, every
    row written (the pool's NaN never reaches one), the error names the argument; then a good batch is right."""
    import pytest
    import torch
    from hypothesis import HealthCheck, given, settings

    import cute_attn
    from cute_attn import hostile

    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(drawn=hostile.corruptions(case, kinds))
    def check(drawn):
        bad_case, corruption = drawn
        out, lse = bad_case.new_outputs()
        entry(*bad_case.inputs(), out, lse)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{corruption.description}: rows unwritten"
        with pytest.raises(ValueError) as err:
            cute_attn.raise_on_device_error()
        named = hostile.first_named_argument(str(err.value))
        assert named == corruption.names, f"{corruption.description}: names {named!r}: {err.value}"

    check()
    assert_matches_reference(entry, case, "after hostile calls")


def check_replays(entry, case, pools, total_q: int, page_size: int, steps: int, max_extra_keys: int, rng) -> None:
    """One call captured in a CUDA graph at ``case``'s shapes, replayed ``steps`` times after the index tensors were
    refilled in place (``total_q`` queries cut at random over the batch, each request ``q + [0, max_extra_keys)``
    keys): each replay equals the reference of what they then hold. ``pools`` are refilled with finite values first
    (every page may be drawn: no NaN poison)."""
    import numpy as np
    import torch

    import cute_attn
    from cute_attn import testing

    batch = case.qo_indptr.numel() - 1
    for pool in pools:
        pool.normal_()
    out, lse = case.new_outputs()
    inputs = case.inputs()
    entry(*inputs, out, lse)  # the route's buffers, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        entry(*inputs, out, lse)
    for step in range(steps):
        cuts = np.sort(rng.choice(np.arange(1, total_q), size=batch - 1, replace=False))
        q_lens = np.diff(np.concatenate([[0], cuts, [total_q]])).tolist()
        kv_lens = [q + int(rng.integers(0, max_extra_keys)) for q in q_lens]
        case.qo_indptr.copy_(torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32))
        testing.refill_page_table(kv_lens, page_size, case.kv_indptr, case.kv_indices, case.kv_last_page_len, rng)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()  # of the index tensors as they now hold
        testing.assert_close_benchmark(out, ref_out, f"replay {step} output")
        testing.assert_close_benchmark(lse, ref_lse, f"replay {step} lse")
    cute_attn.raise_on_device_error()
