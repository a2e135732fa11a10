"""Every rule a caller can break, each with an error that names the argument and the rule.

Called by every public entry before any planning or launch. Shape, dtype, device and stride rules read
only tensor metadata. The rules on index *values* (indptr starts at 0 and never decreases, page ids in
range, last-page lengths) read device memory and so synchronise with the GPU; they run when
``check_indices=True`` (the default). Engines that build their index tensors themselves can pass
``check_indices=False``; the API also skips them when the same, unmodified index tensors were already
checked (see ``api.py``). A repeated call skips these checks altogether (``api.py``, fast path): it compares
the metadata they read (``api._signature``), so a rule that reads a new attribute must be added there too.

The rules shared by the op kinds live here; each kind's own rule set (``check``) lives in its spec module
(``cute_attn/ops/<kind>.py``) and is built from these.

Errors: ``TypeError`` for a wrong kind of object or dtype, ``ValueError`` for a wrong shape, device,
layout or value.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "PagedProblem",
    "HostIndices",
    "check_sm_scale",
    "check_flag",
]


@dataclass(frozen=True)
class PagedProblem:
    """What the validated arguments say about the problem (metadata only)."""

    batch_size: int
    total_q: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    page_size: int
    num_pages: int
    device: torch.device
    #: ``len(kv_indices) * page_size``: an upper bound of the keys the batch reads, from shapes alone (a kind's
    #: ``OpSpec.workload_tiles`` may pick knobs by it without reading an index value); 0 where a kind does not set it
    num_kv_slots: int = 0

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @staticmethod
    def for_lengths(q_lens, kv_lens, *, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_v: int,
                    page_size: int, **_) -> "PagedProblem":
        """The problem of a batch given by its lengths (tools, tuning): a pool of exactly the pages it needs, on
        the CPU; other layout keys (``causal``) are ignored."""
        pages = sum(-(-int(kv) // page_size) for kv in kv_lens)
        return PagedProblem(len(q_lens), int(sum(q_lens)), num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v,
                            page_size, max(pages, 1), torch.device("cpu"), num_kv_slots=pages * page_size)


@dataclass(frozen=True)
class HostIndices:
    """Host copies of the index tensors, read once by the value checks and reused by the planner."""

    qo_indptr: np.ndarray  # int64 [batch + 1]
    kv_indptr: np.ndarray  # int64 [batch + 1], in pages
    kv_lens: np.ndarray  # int64 [batch], in tokens


# ---------------------------------------------------------------------------------------------
# Metadata rules
# ---------------------------------------------------------------------------------------------
def typed(name: str, x, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A tensor of this dtype and rank (the rules a fake tensor can answer too: no layout, no data)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def dense(name: str, x, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    typed(name, x, dtype, ndim)
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {x.stride()}")
    return x


def check_dim(name: str, x: torch.Tensor, axis: int, expected: int, what: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(f"{name}.shape[{axis}] must equal {what} ({expected}), got shape {tuple(x.shape)}")


def paged_cache(name: str, x, dtype: torch.dtype) -> torch.Tensor:
    """A ``[num_pages, page_size, heads, dim]`` cache: rows compact, pages may be strided.

    Engines often keep K and V in one tensor (``kv[:, 0]`` / ``kv[:, 1]`` views); the kernels load pages
    by TMA, which needs 16-byte aligned page strides and base addresses.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [num_pages, page_size, heads, dim], got shape {tuple(x.shape)}")
    _, page_size, heads, dim = x.shape
    stride = x.stride()
    page_elems = page_size * heads * dim
    aligned = 16 // x.element_size()
    if stride[1:] != (heads * dim, dim, 1) or (x.shape[0] > 1 and (stride[0] < page_elems or stride[0] % aligned)):
        raise ValueError(
            f"{name} must have compact pages ([page_size, heads, dim] row-major) and a page stride that is a "
            f"multiple of {aligned} elements (16 bytes) and >= {page_elems}, got strides {stride}"
        )
    if x.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address")
    return x


def same_device(named: dict[str, torch.Tensor]) -> torch.device:
    first_name, first = next(iter(named.items()))
    device = first.device  # whole devices, not get_device() ints: those equate cpu and meta (-1), cuda:0 and xpu:0
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"all tensors must be on one device: {first_name} is on {device}, {name} on {t.device}")
    return device


def check_sm_scale(sm_scale) -> float:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number (Python float), got {type(sm_scale).__name__}")
    value = float(sm_scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"sm_scale must be finite and > 0, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """An option that must be a real ``bool``: ``'no'`` or ``0`` would be truthy or falsy by accident."""
    if value.__class__ is not bool:
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes a tensor's elements occupy (strides may leave gaps: the span covers them)."""
    if t.numel() == 0:
        return (0, 0)
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def _check_no_alias(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Outputs are written while the inputs are read: no output may share memory with an input or another output."""
    taken = {name: _byte_span(t) for name, t in inputs.items()}
    for out_name, t in outputs.items():
        lo, hi = _byte_span(t)
        for other, (other_lo, other_hi) in taken.items():
            if lo < other_hi and other_lo < hi:
                raise ValueError(f"{out_name} overlaps {other} in memory: outputs must not alias an input or "
                                 "each other")
        taken[out_name] = (lo, hi)


def check_outputs(output, lse, total_q: int, num_heads: int, head_dim_v: int, device,
                   inputs: dict[str, torch.Tensor]) -> None:
    if output is None and lse is None:
        return
    if output is None or lse is None:
        raise ValueError("output and lse must be passed together (destination-passing) or both omitted")
    output_metadata(output, lse, total_q, num_heads, head_dim_v, device, dense)
    _check_no_alias({"output": output, "lse": lse}, inputs)


def output_metadata(output, lse, total_q: int, num_heads: int, head_dim_v: int, device, tensor_rule=dense) -> None:
    """Dtype, rank, shape and device of the destinations; ``tensor_rule`` is ``dense`` for real tensors and
    ``typed`` for fake ones (torch_ops' fake impls: no layout rule, no alias rule, no data pointer)."""
    tensor_rule("output", output, torch.bfloat16, 3)
    tensor_rule("lse", lse, torch.float32, 2)
    if tuple(output.shape) != (total_q, num_heads, head_dim_v):
        raise ValueError(f"output must have shape {(total_q, num_heads, head_dim_v)}, got {tuple(output.shape)}")
    if tuple(lse.shape) != (total_q, num_heads):
        raise ValueError(f"lse must have shape {(total_q, num_heads)}, got {tuple(lse.shape)}")
    if output.device != device or lse.device != device:
        raise ValueError(f"output and lse must be on the inputs' device ({device})")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_qo_heads < 1:
        raise ValueError(f"head counts must be >= 1, got {num_qo_heads} query and {num_kv_heads} kv heads")
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_qo_heads}) must be a multiple of kv heads ({num_kv_heads}) for GQA"
        )


# ---------------------------------------------------------------------------------------------
# Value rules (read device memory)
# ---------------------------------------------------------------------------------------------
def host_ints(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu").numpy().astype(np.int64)


def check_indptr(name: str, values: np.ndarray) -> None:
    if values.size == 0:
        raise ValueError(f"{name} must have batch_size + 1 >= 1 entries")
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    steps = np.diff(values)
    if (steps < 0).any():
        b = int(np.nonzero(steps < 0)[0][0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{b + 1}]={values[b + 1]} < {name}[{b}]={values[b]}")


def check_page_ids(name: str, ids: torch.Tensor, num_pages: int, unit: str) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds {unit} id {bad}, outside [0, {num_pages}) of the cache")


def paged_indices(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages, total_q) -> HostIndices:
    qo = host_ints(qo_indptr) if qo_indptr is not None else None
    kvp = host_ints(kv_indptr)
    last = host_ints(kv_last_page_len)
    if qo is not None:
        check_indptr("qo_indptr", qo)
        if qo[-1] != total_q:
            raise ValueError(f"qo_indptr[-1] ({qo[-1]}) must equal total_q = q.shape[0] ({total_q})")
    check_indptr("kv_indptr", kvp)
    if kvp[-1] > kv_indices.numel():  # a longer buffer is fine (CUDA graphs: one buffer at capacity)
        raise ValueError(f"kv_indptr[-1] ({kvp[-1]}) must be at most len(kv_indices) ({kv_indices.numel()})")
    check_page_ids("kv_indices", kv_indices[: int(kvp[-1])], num_pages, "page")
    pages = np.diff(kvp)
    has_pages = pages > 0
    lowest = np.where(has_pages, 1, 0)
    bad = (last < lowest) | (last > page_size)
    if bad.any():
        b = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"kv_last_page_len[{b}] = {last[b]} must be in 1..page_size ({page_size}) for a request with pages "
            f"(0..page_size for one with none)"
        )
    kv_lens = np.where(has_pages, (pages - 1) * page_size + last, 0)
    if qo is None:
        qo = np.arange(kvp.size, dtype=np.int64)
    return HostIndices(qo_indptr=qo, kv_indptr=kvp, kv_lens=kv_lens)


# ---------------------------------------------------------------------------------------------
# Entry rules
# ---------------------------------------------------------------------------------------------
def check_paged_gqa_common(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len):
    dense("q", q, torch.bfloat16, 3)
    paged_cache("k_cache", k_cache, torch.bfloat16)
    paged_cache("v_cache", v_cache, torch.bfloat16)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if page_size < 1:
        raise ValueError(f"k_cache.shape[1] (page_size) must be >= 1, got {page_size}")
    check_dim("q", q, 2, head_dim, "the caches' head_dim")
    check_heads(q.shape[1], num_kv_heads)
    dense("kv_indptr", kv_indptr, torch.int32, 1)
    dense("kv_indices", kv_indices, torch.int32, 1)
    dense("kv_last_page_len", kv_last_page_len, torch.int32, 1)
    batch = kv_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries")
    check_dim("kv_last_page_len", kv_last_page_len, 0, batch, "batch_size = len(kv_indptr) - 1")
    return batch, num_pages, page_size, num_kv_heads, head_dim


def __getattr__(name: str):
    """``check_<kind>``: the rule set of an op kind, which lives in its spec module (``cute_attn/ops``)."""
    if name.startswith("check_") and name[len("check_"):] in _kind_names():
        from .ops import get_spec

        return get_spec(name[len("check_"):]).check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kind_names() -> tuple[str, ...]:
    from .ops import kinds

    return kinds()
