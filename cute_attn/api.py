"""Torch layer: validate inputs, allocate outputs, plan (cached), launch.

Every public entry runs, in order: validation (``validate.py``, before anything touches the GPU), the
device rule (inputs on a CUDA device), the kernel config and its ``can_implement``, the plan (from the
caller, or the plan cache), and the launch.

Plans
    Engines plan once per batch and run every layer with that plan: pass ``plan=`` (from
    :func:`plan_gqa_paged_prefill` & co.) or let the entry points cache it. The cache keys on the index
    tensors' identity, shape and version counter (``Tensor._version``, bumped by every in-place write),
    never on a bare data pointer, and holds weak references so a recycled ``id()`` cannot alias. A cache
    hit also skips re-reading the index values for validation: they were checked when the plan was made
    and have not been written since.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from . import validate
from .arch import resolve_arch, sm_count
from .config import PagedAttentionConfig, default_paged_config
from .plan import ItemField, MergeField, PlanCapacity, WorkPlan, plan_work

__all__ = [
    "DevicePlan",
    "gqa_paged_prefill",
    "gqa_paged_decode",
    "mla_paged_prefill",
    "plan_gqa_paged_prefill",
    "plan_gqa_paged_decode",
    "plan_mla_paged_prefill",
    "clear_plan_cache",
]


@dataclass
class DevicePlan:
    """A :class:`WorkPlan`'s arrays on the device, plus the partial buffers, sized by its capacity.

    CUDA graphs: allocate once for the largest batch (``DevicePlan.allocate(config, capacity, num_ctas,
    device)`` with ``PlanCapacity.for_limits``), capture, then before each replay ``refresh(new_plan)``
    copies the new plan into the same buffers; the kernels' grids depend only on the capacity.
    """

    config: PagedAttentionConfig
    plan: WorkPlan | None
    work_indptr: torch.Tensor
    items: torch.Tensor
    merge_indptr: torch.Tensor
    merges: torch.Tensor
    partial_out: torch.Tensor  # [max(max_partials, 1), tile_q_rows, head_dim_v] fp32
    partial_lse: torch.Tensor  # [max(max_partials, 1), tile_q_rows] fp32

    @staticmethod
    def allocate(config: PagedAttentionConfig, capacity: PlanCapacity, num_ctas: int, device) -> "DevicePlan":
        slots = max(capacity.max_partials, 1)

        def ints(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return DevicePlan(
            config=config, plan=None,
            work_indptr=ints(num_ctas + 1), items=ints(capacity.max_items, len(ItemField)),
            merge_indptr=ints(capacity.max_merges + 1), merges=ints(capacity.max_merges, len(MergeField)),
            partial_out=torch.empty(slots, config.tile_q_rows, config.head_dim_v, dtype=torch.float32, device=device),
            partial_lse=torch.empty(slots, config.tile_q_rows, dtype=torch.float32, device=device),
        )

    def refresh(self, plan: WorkPlan) -> None:
        """Copy ``plan`` into these buffers in place (its capacity and CTA count must match them)."""
        if plan.items.shape != tuple(self.items.shape) or plan.merges.shape != tuple(self.merges.shape) \
                or plan.work_indptr.shape != tuple(self.work_indptr.shape) \
                or max(plan.capacity.max_partials, 1) != self.partial_out.shape[0]:
            raise ValueError(
                f"plan capacity {plan.capacity} with {plan.work_indptr.size - 1} CTAs does not match these "
                f"buffers ({self.items.shape[0]} items, {self.merges.shape[0]} merges, "
                f"{self.work_indptr.shape[0] - 1} CTAs): plan with the capacity they were allocated for"
            )
        for dst, src in ((self.work_indptr, plan.work_indptr), (self.items, plan.items),
                         (self.merge_indptr, plan.merge_indptr), (self.merges, plan.merges)):
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
        self.plan = plan

    @staticmethod
    def upload(config: PagedAttentionConfig, plan: WorkPlan, device) -> "DevicePlan":
        device_plan = DevicePlan.allocate(config, plan.capacity, plan.work_indptr.size - 1, device)
        device_plan.refresh(plan)
        return device_plan


# ---------------------------------------------------------------------------------------------
# Plan cache
# ---------------------------------------------------------------------------------------------
class _PlanCache:
    """Last few plans, keyed by (kernel config, index tensors' identity/shape/version)."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    @staticmethod
    def _key(config, tensors):
        # identity + shape + version counter; a tensor on another device is another object (another id)
        return (config,) + tuple((id(t), t.shape, t._version) for t in tensors)

    def get(self, config, tensors) -> DevicePlan | None:
        key = self._key(config, tensors)
        entry = self.entries.get(key)
        if entry is None:
            return None
        refs, device_plan = entry
        if any(r() is not t for r, t in zip(refs, tensors)):  # an id() reused by a new tensor
            del self.entries[key]
            return None
        self.entries.move_to_end(key)
        return device_plan

    def put(self, config, tensors, device_plan: DevicePlan) -> None:
        self.entries[self._key(config, tensors)] = ([weakref.ref(t) for t in tensors], device_plan)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


_PLANS = _PlanCache()


def clear_plan_cache() -> None:
    _PLANS.entries.clear()


# ---------------------------------------------------------------------------------------------
# Shared steps
# ---------------------------------------------------------------------------------------------
def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"cute_attn kernels run on a CUDA device; the inputs are on {device}")


@functools.lru_cache(maxsize=None)
def _device_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_ctas(config: PagedAttentionConfig, device: torch.device, num_sms: int | None) -> int:
    if num_sms is None and device.type == "cuda":
        num_sms = _device_sm_count(device)
    return sm_count(num_sms if num_sms is not None else config.arch) * config.ctas_per_sm


@functools.lru_cache(maxsize=64)
def _target_arch(arch: str | None, device: torch.device) -> str:
    """The arch for a launch on ``device``: resolved once per (argument, device), off the per-call path.

    ``$CUTE_ATTN_ARCH`` and the device capability are therefore read at the first call on a device.
    """
    return resolve_arch(arch)


def _make_config(kind: str, problem: validate.PagedProblem, arch: str | None, causal: bool) -> PagedAttentionConfig:
    return _config_for(kind, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk, problem.head_dim_v,
                       problem.page_size, _target_arch(arch, problem.device), causal)


@functools.lru_cache(maxsize=256)  # host overhead: one config per problem shape, built once
def _config_for(kind, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size, arch, causal):
    config = default_paged_config(
        kind, arch=arch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, page_size=page_size, causal=causal,
    )
    reason = config.can_implement()
    if reason is not None:
        raise ValueError(f"{kind}: unsupported configuration: {reason}")
    return config


def _plan(config, host: validate.HostIndices, device, num_sms) -> DevicePlan:
    q_lens = np.diff(host.qo_indptr)
    plan = plan_work(config.plan_config(_num_ctas(config, device, num_sms)), q_lens, host.kv_lens)
    return DevicePlan.upload(config, plan, device)


def _launch(config: PagedAttentionConfig, device_plan: DevicePlan, args: tuple, output, lse, natural_lse: bool):
    from .kernels import find_launcher

    launcher = find_launcher(config)
    if launcher is None:
        raise NotImplementedError(
            f"no {config.arch} kernel for {config.kind} is implemented yet in this version of cute_attn "
            f"(inputs validated and planned: {device_plan.plan.num_items} work items)"
        )
    launcher(device_plan, *args, output, lse, natural_lse=natural_lse)
    return output, lse


def _run(kind, check, args, index_tensors, output, lse, *, plan, check_indices, natural_lse, arch, num_sms, causal):
    problem, _ = check(*args, output, lse, check_indices=False)
    _require_cuda(problem.device)
    config = _make_config(kind, problem, arch, causal)
    if plan is None:
        plan = _PLANS.get((config, num_sms), index_tensors)
        if plan is None:  # planning reads the index values anyway, so they are always checked here
            _, host = check(*args, output, lse, check_indices=True)
            plan = _plan(config, host, problem.device, num_sms)
            _PLANS.put((config, num_sms), index_tensors, plan)
        # a hit: the same, unmodified index tensors as when this plan was made and checked
    else:
        if plan.config != config:
            raise ValueError(f"plan was made for {plan.config.cache_key()}, these inputs need {config.cache_key()}")
        if check_indices:
            check(*args, output, lse, check_indices=True)
    if output is None:
        output = torch.empty(problem.total_q, problem.num_qo_heads, problem.head_dim_v, dtype=torch.bfloat16,
                             device=problem.device)
        lse = torch.empty(problem.total_q, problem.num_qo_heads, dtype=torch.float32, device=problem.device)
    return _launch(config, plan, args, output, lse, natural_lse)


# ---------------------------------------------------------------------------------------------
# Public entries (definition order: inputs, then output, lse)
# ---------------------------------------------------------------------------------------------
def gqa_paged_prefill(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = True, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Causal GQA prefill over a paged KV cache. Returns ``(output, lse)`` (written in place if given).

    ``lse`` is base 2 unless ``natural_lse=True``. ``check_indices=False`` skips the rules that read
    index values from the device (and synchronise); see ``validate.py``.
    """
    args = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    return _run("gqa_paged_prefill", validate.check_gqa_paged_prefill, args,
                (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), output, lse, plan=plan,
                check_indices=check_indices, natural_lse=natural_lse, arch=arch, num_sms=num_sms, causal=True)


def gqa_paged_decode(
    q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = True, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """GQA decode (one query per request) over a paged KV cache. Returns ``(output, lse)``."""
    args = (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    return _run("gqa_paged_decode", validate.check_gqa_paged_decode, args,
                (kv_indptr, kv_indices, kv_last_page_len), output, lse, plan=plan,
                check_indices=check_indices, natural_lse=natural_lse, arch=arch, num_sms=num_sms, causal=False)


def mla_paged_prefill(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output=None, lse=None,
    *, plan: DevicePlan | None = None, check_indices: bool = True, natural_lse: bool = False,
    arch: str | None = None, num_sms: int | None = None,
):
    """Causal absorbed-MLA prefill over a page-size-1 latent cache. Returns ``(output, lse)``."""
    args = (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale)
    return _run("mla_paged_prefill", validate.check_mla_paged_prefill, args,
                (qo_indptr, kv_indptr, kv_indices), output, lse, plan=plan,
                check_indices=check_indices, natural_lse=natural_lse, arch=arch, num_sms=num_sms, causal=True)


def _explicit_plan(kind, check, args, *, arch, num_sms, causal) -> DevicePlan:
    problem, host = check(*args, check_indices=True)
    config = _make_config(kind, problem, arch, causal)
    return _plan(config, host, problem.device, num_sms)


def plan_gqa_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                           *, arch: str | None = None, num_sms: int | None = None) -> DevicePlan:
    """Plan once per batch (reads the index tensors: one host sync); pass the result as ``plan=``."""
    args = (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    return _explicit_plan("gqa_paged_prefill", validate.check_gqa_paged_prefill, args, arch=arch, num_sms=num_sms,
                          causal=True)


def plan_gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                          *, arch: str | None = None, num_sms: int | None = None) -> DevicePlan:
    args = (q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale)
    return _explicit_plan("gqa_paged_decode", validate.check_gqa_paged_decode, args, arch=arch, num_sms=num_sms,
                          causal=False)


def plan_mla_paged_prefill(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
                           *, arch: str | None = None, num_sms: int | None = None) -> DevicePlan:
    args = (q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale)
    return _explicit_plan("mla_paged_prefill", validate.check_mla_paged_prefill, args, arch=arch, num_sms=num_sms,
                          causal=True)
