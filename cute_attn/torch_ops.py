"""``torch.library`` custom ops of the four kinds, for ``torch.compile`` (and other graph capture).

``torch.ops.cute_attn.gqa_paged_prefill`` / ``gqa_paged_decode`` / ``gqa_paged_multi_token_decode`` /
``mla_paged_prefill`` take the
definition's inputs in order (tensors, then ``sm_scale``), then ``output`` and ``lse``, which they write in
place (declared mutated in the schema), then ``natural_lse``; they return nothing. Their fake impls check
shapes only, so fake and meta tensors trace through them. The functions of the same names here are the
one-line form for model code: they allocate missing outputs and return ``(output, lse)``.

Index tensors inside a graph: identity says nothing about values
    Inside an Inductor graph one tensor object can reach two calls holding two sets of values: Inductor hands
    a dead intermediate's buffer to the next one of the same size (``buf8 = buf2; del buf2  # reuse``) and its
    kernels write without bumping the version counter. So the ops take the entry points' device route: every
    launch plans on the GPU from the values the index tensors hold when it runs (``cute_attn.api``'s device
    route is keyed on shapes, strides and dtypes only, never on identity or version), with the index checks on
    the device (``cute_attn.raise_on_device_error``). No host sync, no host plan.

CUDA graphs
    Planning is part of the launch, so a captured graph re-plans at every replay from whatever the index
    tensors hold then: the ops are capturable, Inductor's ``mode="reduce-overhead"`` included. Make the first
    call of a shape outside capture (cudagraph trees warm up eagerly first): it allocates the route's plan
    buffers, which later calls and replays reuse.
"""

import importlib

import torch

from . import validate
from .ops.mla_prefill import page_size_1_order as _mla_order

# the package object, whatever its import name (an exported FlashInfer-Bench Solution ships a copy under
# another one); its public entry points are looked up at call time
_package = importlib.import_module(__package__)
# the op namespace: ``cute_attn`` for the installed package; a copy under another name (an exported
# FlashInfer-Bench Solution ships one) registers its own, so it never replaces the installed package's ops
NAMESPACE = __package__.replace(".", "_")
_OPS = getattr(torch.ops, NAMESPACE)

__all__ = ["gqa_paged_prefill", "gqa_paged_decode", "gqa_paged_multi_token_decode", "mla_paged_prefill"]


def _custom_op(name: str):
    """``torch.library.custom_op`` writing ``output`` and ``lse`` (capturable: it plans on the GPU)."""
    return torch.library.custom_op(name, mutates_args=("output", "lse"))


# ---------------------------------------------------------------------------------------------
# The ops' real impl: the entry point's device route (plan on the GPU from the index values, then launch)
# ---------------------------------------------------------------------------------------------
def _require_cuda(device: torch.device) -> None:
    # checked before planning, which on another device fails less clearly (arch resolution)
    if device.type != "cuda":
        raise ValueError(f"cute_attn kernels run on a CUDA device; the inputs are on {device}")


def _launch_device_planned(entry, inputs: tuple, output, lse, natural_lse: bool) -> None:
    _require_cuda(inputs[0].device)
    # no plan=, check_indices=False: planned on the GPU from the values, whatever the tensors' identity
    entry(*inputs, output, lse, natural_lse=natural_lse)


@_custom_op(f"{NAMESPACE}::gqa_paged_prefill")
def _gqa_paged_prefill_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float,
    output: torch.Tensor, lse: torch.Tensor, natural_lse: bool = False,
) -> None:
    inputs = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    _launch_device_planned(_package.gqa_paged_prefill, inputs, output, lse, natural_lse)


@_custom_op(f"{NAMESPACE}::gqa_paged_decode")
def _gqa_paged_decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float,
    output: torch.Tensor, lse: torch.Tensor, natural_lse: bool = False,
) -> None:
    inputs = (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    _launch_device_planned(_package.gqa_paged_decode, inputs, output, lse, natural_lse)


@_custom_op(f"{NAMESPACE}::gqa_paged_multi_token_decode")
def _gqa_paged_multi_token_decode_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float,
    output: torch.Tensor, lse: torch.Tensor, natural_lse: bool = False,
) -> None:
    inputs = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    _launch_device_planned(_package.gqa_paged_multi_token_decode, inputs, output, lse, natural_lse)


@_custom_op(f"{NAMESPACE}::mla_paged_prefill")
def _mla_paged_prefill_op(
    q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor | None, sm_scale: float, output: torch.Tensor, lse: torch.Tensor,
    natural_lse: bool = False,
) -> None:
    inputs = (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    _launch_device_planned(_package.mla_paged_prefill, inputs, output, lse, natural_lse)


# ---------------------------------------------------------------------------------------------
# Fake impls: the metadata rules that decide the output shapes (no data, no data pointers)
# ---------------------------------------------------------------------------------------------
# A subset of validate.py's rules, the very functions (tests/test_torch_ops.py holds the fake and real rules to the
# same words and exception types). Contiguity, strides, alignment, sm_scale, aliasing and index values are left to
# the real call: a fake tensor has no data pointer, and under dynamic shapes every extra comparison is one more guard.
_tensor = validate.typed
_dim = validate.check_dim
_one_device = validate.same_device


def _fake_outputs(output, lse, total_q, num_heads, head_dim_v, device) -> None:
    validate.output_metadata(output, lse, total_q, num_heads, head_dim_v, device, validate.typed)


def _fake_gqa_common(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len):
    """The rules both GQA kinds share; returns the batch size."""
    _tensor("q", q, torch.bfloat16, 3)
    _tensor("k_cache", k_cache, torch.bfloat16, 4)
    _tensor("v_cache", v_cache, torch.bfloat16, 4)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if page_size < 1:
        raise ValueError(f"k_cache.shape[1] (page_size) must be >= 1, got {page_size}")
    _dim("q", q, 2, head_dim, "the caches' head_dim")
    if num_kv_heads < 1 or q.shape[1] < 1:
        raise ValueError(f"head counts must be >= 1, got {q.shape[1]} query and {num_kv_heads} kv heads")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({num_kv_heads}) for GQA")
    _tensor("kv_indptr", kv_indptr, torch.int32, 1)
    _tensor("kv_indices", kv_indices, torch.int32, 1)
    _tensor("kv_last_page_len", kv_last_page_len, torch.int32, 1)
    batch = kv_indptr.shape[0] - 1
    if batch < 0:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries")
    _dim("kv_last_page_len", kv_last_page_len, 0, batch, "batch_size = len(kv_indptr) - 1")
    return batch


@_gqa_paged_prefill_op.register_fake
@_gqa_paged_multi_token_decode_op.register_fake  # prefill's arguments and shape rules (token counts are values)
def _(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse,
      natural_lse=False):
    batch = _fake_gqa_common(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len)
    _tensor("qo_indptr", qo_indptr, torch.int32, 1)
    _dim("qo_indptr", qo_indptr, 0, batch + 1, "len(kv_indptr)")
    _one_device(dict(q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                     kv_indices=kv_indices, kv_last_page_len=kv_last_page_len))
    _fake_outputs(output, lse, q.shape[0], q.shape[1], v_cache.shape[3], q.device)


@_gqa_paged_decode_op.register_fake
def _(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse, natural_lse=False):
    batch = _fake_gqa_common(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len)
    _dim("q", q, 0, batch, "batch_size = len(kv_indptr) - 1")
    _one_device(dict(q=q, k_cache=k_cache, v_cache=v_cache, kv_indptr=kv_indptr, kv_indices=kv_indices,
                     kv_last_page_len=kv_last_page_len))
    _fake_outputs(output, lse, q.shape[0], q.shape[1], v_cache.shape[3], q.device)


@_mla_paged_prefill_op.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse,
      natural_lse=False):
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        _tensor(name, x, torch.bfloat16, 3)
    total_q, num_heads, ckv_dim = q_nope.shape
    if tuple(q_pe.shape[:2]) != (total_q, num_heads):
        raise ValueError(f"q_pe.shape[:2] must equal q_nope.shape[:2] {(total_q, num_heads)}, "
                         f"got {tuple(q_pe.shape)}")
    num_pages, page_size = ckv_cache.shape[0], ckv_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"ckv_cache.shape[1] (page_size) must be >= 1, got {page_size}")
    _dim("ckv_cache", ckv_cache, 2, ckv_dim, "q_nope's head dim")
    if tuple(kpe_cache.shape) != (num_pages, page_size, q_pe.shape[2]):
        raise ValueError(f"kpe_cache must have shape {(num_pages, page_size, q_pe.shape[2])}, "
                         f"got {tuple(kpe_cache.shape)}")
    if num_heads < 1:
        raise ValueError(f"q_nope must have >= 1 head, got {num_heads}")
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        _tensor(name, x, torch.int32, 1)
    if qo_indptr.shape[0] < 1:
        raise ValueError("qo_indptr must have batch_size + 1 >= 1 entries")
    _dim("kv_indptr", kv_indptr, 0, qo_indptr.shape[0], "len(qo_indptr)")
    named = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, qo_indptr=qo_indptr,
                 kv_indptr=kv_indptr, kv_indices=kv_indices)
    if kv_last_page_len is None:
        if page_size != 1:
            raise ValueError(f"kv_last_page_len is required at page_size {page_size} (ckv_cache.shape[1]): pass it "
                             "before sm_scale, as FlashInfer-Bench's paged MLA definitions do")
    else:
        _tensor("kv_last_page_len", kv_last_page_len, torch.int32, 1)
        _dim("kv_last_page_len", kv_last_page_len, 0, qo_indptr.shape[0] - 1, "batch_size = len(qo_indptr) - 1")
        named["kv_last_page_len"] = kv_last_page_len
    _one_device(named)
    _fake_outputs(output, lse, total_q, num_heads, ckv_dim, q_nope.device)


# ---------------------------------------------------------------------------------------------
# Functional wrappers: one line in model code, eager or compiled
# ---------------------------------------------------------------------------------------------
def _plain_eager(x) -> bool:
    """Whether to call the entry point directly (fast path) instead of the op.

    Dynamo folds ``is_compiling()`` to True while it traces, so a compiled graph records the op. Fake,
    functional and meta tensors, and any active dispatch mode (make_fx, opcheck, FakeTensorMode), must see
    the op too: the entry point launches past the dispatcher. Inference tensors (made under
    ``torch.inference_mode``) have no version counter, which the entry points' host-plan cache reads; the op's
    device route reads none.
    """
    return (not torch.compiler.is_compiling() and x.__class__ is torch.Tensor and x.device.type == "cuda"
            and not x.is_inference() and not torch._C._len_torch_dispatch_stack())


def _outputs_for(output, lse, q: torch.Tensor, head_dim_v):
    if output is None and lse is None:
        output = torch.empty((q.shape[0], q.shape[1], head_dim_v), dtype=torch.bfloat16, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    elif output is None or lse is None:  # the op's schema would only say "expected Tensor"
        raise ValueError("output and lse must be passed together (destination-passing) or both omitted")
    return output, lse


def gqa_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                      output=None, lse=None, *, natural_lse: bool = False):
    """Causal GQA prefill: ``cute_attn.gqa_paged_prefill`` in eager code, the op in a graph. ``(output, lse)``."""
    inputs = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    if _plain_eager(q):
        return _package.gqa_paged_prefill(*inputs, output, lse, natural_lse=natural_lse)
    output, lse = _outputs_for(output, lse, q, v_cache.shape[-1])
    _OPS.gqa_paged_prefill(*inputs, output, lse, natural_lse)
    return output, lse


def gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                     output=None, lse=None, *, natural_lse: bool = False):
    """GQA decode: ``cute_attn.gqa_paged_decode`` in eager code, the op in a graph. ``(output, lse)``."""
    inputs = (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    if _plain_eager(q):
        return _package.gqa_paged_decode(*inputs, output, lse, natural_lse=natural_lse)
    output, lse = _outputs_for(output, lse, q, v_cache.shape[-1])
    _OPS.gqa_paged_decode(*inputs, output, lse, natural_lse)
    return output, lse


def gqa_paged_multi_token_decode(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                                 output=None, lse=None, *, natural_lse: bool = False):
    """Multi-token (speculative) decode: the entry point in eager code, the op in a graph. ``(output, lse)``."""
    inputs = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    if _plain_eager(q):
        return _package.gqa_paged_multi_token_decode(*inputs, output, lse, natural_lse=natural_lse)
    output, lse = _outputs_for(output, lse, q, v_cache.shape[-1])
    _OPS.gqa_paged_multi_token_decode(*inputs, output, lse, natural_lse)
    return output, lse


def mla_paged_prefill(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None,
                      sm_scale=None, output=None, lse=None, *, natural_lse: bool = False):
    """Causal absorbed-MLA prefill: the entry point in eager code, the op in a graph. ``(output, lse)``.

    Both argument orders of :func:`cute_attn.mla_paged_prefill` (``kv_last_page_len`` omitted at page size 1)."""
    kv_last_page_len, sm_scale, output, lse = _mla_order(kv_last_page_len, sm_scale, output, lse)
    inputs = (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    if _plain_eager(q_nope):
        return _package.mla_paged_prefill(*inputs, output, lse, natural_lse=natural_lse)
    output, lse = _outputs_for(output, lse, q_nope, q_nope.shape[-1])
    _OPS.mla_paged_prefill(*inputs, output, lse, natural_lse)
    return output, lse
