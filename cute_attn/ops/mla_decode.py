"""mla_paged_decode: absorbed-MLA decode, one query token per request over a page-size-1 latent cache.

FlashInfer-Bench's ``mla_paged_decode_h16_ckv512_kpe64_ps1`` / ``..._h8_...`` argument order. It is the MLA prefill
kind with one query per request: a single query sees every key of its request, which is exactly the bottom-right
causal mask, so it runs the MLA prefill kernel with ``qo_indptr = 0, 1, ..., batch`` (one cached tensor per batch
size and device, so the plan cache keys on a stable object; it is allocated at the first call of a batch size, so
make that call outside CUDA-graph capture). A kernel of its own (split-KV at the bandwidth wall,
FlashMLA's job) is issue 11's; this entry gives engines and FlashInfer-Bench the decode argument order now.
"""

from __future__ import annotations

import torch

from ..api import DevicePlan, plan_for, run
from . import mla_prefill

_ONE_PER_REQUEST: dict[tuple[int, torch.device], torch.Tensor] = {}


def _qo_indptr(q_nope, kv_indptr) -> torch.Tensor:
    """``0, 1, ..., batch`` on the inputs' device; the decode rules first, in the decode arguments' names."""
    for name, t, ndim in (("q_nope", q_nope, 3), ("kv_indptr", kv_indptr, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    batch = kv_indptr.shape[0] - 1
    if q_nope.shape[0] != batch:
        raise ValueError(f"q_nope.shape[0] must equal batch_size = len(kv_indptr) - 1 ({batch}): one query per "
                         f"request, got shape {tuple(q_nope.shape)}")
    key = (batch, kv_indptr.device)
    indptr = _ONE_PER_REQUEST.get(key)
    if indptr is None:
        if len(_ONE_PER_REQUEST) >= 64:
            _ONE_PER_REQUEST.clear()
        indptr = _ONE_PER_REQUEST[key] = torch.arange(batch + 1, dtype=torch.int32, device=kv_indptr.device)
    return indptr


def mla_paged_decode(
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = False, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Absorbed-MLA decode over a page-size-1 latent cache: one query per request. Returns ``(output, lse)``.

    Shapes and dtypes (row-major; index tensors int32 on the same CUDA device):
        q_nope [batch, num_heads, 512] bf16   q_pe [batch, num_heads, 64] bf16
        ckv_cache [num_pages, 1, 512] bf16    kpe_cache [num_pages, 1, 64] bf16
        kv_indptr [batch + 1] key offsets into kv_indices; kv_indices [kv_indptr[-1]] latent rows in [0, num_pages)
        sm_scale Python float > 0; output [batch, num_heads, 512] bf16, lse [batch, num_heads] fp32 (optional)
    Every key of the request is visible. ``lse`` is base 2 unless ``natural_lse=True``; a request with no keys
    gets output 0 and lse -inf. Runs the MLA prefill kernel (sm_90a on Hopper; sm_100a compiled only) with one
    query per request; needs a CUDA GPU. Plans: as :func:`cute_attn.gqa_paged_decode`, or
    :func:`plan_mla_paged_decode` once and ``plan=`` per layer.
    """
    qo_indptr = _qo_indptr(q_nope, kv_indptr)
    return run(mla_prefill.SPEC, (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale),
               (qo_indptr, kv_indptr, kv_indices), output, lse, plan, check_indices, natural_lse, arch, num_sms)


def plan_mla_paged_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale,
                          *, arch: str | None = None, num_sms: int | None = None, on_device: bool = False) -> DevicePlan:
    """Validate and plan one MLA decode batch (reads the index tensors: one host sync) for ``plan=``."""
    qo_indptr = _qo_indptr(q_nope, kv_indptr)
    return plan_for(mla_prefill.SPEC, (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices,
                                       sm_scale), arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["mla_paged_decode", "plan_mla_paged_decode"]
