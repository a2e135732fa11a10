"""Kept buffers (plans, planner scratch, the error word) come from outside any CUDA graph pool."""

import threading

import pytest
import torch

from cute_attn.buffers import allocate_outside_graph_pools


def test_off_cuda_the_buffers_are_made_in_place():
    made = []

    def make():
        made.append(threading.current_thread())
        return torch.zeros(3)

    out = allocate_outside_graph_pools("cpu", make)
    assert out.shape == (3,) and made == [threading.current_thread()]


@pytest.mark.gpu
def test_on_cuda_the_buffers_are_made_on_another_thread_and_ordered_after_the_caller():
    """cudagraph trees route the calling thread's allocations into their pool: the helper thread's are not."""
    threads = []
    caller_work = torch.ones(1 << 20, device="cuda") * 2  # queued on the caller's stream first

    def make():
        threads.append(threading.current_thread())
        return torch.zeros(4, device="cuda") + caller_work[:4]

    out = allocate_outside_graph_pools("cuda", make)
    assert threads and threads[0] is not threading.current_thread()
    assert out.tolist() == [2.0] * 4  # the side stream waited for the caller's stream, the caller for the side's
