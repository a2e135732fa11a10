"""Argument rules shared by the FlashInfer-compatible wrappers.

FlashInfer's wrappers take many options that select features cute_attn does not have (RoPE, soft-cap,
sliding windows, custom masks, fp8 scales, other layouts). Each one keeps FlashInfer's name and default;
a value other than the one we implement raises ``NotImplementedError`` naming the argument and the
value, so an engine that swaps the class learns at ``plan()`` (or its first ``run()``) what it relied on,
instead of getting silently different attention.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..validate import check_sm_scale

__all__ = [
    "Shown",
    "reject",
    "require_none",
    "require_value",
    "require_false",
    "require_unit_scale",
    "require_no_soft_cap",
    "bf16_dtype",
    "count",
    "resolve_sm_scale",
    "workspace_device",
    "check_kv_layout",
    "unpack_paged_kv",
    "check_gqa_shapes",
    "destinations",
]


class Shown(str):
    """A description that stands for a value in an error (a tensor's repr would print its data)."""

    def __repr__(self) -> str:
        return str(self)


def reject(where: str, name: str, value, supported: str) -> None:
    raise NotImplementedError(f"{where}: {name}={value!r} is not supported by cute_attn (supported: {supported})")


def require_none(where: str, **named) -> None:
    """Options whose only supported value is their default ``None`` (features we do not have)."""
    for name, value in named.items():
        if value is not None:
            reject(where, name, _shown(value), "None")


def _shown(value):
    if isinstance(value, torch.Tensor):
        return Shown(f"<tensor {tuple(value.shape)} {value.dtype}>")
    return value


def require_value(where: str, name: str, value, allowed: tuple) -> None:
    if not any(_same(value, a) for a in allowed):
        reject(where, name, _shown(value), " or ".join(repr(a) for a in allowed))


def _same(value, allowed) -> bool:
    # not `value in allowed`: == against a tensor is elementwise, and True == 1 would pass for an int option
    if isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    if isinstance(allowed, numbers.Number):
        return isinstance(value, numbers.Number) and value == allowed
    return type(value) is type(allowed) and value == allowed


def require_false(where: str, **named) -> None:
    for name, value in named.items():
        if value:
            reject(where, name, value, "False")


def require_unit_scale(where: str, **named) -> None:
    """fp8 calibration scales: engines pass 1.0 for bf16 caches, which is a no-op; anything else is not."""
    for name, value in named.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or float(value) != 1.0:
            reject(where, name, _shown(value), "None or 1.0 (bf16 caches need no calibration scale)")


def require_no_soft_cap(where: str, logits_soft_cap) -> None:
    if logits_soft_cap is None:
        return
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real) or logits_soft_cap != 0:
        reject(where, "logits_soft_cap", logits_soft_cap, "None or 0 (no soft-capping)")


def bf16_dtype(where: str, name: str, value) -> torch.dtype:
    """FlashInfer's dtype arguments accept a torch.dtype or its name; cute_attn runs bf16 only."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: {name} must be a torch.dtype or its name, got {value!r}")
    if dtype != torch.bfloat16:
        reject(where, name, value, "torch.bfloat16")
    return dtype


def count(where: str, name: str, value) -> int:
    """A head count, head dim or page size: a positive Python int (numpy ints too, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{where}: {name} must be >= 1, got {value}")
    return int(value)


def resolve_sm_scale(where: str, sm_scale, head_dim: int) -> float:
    """FlashInfer's default is ``1 / sqrt(head_dim)``; a Python float either way (the API's fast path keys on it)."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        return check_sm_scale(sm_scale)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def workspace_device(where: str, float_workspace_buffer) -> torch.device:
    """FlashInfer's scratch buffer: only its device is used (cute_attn keeps its own plan buffers)."""
    if not isinstance(float_workspace_buffer, torch.Tensor):
        raise TypeError(f"{where}: float_workspace_buffer must be a torch.Tensor, got "
                        f"{type(float_workspace_buffer).__name__}")
    return float_workspace_buffer.device


def check_kv_layout(where: str, kv_layout) -> None:
    if kv_layout == "HND":
        reject(where, "kv_layout", kv_layout, "'NHD'")
    if kv_layout != "NHD":
        raise ValueError(f"{where}: kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")


def unpack_paged_kv(where: str, paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` NHD caches ``[pages, page_size, heads, dim]`` from FlashInfer's two accepted forms.

    A tuple ``(k_cache, v_cache)``, or one tensor ``[pages, 2, page_size, heads, dim]`` whose
    ``[:, 0]``/``[:, 1]`` views are K and V (strided pages, compact rows: what our validation accepts).
    Page size 1 may drop its axis (3-D caches, a 4-D combined tensor), as in FlashInfer.
    """
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{where}: paged_kv_cache as a tuple must be (k_cache, v_cache), got "
                             f"{len(paged_kv_cache)} items")
        return tuple(_with_page_axis(where, name, t, 3) for name, t in zip(("k_cache", "v_cache"), paged_kv_cache))
    if isinstance(paged_kv_cache, torch.Tensor):
        kv = _with_page_axis(where, "paged_kv_cache", paged_kv_cache, 4, page_axis=2)
        if kv.shape[1] != 2:
            raise ValueError(f"{where}: a combined paged_kv_cache must be [num_pages, 2, page_size, num_kv_heads, "
                             f"head_dim] (K at [:, 0], V at [:, 1]), got shape {tuple(kv.shape)}")
        return kv[:, 0], kv[:, 1]
    raise TypeError(f"{where}: paged_kv_cache must be a tensor or a (k_cache, v_cache) tuple, got "
                    f"{type(paged_kv_cache).__name__}")


def _with_page_axis(where: str, name: str, t, ndim_without_page: int, page_axis: int = 1) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == ndim_without_page:
        return t.unsqueeze(page_axis)
    if t.dim() != ndim_without_page + 1:
        raise ValueError(f"{where}: {name} must be {ndim_without_page + 1}-D (NHD), got shape {tuple(t.shape)}")
    return t


def check_gqa_shapes(where: str, q, k_cache, v_cache, *, rows: int, num_qo_heads: int, num_kv_heads: int,
                     head_dim_qk: int, head_dim_vo: int, page_size: int) -> None:
    """The tensors a run() gets must be the ones its plan() described (FlashInfer plans from these sizes)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{where}: q must be a torch.Tensor, got {type(q).__name__}")
    expected = (rows, num_qo_heads, head_dim_qk)
    if tuple(q.shape) != expected:
        raise ValueError(f"{where}: q must be [rows, num_qo_heads, head_dim] = {expected} as planned, got "
                         f"{tuple(q.shape)}")
    for name, cache, dim in (("k_cache", k_cache, head_dim_qk), ("v_cache", v_cache, head_dim_vo)):
        if tuple(cache.shape[1:]) != (page_size, num_kv_heads, dim):
            raise ValueError(f"{where}: {name} pages must be [page_size, num_kv_heads, head_dim] = "
                             f"{(page_size, num_kv_heads, dim)} as planned (NHD), got {tuple(cache.shape[1:])}")


def destinations(out, lse, rows: int, heads: int, head_dim_v: int, device):
    """Our entry points take ``output`` and ``lse`` together; FlashInfer lets a caller pass either alone.

    The missing one is allocated here (the kernels write lse anyway); both ``None`` lets the entry
    allocate both.
    """
    if out is None and lse is None:
        return None, None
    if out is None:
        out = torch.empty(rows, heads, head_dim_v, dtype=torch.bfloat16, device=device)
    if lse is None:
        lse = torch.empty(rows, heads, dtype=torch.float32, device=device)
    return out, lse
