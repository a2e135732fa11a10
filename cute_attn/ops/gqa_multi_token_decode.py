"""gqa_paged_multi_token_decode: speculative (multi-token) decode on the decode kernels.

Each request has ``q_len`` = 1..8 query tokens (the draft tokens), the last ``q_len`` positions of the request:
bottom-right causal among themselves, exactly the prefill mask (token ``t`` of a request with ``kv_len`` keys sees
key ``j`` iff ``j <= t + kv_len - q_len``). The math is prefill's (its float32 reference judges it); the work runs
on the decode kernels, whose item packs the request's ``q_len * group`` packed rows into one 64-row M tile (several
tiles of whole tokens when they exceed it), so every K/V page is read once per KV head whatever ``q_len`` is.
"""

from __future__ import annotations

import numpy as np

from .. import reference, testing, validate
from ..api import DevicePlan, plan_for, run
from . import OpSpec
from . import gqa_decode, gqa_prefill

#: draft tokens per request: the decode kernels' per-row causal mask and their exchange buffers are sized for it
MAX_QUERY_TOKENS = 8

ARG_NAMES = gqa_prefill.ARG_NAMES


def check(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
          *, check_indices: bool = True) -> tuple[validate.PagedProblem, validate.HostIndices | None]:
    """Rules of ``gqa_paged_multi_token_decode``: prefill's, plus (index values) 1..8 query tokens per request and
    at least as many keys as query tokens."""
    problem, host = gqa_prefill.check(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      sm_scale, output, lse, check_indices=check_indices)
    if host is not None:
        q_lens = np.diff(host.qo_indptr)
        bad = (q_lens < 1) | (q_lens > MAX_QUERY_TOKENS)
        if bad.any():
            b = int(np.nonzero(bad)[0][0])
            raise ValueError(f"request {b} has {int(q_lens[b])} query tokens (qo_indptr[{b + 1}] - qo_indptr[{b}]): "
                             f"multi-token decode takes 1..{MAX_QUERY_TOKENS} per request")
        short = host.kv_lens < q_lens
        if short.any():
            b = int(np.nonzero(short)[0][0])
            raise ValueError(f"request {b} has {int(host.kv_lens[b])} keys for {int(q_lens[b])} query tokens: the "
                             "query tokens are the request's last positions, so kv_len >= q_len")
    return problem, host


signature = gqa_prefill.signature  # the same arguments, so the same metadata


def strategy():
    """Multi-token decode cases: 1..8 tokens per request, ragged kv lengths, one long request (splits)."""
    return testing.multi_token_batches().map(lambda lens: {"q_lens": lens[0], "kv_lens": lens[1]})


def default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> dict:
    """Decode's tiles, with at most MAX_QUERY_TOKENS tokens per item: the kernel computes that many tokens' rows,
    so a longer request (possible when no host check reads q_len) is planned as several items, never truncated."""
    tiles = gqa_decode.default_tiles(arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size)
    return {**tiles, "max_tile_tokens": MAX_QUERY_TOKENS}


SPEC = OpSpec(
    name="gqa_paged_multi_token_decode", arg_names=ARG_NAMES,
    index_names=("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"), causal=True, check=check,
    signature=signature, reference=reference.gqa_paged_prefill_ref,
    make_case=testing.make_gqa_multi_token_decode_case, strategy=strategy,
    default_tiles=default_tiles, shape_reason=gqa_decode.shape_reason,
    kernel_modules=gqa_decode.SPEC.kernel_modules,
)


def gqa_paged_multi_token_decode(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = False, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Multi-token (speculative) GQA decode over a paged KV cache. Returns ``(output, lse)``.

    Shapes and dtypes: those of :func:`gqa_paged_prefill` (``q [total_q, num_qo_heads, head_dim]``, ``qo_indptr
    [batch + 1]``: request b's query tokens are rows ``qo_indptr[b] .. qo_indptr[b+1]-1``), with 1..8 query tokens
    per request and ``kv_len >= q_len`` (checked from the index values with ``check_indices=True``; by default the
    call plans on the GPU, which does not check q_len: a longer request is still computed right, as several items
    of at most 8 tokens). The tokens are the
    request's last ``q_len`` positions, causal among themselves: token t sees keys ``j <= t + kv_len - q_len``.
    ``lse`` is base 2 unless ``natural_lse=True``.

    Runs on the decode kernels (sm_90a runs on Hopper; sm_100a is compiled and PTX-checked only), so it supports
    what :func:`gqa_paged_decode` supports: groups that fit 64 rows, head_dim 64 / 128 / 256, pages of 16..128.
    A request's ``q_len * group`` packed rows share one item (several items of whole tokens past 64 rows), so the
    K/V cache is streamed once per KV head as in single-token decode. Plans: as :func:`gqa_paged_decode` (or plan
    once with :func:`plan_gqa_paged_multi_token_decode` and pass ``plan=`` to every layer).
    """
    return run(SPEC, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
               (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), output, lse, plan, check_indices, natural_lse,
               arch, num_sms)


def plan_gqa_paged_multi_token_decode(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      sm_scale, *, arch: str | None = None, num_sms: int | None = None,
                                      on_device: bool = False) -> DevicePlan:
    """Validate and plan one multi-token decode batch (reads the index tensors: one host sync) for ``plan=``."""
    return plan_for(SPEC, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale),
                    arch=arch, num_sms=num_sms, on_device=on_device)


__all__ = ["SPEC", "MAX_QUERY_TOKENS", "gqa_paged_multi_token_decode", "plan_gqa_paged_multi_token_decode", "check"]
