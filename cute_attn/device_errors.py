"""The device error word: index faults the device planner found, read back only when the caller asks.

With device planning (the default: ``check_indices=False``) nothing checks the index values on the host, so a
bad page table cannot raise at the call. The planner instead bounds-checks them on the GPU: a faulty request
reads no page and gets output 0 / lse ``-inf`` (a broken indptr: the whole batch), and the fault is recorded
in one int32 word per device. :func:`raise_on_device_error` reads it (one device-to-host copy, so one sync),
clears it and raises ``ValueError`` naming the argument, the rule and the first faulting request; every cute_attn
call that synchronises anyway (``plan_*`` on the host, ``check_indices=True``) calls it too.
"""

from __future__ import annotations

from enum import IntFlag

import torch

from .buffers import allocate_outside_graph_pools

__all__ = ["Fault", "DeviceIndexError", "error_word", "raise_on_device_error", "peek_device_error"]

INT32_MAX = 2**31 - 1


class Fault(IntFlag):
    """Bits of word 0 (mirrored by ``kernels/common/device_planner.py``)."""

    QO_INDPTR = 1
    KV_INDPTR = 2
    LAST_PAGE_LEN = 4
    PAGE_ID = 8
    CAPACITY = 16


_RULES = {
    Fault.QO_INDPTR: "qo_indptr must start at 0, never decrease and end at total_q = q.shape[0] (the whole "
                     "batch's outputs were set to 0 / lse -inf)",
    Fault.KV_INDPTR: "kv_indptr must start at 0, never decrease and end at most at len(kv_indices) (the whole "
                     "batch's outputs were set to 0 / lse -inf, or, for a request too long for int32 keys, its own)",
    Fault.LAST_PAGE_LEN: "kv_last_page_len must be in 1..page_size for a request with pages (0..page_size without)",
    Fault.PAGE_ID: "kv_indices page ids must be in [0, num_pages)",
    Fault.CAPACITY: "the plan did not fit its DevicePlan buffers (allocate them with PlanCapacity.for_limits for "
                    "the largest batch; the whole batch's outputs were set to 0 / lse -inf)",
}


class DeviceIndexError(ValueError):
    """Index values the device planner refused (a ValueError, like the host checks' errors)."""

    def __init__(self, message: str, faults: Fault, request: int | None):
        super().__init__(message)
        self.faults, self.request = faults, request


_WORDS: dict[torch.device, torch.Tensor] = {}


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _fresh(device: torch.device) -> torch.Tensor:
    return torch.tensor([0, INT32_MAX, 0, -1], dtype=torch.int32, device=device)


def error_word(device) -> torch.Tensor:
    """The int32 ``[4]`` word of ``device`` (allocated at its first use: make that call outside graph capture)."""
    device = _device(device)
    word = _WORDS.get(device)
    if word is None:
        # kept for the process: not in a graph's private pool
        word = _WORDS[device] = allocate_outside_graph_pools(device, lambda: _fresh(device))
    return word


def peek_device_error(device=None) -> tuple[Fault, int | None, int, int]:
    """``(faults, first faulting request or None, a bad page id, its kv_indices position)``; syncs, clears nothing."""
    word = _WORDS.get(_device(device))
    if word is None:
        return Fault(0), None, 0, -1
    bits, request, page, position = (int(x) for x in word.tolist())
    return Fault(bits), (None if request == INT32_MAX else request), page, position


def raise_on_device_error(device=None) -> None:
    """Raise :class:`DeviceIndexError` (a ``ValueError``) if a launch on ``device`` (default: the current CUDA
    device) since the last call found bad index values; clear the word either way. One device-to-host copy."""
    device = _device(device)
    if device.type != "cuda" or device not in _WORDS:
        return
    faults, request, page, position = peek_device_error(device)
    if not faults:
        return
    _WORDS[device].copy_(_fresh(device))
    rules = "; ".join(rule for bit, rule in _RULES.items() if bit in faults)
    where = "" if request is None else f" (first faulting request: {request})"
    detail = f"; e.g. kv_indices[{position}] = {page}" if Fault.PAGE_ID in faults and position >= 0 else ""
    raise DeviceIndexError(f"device index check failed{where}: {rules}{detail}", faults, request)
