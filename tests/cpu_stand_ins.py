"""CPU stand-ins for what needs a GPU, shared by the CPU tests that fake the device rule and the launcher."""

from __future__ import annotations

from cute_attn import api


def host_planned_route(spec, args, output, lse, natural_lse, arch, num_sms):
    """``api._run_device`` without its device planner (a CUDA kernel): the call takes the host-planned route,
    ``check_indices=True``, whose rules, plans and fast path the CPU tests check (the device route is tested on the
    GPU: ``tests/test_device_planner_gpu.py``)."""
    index = tuple(t for t in (args[spec.arg_names.index(name)] for name in spec.index_names) if t is not None)
    return api.run(spec, args, index, output, lse, None, True, natural_lse, arch, num_sms)
