"""What the planner-free prefill's GPU tiers share (``tests/test_dynamic_schedule_gpu.py``,
``tests/test_mla_dynamic_schedule_gpu.py``, and the decode line builds' tiers): a default call checked against the
float32 reference, the state its last CTA must leave zero for the next launch, and the line tiers' policy fixture."""

from __future__ import annotations

import contextlib


def replay_matches(graph, route, out, lse, ref_out, ref_lse, what: str) -> None:
    """``graph`` replayed into NaN-filled ``out`` / ``lse``: they equal the reference, and the route's scratch is left
    clean for the next replay."""
    import torch

    from cute_attn import testing

    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, f"{what} output")
    testing.assert_close_benchmark(lse, ref_lse, f"{what} lse")
    assert_scratch_clean(route, f"after {what}")


def many_requests() -> tuple[list, list]:
    """``(q_lens, kv_lens)`` of 70 requests, some without queries (0, 33, 69): past the first 32-request window of
    the units' request search, which resumes where a CTA's last unit was."""
    import numpy as np

    rng = np.random.default_rng(70)
    q_lens = [int(q) for q in rng.integers(0, 40, size=70)]
    q_lens[0] = q_lens[33] = q_lens[69] = 0
    return q_lens, [q + int(rng.integers(0, 300)) for q in q_lens]


@contextlib.contextmanager
def both_line_builds(knob_policy):
    """Every default call of decode and one-token MLA decode on its line build under ``knob_policy`` (a line knob's
    policy, entered here: the tiers ``test_line_scan_gpu`` / ``test_line_uniform_gpu`` rerun), after a clear plan cache
    and a raised error word; the device synchronised after the policies are restored (the modules' autouse fixture)."""
    import torch

    import cute_attn
    from cute_attn.ops import gqa_decode, mla_decode

    torch.cuda.init()
    cute_attn.clear_plan_cache()
    cute_attn.raise_on_device_error()
    with gqa_decode.line_schedule_policy(True), mla_decode.line_schedule_policy(True), knob_policy:
        yield
    torch.cuda.synchronize()


def assert_scratch_clean(route, what: str) -> None:
    """The route's counter, count-out, fault flag and marks are zero on every stream (what the last CTA leaves)."""
    assert route.scratch, f"{what}: the route has no scratch"
    for stream, s in route.scratch.items():
        assert not s.unit_state.any() and not s.request_faults.any(), f"{what}: stream {stream} scratch {s}"
        if s.merge_counters is not None:  # a line_schedule build's folds reset their counters
            assert not s.merge_counters.any(), f"{what}: stream {stream} merge counters {s.merge_counters}"


def call_self_scheduled(entry, case, out, lse, what: str, num_sms=None):
    """``entry`` on ``case`` into ``out`` / ``lse``; asserts the call launched the self-scheduling route once, and
    returns that route."""
    from cute_attn.config import LATE_CLAIM_KINDS
    from cute_attn.unit_schedule_route import recorded_launches

    with recorded_launches() as routes:
        entry(*case.inputs(), out, lse, num_sms=num_sms)
    assert len(routes) == 1, f"{what}: {len(routes)} self-scheduling launches, expected 1 (the policy routed it away?)"
    config = routes[0].config
    late = config.kind in LATE_CLAIM_KINDS and config.dynamic_schedule  # a line build (decode) claims no units
    assert config.late_claim is late, f"{what}: the route's late_claim={config.late_claim}, the policy's {late}"
    return routes[0]


def assert_matches_reference(entry, case, what: str, num_sms=None):
    """``entry`` (a public prefill entry, or decode's) on ``case`` with garbage-prefilled outputs: the float32
    reference's by the benchmark's rule, no device error, and this call's self-scheduling route taken and left clean
    (the counter, the count out, the fault flag and the marks zero). Returns that route."""
    import torch

    import cute_attn
    from cute_attn import testing

    out, lse = case.new_outputs()
    route = call_self_scheduled(entry, case, out, lse, what, num_sms)
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, f"{what} output")
    testing.assert_close_benchmark(lse, ref_lse, f"{what} lse")
    cute_attn.raise_on_device_error()
    assert_scratch_clean(route, what)
    return route


def fault_requests(case, requests, pool_pages: int, ref_out, ref_lse) -> None:
    """Page ids outside the pool written into ``case.kv_indices`` in place, one a request of ``requests`` (its last
    page: past the pool's end for the first, negative for the next, alternating), and those requests' rows of the
    expected outputs set to 0 / lse -inf."""
    kvp = case.kv_indptr.tolist()
    for k, b in enumerate(requests):
        assert kvp[b + 1] > kvp[b], f"request {b} has no page to corrupt"
        rows = slice(int(case.qo_indptr[b]), int(case.qo_indptr[b + 1]))
        ref_out[rows], ref_lse[rows] = 0, float("-inf")
        case.kv_indices[kvp[b + 1] - 1] = -3 if k % 2 else pool_pages + 7


def check_page_faults(entry, case, pool_pages: int, num_sms=None) -> None:
    """Page ids outside the pool in requests 2 (past its end) and 0 (negative): those requests' rows 0 / lse -inf
    (every unit of them, whichever CTA took it), the others the reference's, the error word names kv_indices, the
    scratch is left clean; the next clean call is right (marks cleared)."""
    import pytest
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.device_errors import DeviceIndexError

    ref_out, ref_lse = case.reference()
    saved = case.kv_indices.clone()
    fault_requests(case, (2, 0), pool_pages, ref_out, ref_lse)
    out, lse = case.new_outputs()
    route = call_self_scheduled(entry, case, out, lse, "faulted call", num_sms)
    torch.cuda.synchronize()
    testing.assert_close_benchmark(out, ref_out, "faulted output")
    testing.assert_close_benchmark(lse, ref_lse, "faulted lse")
    with pytest.raises(DeviceIndexError, match="kv_indices"):
        cute_attn.raise_on_device_error()
    assert_scratch_clean(route, "after the faulted call")
    case.kv_indices.copy_(saved)
    assert_matches_reference(entry, case, "clean again", num_sms)


def check_contained(entry, bad_case, corruption) -> None:
    """One corrupted batch: no error at the call, every row written (the pool's NaN never reaches one), the scratch
    left clean, and the error word names the corrupted argument."""
    import pytest
    import torch

    import cute_attn
    from cute_attn import hostile

    out, lse = bad_case.new_outputs()
    route = call_self_scheduled(entry, bad_case, out, lse, corruption.description)
    torch.cuda.synchronize()
    assert_scratch_clean(route, corruption.description)  # a broken batch still counts every CTA out
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{corruption.description}: rows unwritten"
    with pytest.raises(ValueError) as err:
        cute_attn.raise_on_device_error()
    named = hostile.first_named_argument(str(err.value))
    assert named == corruption.names, f"{corruption.description}: names {named!r}: {err.value}"


def check_hostile_calls(entry, case, max_examples: int) -> None:
    """Every corruption the hostile module draws (page ids, indptrs, last page lengths) is contained and reported
    (:func:`check_contained`); then a good batch is right."""
    from hypothesis import HealthCheck, given, settings

    from cute_attn import hostile

    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(drawn=hostile.corruptions(case, kinds))
    def check(drawn):
        check_contained(entry, *drawn)

    check()
    assert_matches_reference(entry, case, "after hostile calls")


def check_last_page_lens(entry, case) -> None:
    """Each ``kv_last_page_len`` corruption (0, one past the page, negative) at every request it applies to, empty
    requests included: contained and reported; then a good batch is right."""
    from cute_attn import hostile

    batch = case.kv_indptr.numel() - 1
    for kind in (hostile.LAST_PAGE_LEN_ZERO, hostile.LAST_PAGE_LEN_PAST_PAGE, hostile.LAST_PAGE_LEN_NEGATIVE):
        for choice in range(batch):
            check_contained(entry, *hostile.corrupt(case, kind, choice=choice))
    assert_matches_reference(entry, case, "after bad last page lengths")


def check_replays(entry, case, pools, total_q: int, page_size: int, steps: int, max_extra_keys: int, rng,
                  fault_step: int = 1) -> None:
    """One call captured in a CUDA graph at ``case``'s shapes, replayed ``steps`` times after the index tensors were
    refilled in place (``total_q`` queries cut at random over the batch, each request ``q + [0, max_extra_keys)``
    keys): each replay equals the reference of what they then hold. ``pools`` are refilled with finite values first
    (every page may be drawn: no NaN poison).

    The warm-up call runs on the capture stream, as an engine's would, so the capture finds that stream's scratch
    made and records no zero-fill of it: every replay starts from what the last replay's last CTA left, which must
    be zero (checked after each). Replay ``fault_step`` has one request's page id outside the pool: its rows 0 /
    lse -inf, the error names kv_indices, and the replays after it are right (its marks cleared)."""
    import numpy as np
    import pytest
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.device_errors import DeviceIndexError

    batch = case.qo_indptr.numel() - 1
    for pool in pools:
        pool.normal_()
    out, lse = case.new_outputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route = call_self_scheduled(entry, case, out, lse, "warm-up")  # the route and this stream's scratch
    stream.synchronize()
    made = dict(route.scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        entry(*case.inputs(), out, lse)
    assert route.scratch.keys() == made.keys() and all(route.scratch[k] is v for k, v in made.items()), \
        "the capture made scratch: replays would start from a captured zero-fill"
    for step in range(steps):
        cuts = np.sort(rng.choice(np.arange(1, total_q), size=batch - 1, replace=False))
        q_lens = np.diff(np.concatenate([[0], cuts, [total_q]])).tolist()
        kv_lens = [q + int(rng.integers(0, max_extra_keys)) for q in q_lens]
        case.qo_indptr.copy_(torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32))
        testing.refill_page_table(kv_lens, page_size, case.kv_indptr, case.kv_indices, case.kv_last_page_len, rng)
        ref_out, ref_lse = case.reference()  # of the index tensors as they now hold
        if step == fault_step:
            fault_requests(case, (int(rng.integers(0, batch)),), pools[0].shape[0], ref_out, ref_lse)
        replay_matches(graph, route, out, lse, ref_out, ref_lse, f"replay {step}")
        if step == fault_step:
            with pytest.raises(DeviceIndexError, match="kv_indices"):
                cute_attn.raise_on_device_error()
    cute_attn.raise_on_device_error()


def check_route_plan(entry, plan_entry, case, what: str, num_sms: int = 132) -> None:
    """A host plan of a batch the rule routes (``config.ROUTE_PLAN_KINDS``, ``plan_units.self_schedule_wins``, with the
    landed late claim whatever the tier's fixture says: claimed early the model keeps these batches on their lists)
    launches the self-scheduling build, not its lists: eager, captured in a CUDA graph, and as the plan a
    ``check_indices=True`` call makes and caches, each equal to the float32 reference, leaving the route's scratch
    clean."""
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.config import late_claim_policy, route_plan_policy
    from cute_attn.unit_schedule_route import recorded_launches

    with route_plan_policy(True), late_claim_policy(True):
        plan = plan_entry(*case.inputs(), num_sms=num_sms)
        assert plan.route is not None, f"{what}: the rule kept this batch on its lists"
        assert plan.route.config.late_claim, f"{what}: the plan's route claims early"
        ref_out, ref_lse = case.reference()
        out, lse = case.new_outputs()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), recorded_launches() as routes:
            entry(*case.inputs(), out, lse, plan=plan, num_sms=num_sms)
        stream.synchronize()
        assert len(routes) == 1 and routes[0] is plan.route, f"{what}: {len(routes)} launches, not the plan's route"
        testing.assert_close_benchmark(out, ref_out, f"{what} output")
        testing.assert_close_benchmark(lse, ref_lse, f"{what} lse")
        assert_scratch_clean(plan.route, what)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream), recorded_launches() as captured:
            entry(*case.inputs(), out, lse, plan=plan, num_sms=num_sms)
        assert len(captured) == 1 and captured[0] is plan.route, f"{what}: the capture did not record the route"
        checked_out, checked_lse = case.new_outputs()  # the host-checked call plans (and caches) the same way
        with recorded_launches() as checked:
            entry(*case.inputs(), checked_out, checked_lse, check_indices=True, num_sms=num_sms)
        torch.cuda.synchronize()
        assert len(checked) == 1, f"{what}: the check_indices=True call launched {len(checked)} routes, expected 1"
        testing.assert_close_benchmark(checked_out, ref_out, f"{what} check_indices output")
        testing.assert_close_benchmark(checked_lse, ref_lse, f"{what} check_indices lse")
    for replay in range(2):
        replay_matches(graph, plan.route, out, lse, ref_out, ref_lse, f"{what} replay {replay}")
    cute_attn.raise_on_device_error()
