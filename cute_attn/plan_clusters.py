"""Which host plans a cluster merge can fold: each merge's slots on the CTAs of one thread-block cluster.

A kernel built with ``PagedAttentionConfig.cluster_merge = k`` launches clusters of ``k`` CTAs and folds a split
request in shared memory (``kernels/common/cluster_merge.py``): the CTA of rank ``r`` in a cluster holds piece ``r``
of one merge, and after one cluster barrier each CTA folds ``1/k`` of the output columns from every peer's
partial, so no partials go to global memory and no combine launch follows. That needs a plan of a given shape,
checked here on the host (numpy only), where the plan is made:

* every CTA holds at most one item (the partial waits in shared memory until the cluster folds it);
* every merge has exactly ``k`` slots, slot ``i`` on the CTA of rank ``i`` of one cluster (CTA ``c`` of the grid
  is rank ``c % k`` of cluster ``c // k``), so a cluster holds one whole merge or no split item at all;
* every CTA with an item lies below ``(num_ctas // k) * k``: the launch rounds the grid down to whole clusters.

The host planners' even pieces of a uniform one-token batch have this shape (MLA decode 16 x 4096: 16 merges of
8 slots on 128 CTAs; 64 x 8192: 64 merges of 2), so the check picks the plans it is meant for without a planner of
its own. Device plans, whose shape the host never sees, take a kernel that checks the shape at run time instead
(``cluster_merge_flags``): :func:`merges_held_by_clusters` is that check's host mirror.
"""

from __future__ import annotations

import numpy as np

from .plan import ItemField, WorkPlan

#: cluster sizes a merge may fold in (powers of two up to the portable cluster limit of 8 CTAs)
CLUSTER_SIZES = (2, 4, 8)


def cluster_merge_size(plan: WorkPlan) -> int:
    """The cluster size ``k`` whose clusters each hold one merge of ``plan`` (module docstring), or 0 when the plan
    has no merges or another shape: every merge held by a cluster (:func:`merges_held_by_clusters`, the checked
    kernel's own test) and nothing else beside them, i.e. no CTA with two items, no split item outside those
    clusters and no item past the launch's whole clusters."""
    if plan.num_merges == 0:
        return 0
    k = int(plan.merge_indptr[1] - plan.merge_indptr[0])
    if k not in CLUSTER_SIZES:
        return 0
    per_cta = np.diff(plan.work_indptr)
    ctas = np.nonzero(per_cta)[0]
    if per_cta.max(initial=0) > 1 or (ctas.size and ctas[-1] >= (plan.config.num_ctas // k) * k):
        return 0
    split = np.count_nonzero(plan.items[plan.work_indptr[ctas], ItemField.PARTIAL_SLOT] >= 0)
    return k if split == k * plan.num_merges and merges_held_by_clusters(plan, k).all() else 0


def merges_held_by_clusters(plan: WorkPlan, k: int) -> np.ndarray:
    """Per merge of ``plan``, whether a launch in clusters of ``k`` CTAs finds it held whole by one cluster: the
    run-time check of a ``cluster_merge_flags`` kernel (``kernels/sm90/mla_decode.with_cluster_check``), which folds
    those and flags them for the combine to skip. A cluster holds merge ``m`` when each of its ``k`` CTAs holds one
    item, rank 0's is slot ``merge_indptr[m]`` of ``m`` with exactly ``k`` slots, and rank ``r``'s is slot ``r``."""
    num_merges = plan.num_merges
    held = np.zeros(num_merges, dtype=bool)
    clusters = plan.config.num_ctas // k
    if num_merges == 0 or clusters == 0:
        return held
    begin = plan.work_indptr[: clusters * k].reshape(clusters, k)
    one_item = (np.diff(plan.work_indptr[: clusters * k + 1]) == 1).reshape(clusters, k)
    rows = plan.items[np.where(one_item, begin, 0)]  # (cluster, rank, field): only read where one_item
    slot, merge = rows[..., ItemField.PARTIAL_SLOT], rows[..., ItemField.MERGE]
    slot0, merge0 = slot[:, 0], merge[:, :1]
    safe = np.where(slot0 >= 0, merge0[:, 0], 0)
    holds = one_item.all(axis=1) & (slot0 >= 0) & (plan.merge_indptr[safe] == slot0) \
        & (plan.merge_indptr[safe + 1] - slot0 == k) & (merge == merge0).all(axis=1) \
        & (slot == slot0[:, None] + np.arange(k)).all(axis=1)
    held[merge0[holds, 0]] = True
    return held


def clusters_used(plan: WorkPlan, k: int) -> int:
    """Clusters of ``k`` CTAs up to the last one holding an item: what must run at once for one wave."""
    ctas = np.nonzero(np.diff(plan.work_indptr))[0]
    return int(ctas[-1]) // k + 1 if ctas.size else 0


__all__ = ["cluster_merge_size", "clusters_used", "merges_held_by_clusters", "CLUSTER_SIZES"]
