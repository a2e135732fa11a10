"""Allocation of buffers that outlive the call that creates them (plans, planner scratch, the error word).

``torch.compile(mode="reduce-overhead")`` (cudagraph trees) warms a graph up and records it with every
allocation *of the calling thread* routed into the graph's private pool
(``torch._C._cuda_beginAllocateCurrentThreadToPool``), and then refuses to go on when that pool holds a live
tensor the graph does not return ("tensors in the cudagraph pool not tracked as outputs"). A route's buffers
are created by its first call and kept for every later one, so they must come from the ordinary pool:
:func:`allocate_outside_graph_pools` builds them on a helper thread, which no pool routing matches, on a side
stream ordered against the caller's stream both ways by events (no host sync on the caller's stream).

Inside a capture (``torch.cuda.graph``) they are allocated where the capture puts them, as before (waits on a
stream outside the capture are not capturable): make a shape's first call outside capture (the cudagraph
trees' warm-up already is).
"""

from __future__ import annotations

import concurrent.futures

import torch

_SIDE_STREAMS: dict = {}
_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cute_attn_buffers")


def allocate_outside_graph_pools(device, make):
    """``make()`` (tensor allocations and fills), its tensors from the ordinary CUDA pool; ``make()`` itself off
    CUDA or during a capture."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    caller = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(caller)  # after the caller's earlier work: a block it freed may be handed out again here

    def build():
        with torch.cuda.device(device), torch.cuda.stream(side):
            return make()

    made = _ALLOCATOR.submit(build).result()
    caller.wait_stream(side)  # the fills (zeros, ones) land before the caller's next launch reads them
    return made


__all__ = ["allocate_outside_graph_pools"]
