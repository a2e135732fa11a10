"""Allocation of buffers that outlive the call that creates them (plans, planner scratch, the error word).

``torch.compile(mode="reduce-overhead")`` (cudagraph trees) warms a graph up and records it with every
allocation of its stream routed into the graph's private pool, and then refuses to record when that pool
holds a live tensor the graph does not return ("tensors in the cudagraph pool not tracked as outputs"). A
route's buffers are created by its first call and kept for every later one, so they must come from the
ordinary pool: :func:`outside_graph_pools` allocates them on a side stream, which no pool routing matches,
ordered against the caller's stream both ways by events (no host sync).

Inside a capture (``torch.cuda.graph``) the buffers are allocated where the capture puts them, as before:
cross-stream waits on a stream outside the capture are not capturable. Make a shape's first call outside
capture (the cudagraph trees' warm-up already is).
"""

from __future__ import annotations

import contextlib

import torch

_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def outside_graph_pools(device):
    """Tensors allocated in this block come from the ordinary CUDA pool (a no-op off CUDA or during capture)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        yield
        return
    caller = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    # after the caller's earlier work: a block freed there may be handed out again here
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        yield
    caller.wait_stream(side)  # the fills (zeros, ones) land before the caller's next launch reads them


__all__ = ["outside_graph_pools"]
