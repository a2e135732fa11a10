"""Index tensors handed to a wrapper's ``plan()``: checked once on the host, kept on the device.

FlashInfer's ``plan()`` copies the indptr arrays to the host anyway (it plans there), so reading them
here costs the engine no extra synchronisation. The device copies are made once per ``plan()`` and
passed, as the same objects, to every ``run()``: the entry points' plan cache and fast path key on the
index tensors' identity, so the first ``run()`` after a ``plan()`` plans (one more host read, on
cute_attn's side) and every later layer reuses that plan.

Tensors already int32, contiguous and on the device are kept as they are (FlashInfer keeps them too):
writing into them in place bumps their version counter, which makes the next ``run()`` re-check and
re-plan instead of using a stale plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PagedKv", "host_ints", "check_indptr", "on_device", "paged_kv", "qo_lengths"]

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

    Page ids are checked against the cache's page count by the entry point at the first ``run()``: the
    cache is not known yet.
    """
    n_ptr, n_idx, n_last = names
    ptr = host_ints(where, n_ptr, indptr)
    last = host_ints(where, n_last, last_page_len)
    check_indptr(where, n_ptr, ptr)
    batch = ptr.size - 1
    if last.size != batch:
        raise ValueError(f"{where}: {n_last} must have batch_size = len({n_ptr}) - 1 = {batch} entries, "
                         f"got {last.size}")
    ids = host_ints(where, n_idx, indices)
    if ptr[-1] != ids.size:
        raise ValueError(f"{where}: {n_ptr}[-1] ({ptr[-1]}) must equal len({n_idx}) ({ids.size})")
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
