"""One request cut out of a batch case, and plans that never split: what the batch-invariance tests compare.

Shared by the CPU tier (which checks these tools against the reference and the planner) and the GPU tier
(which runs them through the kernels), so a bug here shows up on CPU before it costs device time.
"""

from __future__ import annotations

import dataclasses

import torch

from cute_attn import hostile
from cute_attn.api import DevicePlan
from cute_attn.plan import plan_work
from cute_attn.testing import GqaDecodeCase, MlaPrefillCase


def _int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def query_lens(case) -> list[int]:
    return [1] * len(case.kv_lens) if isinstance(case, GqaDecodeCase) else list(case.q_lens)


def request_rows(case, b: int) -> slice:
    """Rows of request ``b`` in the case's output and lse."""
    if isinstance(case, GqaDecodeCase):
        return slice(b, b + 1)
    qo = case.qo_indptr.tolist()
    return slice(qo[b], qo[b + 1])


def solo_request(case, b: int):
    """Request ``b`` of ``case`` as a batch of its own: the same query rows and the same pages of the same
    pool (new index tensors, the caches shared), so any difference from the batch run is the batch's doing."""
    device = case.kv_indptr.device
    ptr = case.kv_indptr.tolist()
    pages = dict(kv_indptr=_int32([0, ptr[b + 1] - ptr[b]], device),
                 kv_indices=case.kv_indices[ptr[b]:ptr[b + 1]].clone(), kv_lens=[case.kv_lens[b]])
    if isinstance(case, GqaDecodeCase):
        return dataclasses.replace(case, q=case.q[b:b + 1].clone(),
                                   kv_last_page_len=case.kv_last_page_len[b:b + 1].clone(), **pages)
    rows = request_rows(case, b)
    queries = dict(qo_indptr=_int32([0, rows.stop - rows.start], device), q_lens=[case.q_lens[b]])
    if isinstance(case, MlaPrefillCase):
        return dataclasses.replace(case, q_nope=case.q_nope[rows].clone(), q_pe=case.q_pe[rows].clone(),
                                   **queries, **pages)
    return dataclasses.replace(case, q=case.q[rows].clone(), kv_last_page_len=case.kv_last_page_len[b:b + 1].clone(),
                               **queries, **pages)


def no_split_plan(case, **plan_kw) -> DevicePlan:
    """The default plan of ``case`` with splitting turned off: every (q tile, KV head) is one item over its
    whole key range, so a request's arithmetic no longer depends on the rest of the batch.

    Only the planner's ``PlanConfig`` changes; the kernel config is the one the entry computes, so the entry
    accepts the plan. ``plan_kw``: ``arch``/``num_sms`` for the plan entry (CPU tier).
    """
    default = hostile.entry_for(case).plan(*case.inputs(), **plan_kw)
    plan_config = dataclasses.replace(default.plan.config, allow_split=False)
    work = plan_work(plan_config, query_lens(case), case.kv_lens)
    return DevicePlan.upload(default.config, work, case.kv_indptr.device)
