"""Index tensors handed to a wrapper's ``plan()``: checked once on the host, kept on the device.

FlashInfer's ``plan()`` copies the indptr arrays to the host anyway (it plans there), so reading them
here costs the engine no extra synchronisation. The device copies are made once per ``plan()`` and
passed, as the same objects, to every ``run()``; the first ``run()`` plans on the GPU (``step_plan.py``: no host
sync) and the others reuse that plan. Tensors already int32,
contiguous and on the device are kept as they are (FlashInfer keeps them too). In CUDA-graph mode the
wrappers copy each plan's batch into the caller's fixed buffers instead (:func:`graph_buffer`,
:func:`refill`), so a captured ``run()`` reads every later plan's batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PagedKv", "host_ints", "host_prefix", "check_indptr", "on_device", "paged_kv", "qo_lengths",
           "graph_buffer", "refill"]

_INT32_MAX = 2**31 - 1


def host_ints(where: str, name: str, t) -> np.ndarray:
    """A 1-D integer tensor's values as int64 numpy (a device tensor is copied: one sync)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{where}: {name} must hold integers (int32), got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{where}: {name} must be 1-D, got shape {tuple(t.shape)}")
    values = t.detach().to("cpu").numpy().astype(np.int64)
    if values.size and (values.min() < -_INT32_MAX - 1 or values.max() > _INT32_MAX):
        raise ValueError(f"{where}: {name} holds values outside int32 range")
    return values


def host_prefix(where: str, name: str, t, n: int, bound: str) -> np.ndarray:
    """The first ``n`` values of a 1-D integer tensor (``t`` may be longer: only those are copied to the host, not a
    capacity buffer's whole length)."""
    if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() < n:
        raise ValueError(f"{where}: {bound} ({n}) must be at most len({name}) ({t.numel()})")
    return host_ints(where, name, t[:n] if isinstance(t, torch.Tensor) and t.dim() == 1 else t)


def check_indptr(where: str, name: str, values: np.ndarray) -> None:
    if values.size == 0:
        raise ValueError(f"{where}: {name} must have batch_size + 1 >= 1 entries")
    if values[0] != 0:
        raise ValueError(f"{where}: {name}[0] must be 0, got {values[0]}")
    steps = np.diff(values)
    if (steps < 0).any():
        b = int(np.nonzero(steps < 0)[0][0])
        raise ValueError(f"{where}: {name} must be non-decreasing: {name}[{b + 1}]={values[b + 1]} < "
                         f"{name}[{b}]={values[b]}")


def on_device(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """int32, contiguous, on ``device``; the same object when it already is."""
    return t.to(device=device, dtype=torch.int32, non_blocking=non_blocking).contiguous()


@dataclass(frozen=True)
class PagedKv:
    """A batch's page table (device tensors, as the entry points take them) and its host facts."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: np.ndarray  # tokens per request

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.size)


def paged_kv(where: str, indptr, indices, last_page_len, page_size: int, device, non_blocking: bool,
             names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")) -> PagedKv:
    """Checks FlashInfer's CSR page table (indptr in pages, last-page fill in tokens) and moves it to ``device``.

    Page ids are checked against the cache's page count on the GPU, by the device planner of the batch's first
    ``run()`` (the cache is not known yet): a request with an id outside the pool reads none of its pages and gets
    output 0 / lse -inf, and ``cute_attn.raise_on_device_error()`` names it. ``indices`` may run past
    ``indptr[-1]`` (engines size it with slack; a CUDA-graph capacity buffer), as FlashInfer allows; only the ids
    the batch owns are read.
    """
    n_ptr, n_idx, n_last = names
    ptr = host_ints(where, n_ptr, indptr)
    last = host_ints(where, n_last, last_page_len)
    check_indptr(where, n_ptr, ptr)
    batch = ptr.size - 1
    if last.size != batch:
        raise ValueError(f"{where}: {n_last} must have batch_size = len({n_ptr}) - 1 = {batch} entries, "
                         f"got {last.size}")
    ids = host_prefix(where, n_idx, indices, int(ptr[-1]), f"{n_ptr}[-1]")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{where}: {n_idx} holds a negative page id ({ids.min()})")
    pages = np.diff(ptr)
    lowest = np.where(pages > 0, 1, 0)  # a request without pages has no last page: 0 is its only fill
    bad = (last < lowest) | (last > page_size)
    if bad.any():
        b = int(np.nonzero(bad)[0][0])
        raise ValueError(f"{where}: {n_last}[{b}] = {last[b]} must be in 1..page_size ({page_size}) for a "
                         f"request with pages (0 for one without)")
    kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    return PagedKv(on_device(indptr, device, non_blocking), on_device(indices, device, non_blocking),
                   on_device(last_page_len, device, non_blocking), kv_lens)


def qo_lengths(where: str, name: str, qo_indptr, batch: int) -> np.ndarray:
    """Query tokens per request from a query indptr that must describe ``batch`` requests."""
    qo = host_ints(where, name, qo_indptr)
    check_indptr(where, name, qo)
    if qo.size != batch + 1:
        raise ValueError(f"{where}: {name} must have batch_size + 1 = {batch + 1} entries (one per request of "
                         f"the kv indptr, plus one), got {qo.size}")
    return np.diff(qo)


def graph_buffer(where: str, name: str, t, device: torch.device, entries: int | None = None) -> torch.Tensor:
    """A CUDA-graph index buffer given to a wrapper's constructor: a 1-D int32 contiguous tensor on the workspace's
    device (``entries`` of them when the batch fixes its length). A graph replays its launches on these very
    tensors, so they are kept, never copied."""
    if t is None:
        raise ValueError(f"{where}: use_cuda_graph=True needs {name} (a fixed int32 buffer that every plan() "
                         "refills and every captured run() reads)")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be a contiguous 1-D int32 tensor, got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    if t.device != torch.device(device):
        raise ValueError(f"{where}: {name} must be on the workspace's device {device}, got {t.device}")
    if entries is not None and t.numel() != entries:
        raise ValueError(f"{where}: {name} must have {entries} entries (the batch size, fixed by the "
                         f"kv_last_page_len / kv_len_arr buffer, plus one for an indptr), got {t.numel()}")
    return t


def refill(where: str, copies, non_blocking: bool) -> None:
    """Each ``(name, values, buffer_name, buffer, exact)`` of ``copies``: ``values`` copied into the front of a
    CUDA-graph buffer in place (all of it when ``exact``: the batch size is fixed for the wrapper's life in graph
    mode, as FlashInfer's). Every length is checked before any copy, so a plan() that fails leaves the buffers as
    the last good plan left them."""
    for name, values, buffer_name, buffer, exact in copies:
        n = values.numel()
        if (n != buffer.numel()) if exact else (n > buffer.numel()):
            rule = f"{buffer.numel()}" if exact else f"at most {buffer.numel()}"
            raise ValueError(f"{where}: {name} has {n} entries; the CUDA-graph buffer {buffer_name} takes {rule} "
                             "(use_cuda_graph=True fixes the batch size and the page capacity at construction)")
    for name, values, buffer_name, buffer, exact in copies:
        if values.data_ptr() != buffer.data_ptr():  # an engine may fill the buffer itself and pass it back
            buffer[: values.numel()].copy_(values.to(device=buffer.device, dtype=torch.int32),
                                           non_blocking=non_blocking)
