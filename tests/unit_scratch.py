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
