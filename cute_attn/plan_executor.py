"""CPU plan executor: runs a :class:`~cute_attn.plan.WorkPlan` with the reference math.

The oracle for the planner (executing a plan must reproduce the reference) and a model of what the
kernels do: each work item attends its packed query rows over its key range into either the final
output or a partial slot; the item that completes a merge's last slot folds the merge's slots with the
LSE combine (the fused merge of the decode kernels: a per-merge counter, the last arrival folds; the
combine kernel of prefill/MLA computes the same values from the ``merges`` table).
Also reports coverage: how often each (request, query head, query token, key) is visited.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .plan import ItemField as F
from .plan import MergeField as MF
from .plan import WorkPlan
from .reference import attend, merge_partials

__all__ = ["execute_plan", "plan_coverage"]


def _rows_to_token_head(row_start: int, row_count: int, group: int, kv_head: int):
    rows = np.arange(row_start, row_start + row_count)
    return rows // group, kv_head * group + rows % group


def execute_plan(
    plan: WorkPlan,
    q: torch.Tensor,
    k_rows: list[torch.Tensor],
    v_rows: list[torch.Tensor],
    qo_indptr,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute ``plan`` on ``q [total_q, Hq, Dqk]`` with each request's keys ``k_rows[b] [Lkv, Hkv, Dqk]``.

    Returns fp32 ``(out [total_q, Hq, Dv], lse [total_q, Hq])`` (base-2 LSE). Elements no item writes
    stay NaN, so a plan that misses rows cannot pass a comparison.
    """
    cfg = plan.config
    group = cfg.group_size
    dv = v_rows[0].shape[-1] if v_rows else q.shape[-1]
    out = torch.full((q.shape[0], q.shape[1], dv), math.nan, dtype=torch.float32)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32)
    partial_o = torch.full((max(plan.num_partials, 1), cfg.tile_q_rows, dv), math.nan, dtype=torch.float32)
    partial_lse = torch.full((max(plan.num_partials, 1), cfg.tile_q_rows), math.nan, dtype=torch.float32)
    qo = [int(x) for x in qo_indptr]
    arrivals: dict[int, int] = {}  # the kernels' merge counters

    for item in plan.valid_items():
        b, h, r0, nr = (int(item[F.REQUEST]), int(item[F.KV_HEAD]), int(item[F.Q_ROW_START]), int(item[F.Q_ROW_COUNT]))
        k0, k1, slot = int(item[F.KV_START]), int(item[F.KV_END]), int(item[F.PARTIAL_SLOT])
        tokens, heads = _rows_to_token_head(r0, nr, group, h)
        q_rows = q[qo[b] + tokens, heads][:, None, :]  # each packed row is its own one-head query
        k = k_rows[b][k0:k1, h : h + 1]
        v = v_rows[b][k0:k1, h : h + 1]
        o, row_lse = attend(
            q_rows, k, v, sm_scale,
            q_pos=torch.as_tensor(tokens), k_pos=torch.arange(k0, k1),
            causal_offset=int(item[F.CAUSAL_OFFSET]),
        )
        if slot < 0:
            out[qo[b] + tokens, heads] = o[:, 0]
            lse[qo[b] + tokens, heads] = row_lse[:, 0]
            continue
        partial_o[slot, :nr] = o[:, 0]
        partial_lse[slot, :nr] = row_lse[:, 0]
        m = int(item[F.MERGE])
        slots = range(int(plan.merge_indptr[m]), int(plan.merge_indptr[m + 1]))
        merge = plan.merges[m]
        if slot not in slots or (int(merge[MF.REQUEST]), int(merge[MF.KV_HEAD]), int(merge[MF.Q_ROW_START]),
                                 int(merge[MF.Q_ROW_COUNT])) != (b, h, r0, nr):
            raise AssertionError(f"item {item.tolist()}: merge {m} does not list slot {slot} or other rows")
        arrivals[m] = arrivals.get(m, 0) + 1
        if arrivals[m] == len(slots):  # the last chunk of the merge folds it, from its own item fields
            o, row_lse = merge_partials([partial_o[s, :nr] for s in slots], [partial_lse[s, :nr] for s in slots])
            out[qo[b] + tokens, heads] = o
            lse[qo[b] + tokens, heads] = row_lse
    if any(arrivals.get(m, 0) != plan.merge_indptr[m + 1] - plan.merge_indptr[m] for m in range(plan.num_merges)):
        raise AssertionError("a merge's slot count differs from the split items that name it")
    return out, lse


def plan_coverage(plan: WorkPlan, q_lens, kv_lens) -> list[np.ndarray]:
    """Per request, counts ``[Hq, Lq, Lkv]`` of how many work items visit each (head, token, *visible* key).

    Keys a row cannot see (causal) are not counted even when an item's range spans them: the kernel
    masks those, so only visible keys must be covered exactly once.
    """
    cfg = plan.config
    group = cfg.group_size
    counts = [np.zeros((cfg.num_qo_heads, int(lq), int(lk)), dtype=np.int32) for lq, lk in zip(q_lens, kv_lens)]
    for item in plan.valid_items():
        b, h = int(item[F.REQUEST]), int(item[F.KV_HEAD])
        tokens, heads = _rows_to_token_head(int(item[F.Q_ROW_START]), int(item[F.Q_ROW_COUNT]), group, h)
        keys = np.arange(int(item[F.KV_START]), int(item[F.KV_END]))
        visible = keys[None, :] <= tokens[:, None] + int(item[F.CAUSAL_OFFSET])
        for i, (t, hh) in enumerate(zip(tokens, heads)):
            counts[b][hh, t, keys[visible[i]]] += 1
    return counts
