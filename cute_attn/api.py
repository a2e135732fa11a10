"""Torch layer, generic over op kinds: validate inputs, choose the config, plan (cached), launch.

Every public entry (in its kind's spec module, ``cute_attn/ops``) calls :func:`run` with its spec, which runs,
in order: the kind's rules (``spec.check``, before anything touches the GPU), the device rule (inputs on a
CUDA device), the kernel config (``spec.default_tiles``) and its ``can_implement`` (the kind's shape rules,
then the rules of the kernel registered for (kind, arch), so a shape no kernel builds fails here, before any
planning), the plan (from the caller, or the plan cache), and the launch. ``plan_<kind>`` calls
:func:`plan_for`.

Plans
    Engines plan once per batch and run every layer with that plan: pass ``plan=`` (from
    :func:`plan_gqa_paged_prefill` & co.) or let the entry points cache it. The cache keys on the index
    tensors' identity, shape, data pointer and version counter (``Tensor._version``, bumped by every
    in-place write), never on a bare data pointer, and holds weak references so a recycled ``id()``
    cannot alias. A cache hit also skips re-reading the index values for validation: they were checked
    when the plan was made and have not been written since.

Fast path (host overhead: engines call once per layer with one batch's index tensors)
    A call that repeats an earlier successful one skips the rules, the config and the plan lookup: one
    dict lookup keyed on (entry, the index tensors' and explicit plan's ``id()``, the options, the
    ``sm_scale`` float), then one compare of the tensors' metadata (:func:`_signature`) against what the
    full path validated. Index tensors must be the same objects (weakref-checked), at the same data
    pointer and version counter; the other tensors match by metadata alone (class, shape, contiguity or
    strides, dtype, device, cache alignment), since no rule reads their values: per-layer caches and fresh
    ``q``/``output`` tensors hit. Anything else takes the full path, so bad input gets the same error.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from . import config as config_policies  # the module's policy globals, read at call time
from . import validate
from .arch import resolve_arch, sm_count
from .buffers import allocate_outside_graph_pools
from .config import PagedAttentionConfig, default_paged_config
from .kernels import find_launcher
from .plan import ItemField, MergeField, PlanCapacity, WorkPlan, plan_work

__all__ = ["DevicePlan", "clear_plan_cache", "run", "plan_for"]


@dataclass
class DevicePlan:
    """A :class:`WorkPlan`'s arrays on the device, plus the partial buffers, sized by its capacity.

    CUDA graphs: allocate once for the largest batch (``DevicePlan.allocate(config, capacity, num_ctas,
    device)`` with ``PlanCapacity.for_limits``), capture, then before each replay ``refresh(new_plan)``
    copies the new plan into the same buffers; the kernels' grids depend only on the capacity.

    ``merge_counters`` (int32 ``[max(max_merges, 1)]``, zeroed once here, never written by ``refresh``)
    are the fused merge's arrival counters (decode kernels): the CTA that finishes a merge's last chunk
    folds it and resets its counter to 0, so the buffer is all zero again after every launch and graph
    replay. A launch that dies mid-way (a fault) can leave counters non-zero; allocate a fresh DevicePlan.

    Streams: the partial buffers and the counters are per-launch scratch, so each CUDA stream that launches
    with this plan gets its own (:meth:`scratch`): the first stream uses the three tensors above, any other
    stream a copy allocated on its first launch. Launches on one stream run in order; launches on two streams
    may overlap and share only the read-only work lists. (The same index tensors used on two streams at once
    therefore stay correct: the entry points' plan cache hands both the same DevicePlan.)
    """

    config: PagedAttentionConfig
    plan: WorkPlan | None
    work_indptr: torch.Tensor
    items: torch.Tensor
    merge_indptr: torch.Tensor
    merges: torch.Tensor
    partial_out: torch.Tensor  # [max(max_partials, 1), tile_q_rows, head_dim_v] fp32 (bf16: config.bf16_partials)
    partial_lse: torch.Tensor  # [max(max_partials, 1), tile_q_rows] fp32
    merge_counters: torch.Tensor  # [max(max_merges, 1)] int32, zero between launches (see above)
    #: CUDA stream handle -> (partial_out, partial_lse, merge_counters) of launches on that stream
    stream_scratch: dict = field(default_factory=dict, repr=False, compare=False)
    #: the device planner's scratch (``device_planning.PlannerScratch``) when the lists are planned on the GPU
    planner: object = field(default=None, repr=False, compare=False)
    #: a host plan whose batch the self-scheduling build runs no slower (``config.ROUTE_PLAN_KINDS``): launches of
    #: this plan take that route (``unit_schedule_route.UnitScheduleRoute``: the build reads the call's index tensors,
    #: so it stays correct for whatever batch of the same size and pool ``refresh`` copies in, and the lists above go
    #: unused; another batch size or pool launches the lists). Its scratch is per stream, made for the planning
    #: stream with the plan and for any other at its first launch there: make that launch outside a graph capture
    route: object = field(default=None, repr=False, compare=False)

    @property
    def may_merge(self) -> bool:
        """Whether a combine launch may have merges to fold (device-planned lists: unknown on the host)."""
        return self.plan.num_merges > 0 if self.plan is not None else self.merges.shape[0] > 0

    def scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(partial_out, partial_lse, merge_counters)`` for a launch on the current CUDA stream."""
        device = self.partial_out.device
        handle = _current_stream(device)
        scratch = self.stream_scratch.get(handle)
        if scratch is None:
            if not self.stream_scratch:
                scratch = (self.partial_out, self.partial_lse, self.merge_counters)
            else:  # counters start at zero, as the kernels leave them after every launch
                scratch = allocate_outside_graph_pools(device, lambda: (  # kept with the plan: not in a graph's pool
                    torch.empty_like(self.partial_out), torch.empty_like(self.partial_lse),
                    torch.zeros_like(self.merge_counters)))
            self.stream_scratch[handle] = scratch
        return scratch

    @staticmethod
    def allocate(config: PagedAttentionConfig, capacity: PlanCapacity, num_ctas: int, device) -> "DevicePlan":
        slots = max(capacity.max_partials, 1)

        def ints(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return DevicePlan(
            config=config, plan=None,
            work_indptr=ints(num_ctas + 1), items=ints(capacity.max_items, len(ItemField)),
            merge_indptr=ints(capacity.max_merges + 1), merges=ints(capacity.max_merges, len(MergeField)),
            partial_out=torch.empty(slots, config.tile_q_rows, config.head_dim_v,
                                    dtype=torch.bfloat16 if config.bf16_partials else torch.float32, device=device),
            partial_lse=torch.empty(slots, config.tile_q_rows, dtype=torch.float32, device=device),
            merge_counters=ints(max(capacity.max_merges, 1)),
        )

    def refresh(self, plan: WorkPlan) -> None:
        """Copy ``plan`` into these buffers in place (its capacity and CTA count must match them; a plan of a
        cluster-merge config must keep the cluster shape, ``plan_clusters.py``, unless its kernel checks the shape
        itself: ``cluster_merge_flags``)."""
        if self.config.cluster_merge and not self.config.cluster_merge_flags:
            from .plan_clusters import cluster_merge_size

            if cluster_merge_size(plan) != self.config.cluster_merge:
                raise ValueError(f"plan: this DevicePlan's kernel folds merges in clusters of "
                                 f"{self.config.cluster_merge} CTAs, and the new plan's merges do not each fill one "
                                 "(plan_clusters.cluster_merge_size): make a new plan with plan_*")
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


def _current_stream(device: torch.device) -> int:
    """The current CUDA stream's handle on ``device`` (0 off CUDA); ~0.2 us, it runs once per launch."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------------------------------------
# Plan cache (the second level: a fast-path miss with the same index tensors still skips planning)
# ---------------------------------------------------------------------------------------------
class _PlanCache:
    """Last few plans, keyed by (kernel config, index tensors' identity/shape/version)."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    @staticmethod
    def _key(config, tensors):
        # identity + shape + version counter; a tensor on another device is another object (another id).
        # The data pointer too: `.data = other` (and storage resizes) swap the values but keep the version.
        return (config,) + tuple((id(t), t.shape, t._version, t.data_ptr()) for t in tensors)

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


# ---------------------------------------------------------------------------------------------
# Fast path: a repeated call costs one dict lookup and one metadata compare
# ---------------------------------------------------------------------------------------------
# What the rules read from each tensor, bar index values; by value, not identity, where no rule reads the
# values: an engine's per-layer K/V caches and fresh q/output tensors then share one entry.
#   dense (contiguous) tensors: class, shape, contiguity, dtype, device
#   paged caches: class, shape, strides, dtype, device, base alignment (16 bytes for TMA)
#   index tensors: as dense, plus data pointer and version counter (their identity is in the key). In-place
#   writes and resize_/set_/as_strided_ bump _version; `.data = x` and storage resizes do not but move the
#   pointer (swap_tensors refuses weakly referenced tensors).
# Unrolled per entry: a loop or comprehension per tensor costs ~0.8 us more per call. A non-tensor argument
# raises AttributeError in them: the caller then takes the full path, whose rules name it.
def _signature(spec, args: tuple, output, lse) -> tuple:
    """The metadata a fast-path hit must match: the entry's arguments', then the outputs' (as dense)."""
    sig = spec.signature(*args)
    if output is None:
        return sig
    # output is q itself (the likeliest alias; the full rules check every overlap) makes its own entry
    return sig + (output.__class__, output.shape, output.is_contiguous(), output.dtype, output.device,
                  lse.__class__, lse.shape, lse.is_contiguous(), lse.dtype, lse.device,
                  output.data_ptr() == args[0].data_ptr())


class _Hit:
    """One validated call shape: what a repeat of it needs, all resolved on the full path."""

    __slots__ = ("sig", "index_state", "config", "device_plan", "launcher", "alloc", "route")

    def __init__(self, config, device_plan, launcher, alloc, route=None):
        self.sig = self.index_state = None  # set when it is remembered
        self.config, self.device_plan, self.launcher, self.alloc = config, device_plan, launcher, alloc
        # device_planning.DevicePlanRoute (plan on the GPU before every launch) or unit_schedule_route.UnitScheduleRoute
        # (the self-scheduling build: the default call's, or a host plan's: DevicePlan.route)
        self.route = route


class _FastPath:
    """``(entry, index tensors' ids, plan id, options, sm_scale) -> [_Hit, ...]`` (newest first).

    A key's ids are trusted only through weakrefs (a dead tensor's id can be reused): the weakrefs'
    callbacks drop the key when an index tensor or the plan dies, which also frees the cached plan's
    GPU buffers promptly, and a lookup re-checks ``ref() is tensor``. A key keeps a few hits so layers
    of different shapes (hence configs) that share one batch's index tensors do not evict each other.
    """

    def __init__(self, size: int = 16, hits_per_key: int = 4):
        self.size = size
        self.hits_per_key = hits_per_key
        self.entries: dict = {}  # key -> (index weakrefs, plan weakref | None, [_Hit])

    def lookup(self, key, sig, index: tuple, plan) -> _Hit | None:
        slot = self.entries.get(key)
        if slot is None:
            return None
        refs, plan_ref, hits = slot
        for ref, t in zip(refs, index):
            if ref() is not t:
                return None
        if plan is not None and plan_ref() is not plan:
            return None
        for hit in hits:
            if hit.sig == sig:
                # an explicit plan is the caller's object: its config field is checked, not trusted
                return hit if plan is None or plan.config is hit.config else None
        return None

    def insert(self, key, index: tuple, plan, hit: _Hit) -> None:
        slot = self.entries.pop(key, None)
        if slot is not None and all(r() is t for r, t in zip(slot[0], index)) \
                and (plan is None or slot[1]() is plan):
            refs, plan_ref, old = slot
        else:
            entries = self.entries

            def evict(_ref, key=key):
                entries.pop(key, None)

            refs = tuple(weakref.ref(t, evict) for t in index)
            plan_ref = None if plan is None else weakref.ref(plan, evict)
            old = []
        # older index states (another version or pointer) cannot come back: drop them and their plans
        hit.index_state = tuple((t.data_ptr(), t._version) for t in index)
        keep = [h for h in old if h.index_state == hit.index_state and h.sig != hit.sig][: self.hits_per_key - 1]
        self.entries[key] = (refs, plan_ref, [hit, *keep])
        while len(self.entries) > self.size:
            del self.entries[next(iter(self.entries))]


_FAST = _FastPath()


def _keep_for_graphs(route) -> None:
    if all(r is not route for r in _CAPTURED_ROUTES):
        _CAPTURED_ROUTES.append(route)


def clear_plan_cache() -> None:
    """Forget cached plans and fast-path entries (the next call validates and plans in full). The buffers of routes
    that a CUDA graph captured stay allocated: the graph replays on them."""
    _PLANS.entries.clear()
    _FAST.entries.clear()
    _DEVICE_ROUTES.clear()


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


def _checked_config(spec, args: tuple, output, lse, arch: str | None):
    """``(problem, config)`` after the kind's shape rules, the device rule and the kernel's rules; the index values
    are read here only when they live on the host (free to read there: a bad one is named before the device rule)."""
    problem, _ = spec.check(*args, output, lse, check_indices=False)
    if problem.device.type != "cuda":
        spec.check(*args, output, lse, check_indices=True)
    _require_cuda(problem.device)
    return problem, _make_config(spec, problem, arch)


def _make_config(spec, problem: validate.PagedProblem, arch: str | None) -> PagedAttentionConfig:
    arch = _target_arch(arch, problem.device)
    config = _config_for(spec, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk, problem.head_dim_v,
                         problem.page_size, arch)
    if spec.workload_tiles is None:
        return config
    knobs = spec.workload_tiles(config, problem)  # what the batch's shapes change (usually nothing)
    if not knobs:
        return config
    return _config_for(spec, problem.num_qo_heads, problem.num_kv_heads, problem.head_dim_qk, problem.head_dim_v,
                       problem.page_size, arch, tuple(sorted(knobs.items())))


@functools.lru_cache(maxsize=256)  # host overhead: one config per problem shape, built once
def _config_for(spec, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size, arch, workload_knobs=()):
    config = default_paged_config(
        spec.name, arch=arch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, page_size=page_size, causal=spec.causal, spec=spec,
    )
    if workload_knobs:
        config = dataclasses.replace(config, **dict(workload_knobs))
    reason = config.can_implement()
    if reason is not None:
        raise ValueError(f"{spec.name}: unsupported configuration: {reason}")
    return config


def _plan(spec, config, host: validate.HostIndices, device, num_sms, problem=None) -> DevicePlan:
    """The host plan; given the ``problem``, it may launch the self-scheduling build instead (:func:`_plan_route`)."""
    q_lens = np.diff(host.qo_indptr)
    plan_config = config.plan_config(_num_ctas(config, device, num_sms))
    plan = plan_work(plan_config, q_lens, host.kv_lens)
    route = None if problem is None else _plan_route(spec, config, problem, plan_config, plan, q_lens, host.kv_lens)
    if spec.plan_tiles is not None and (knobs := spec.plan_tiles(config, plan, device)):
        config = _with_plan_knobs(config, tuple(sorted(knobs.items())))
    device_plan = DevicePlan.upload(config, plan, device)
    device_plan.route = route
    return device_plan


def _plan_route(spec, config, problem, plan_config, plan: WorkPlan, q_lens, kv_lens):
    """The self-scheduling route for a host plan of ``config.ROUTE_PLAN_KINDS``, where the default call would take
    it and the cost model says it runs the batch no slower than ``plan`` (``plan_units.self_schedule_wins``); else
    None."""
    if config.kind not in config_policies.ROUTE_PLAN_KINDS:
        return None
    if not _takes_self_schedule(spec, config, problem, plan_config.num_ctas):
        return None
    from .plan_units import self_schedule_wins
    from .unit_schedule_route import UnitScheduleRoute

    route_config = _self_schedule_config(spec, config, problem, plan_config.num_ctas)
    if not self_schedule_wins(plan_config, q_lens, kv_lens, int(plan.cta_cost.max()), route_config.late_claim,
                              config_policies.ROUTE_PLAN_MIN_UNITS_PER_CTA, config_policies.ROUTE_PLAN_MAX_UNITS,
                              route_config.rank_major_units):
        return None
    route = UnitScheduleRoute.resolve(spec, route_config, problem, plan_config.num_ctas)
    if problem.device.type == "cuda":  # a plan is made outside any capture (it reads the lengths on the host)
        route.stream_scratch(_current_stream(problem.device), problem.device)
    return route


def _self_schedule_config(spec, config: PagedAttentionConfig, problem=None, num_ctas: int = 1
                          ) -> PagedAttentionConfig:
    """The self-scheduling build of ``config``: its spec's knobs (``OpSpec.self_schedule_knobs``; a line build's
    page-id scan by ``problem``'s ids a CTA, ``config.line_scan_ids``), else ``dynamic_schedule`` with its kind's
    late claim (``config.LATE_CLAIM_KINDS``)."""
    if spec.self_schedule_knobs is not None:
        knobs = dict(spec.self_schedule_knobs)
        if knobs.get("line_schedule"):
            page_ids = 0 if problem is None else problem.num_kv_slots // problem.page_size
            knobs["scan_ids_per_thread"] = config_policies.line_scan_ids(page_ids, num_ctas)
            knobs["uniform_line"] = config.kind in config_policies.LINE_UNIFORM_KINDS
        return _with_plan_knobs(config, tuple(sorted(knobs.items())))
    late = config.kind in config_policies.LATE_CLAIM_KINDS
    rank = config_policies.RANK_MAJOR_MAX_UNITS_PER_CTA if config.kind in config_policies.RANK_MAJOR_KINDS else 0
    return _with_plan_knobs(config, (("dynamic_schedule", True), ("late_claim", late), ("rank_major_units", rank)))


#: config knobs a plan may set (``OpSpec.plan_tiles``, ``OpSpec.device_plan_tiles``), and their values in the shapes'
#: config
PLAN_KNOBS = {"cluster_merge": 0, "cluster_merge_flags": False}


def _device_plan_config(spec, config: PagedAttentionConfig, device, num_ctas: int) -> PagedAttentionConfig:
    """``config`` with what a device plan changes in it (``OpSpec.device_plan_tiles``), else ``config``."""
    if spec.device_plan_tiles is None or not (knobs := spec.device_plan_tiles(config, device, num_ctas)):
        return config
    return _with_plan_knobs(config, tuple(sorted(knobs.items())))


@functools.lru_cache(maxsize=64)
def _with_plan_knobs(config: PagedAttentionConfig, knobs: tuple) -> PagedAttentionConfig:
    planned = dataclasses.replace(config, **dict(knobs))
    reason = planned.can_implement()
    if reason is not None:
        raise ValueError(f"{config.kind}: unsupported configuration for this plan: {reason}")
    return planned


def _shapes_config(config: PagedAttentionConfig) -> PagedAttentionConfig:
    """``config`` without what a host plan set in it (:data:`PLAN_KNOBS`): the config the inputs' shapes give."""
    if all(getattr(config, name) == value for name, value in PLAN_KNOBS.items()):
        return config
    return dataclasses.replace(config, **PLAN_KNOBS)


_DEVICE_ROUTES: dict = {}  # device-planned call shapes: key -> _Hit (no index tensor identity in the key)
#: routes that launched inside a CUDA-graph capture: a graph replays on their buffers (plan slots, unit counters), so
#: they outlive the lookup above (bounded at 64 shapes, cleared by clear_plan_cache) for as long as the process runs
_CAPTURED_ROUTES: list = []


def _device_signature(args: tuple, output, lse) -> tuple:
    """Metadata of every tensor argument: a device-planned call never reads index values on the host, so new
    index tensors of the same shape hit (the cold call of an engine step, or FlashInfer-Bench's cloned inputs)."""
    sig = tuple(None if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15,
                                        t.is_contiguous())
                for t in args[:-1])  # None: an optional index tensor left out (MLA at page size 1)
    if output is None:
        return sig
    return sig + (output.__class__, output.shape, output.is_contiguous(), output.dtype, output.device,
                  lse.__class__, lse.shape, lse.is_contiguous(), lse.dtype, lse.device,
                  output.data_ptr() == args[0].data_ptr())


def _run_device(spec, args: tuple, output, lse, natural_lse, arch, num_sms):
    """The default path (no plan, ``check_indices=False``): plan on the GPU, then launch; no host sync."""
    sm_scale = args[-1]
    key = None
    if sm_scale.__class__ is float and natural_lse.__class__ is bool:
        try:
            key = (spec, output is None, lse is None, natural_lse, arch, num_sms, sm_scale,
                   _device_signature(args, output, lse))
            hit = _DEVICE_ROUTES.get(key)
        except Exception:  # junk where a tensor goes: the full rules name it
            key = hit = None
        if hit is not None:
            return _launch(hit, None, args, output, lse, natural_lse)
    hit = _device_route(spec, args, output, lse, natural_lse, arch, num_sms)
    out = _launch(hit, None, args, output, lse, natural_lse)
    if key is not None:
        if len(_DEVICE_ROUTES) >= 64:
            _DEVICE_ROUTES.clear()
        _DEVICE_ROUTES[key] = hit
    return out


def _device_route(spec, args, output, lse, natural_lse, arch, num_sms) -> _Hit:
    from .device_planning import DevicePlanRoute

    validate.check_flag("natural_lse", natural_lse)
    problem, config = _checked_config(spec, args, output, lse, arch)
    launcher = find_launcher(config)
    if launcher is None:
        raise NotImplementedError(f"no {config.arch} kernel for {config.kind} is implemented yet in this version of "
                                  "cute_attn")
    num_ctas = _num_ctas(config, problem.device, num_sms)
    alloc = (problem.total_q, problem.num_qo_heads, problem.head_dim_v, problem.device)
    if _takes_self_schedule(spec, config, problem, num_ctas):
        from .unit_schedule_route import UnitScheduleRoute

        config = _self_schedule_config(spec, config, problem, num_ctas)
        return _Hit(config, None, launcher, alloc, UnitScheduleRoute.resolve(spec, config, problem, num_ctas))
    config = _device_plan_config(spec, config, problem.device, num_ctas)
    route = DevicePlanRoute.resolve(spec, config, problem, num_ctas)
    return _Hit(config, None, launcher, alloc, route)


def run(spec, args: tuple, index: tuple, output, lse, plan, check_indices, natural_lse, arch, num_sms):
    """The fast path; on a miss, :func:`_run_full`, whose successful calls it remembers. Without a plan and
    with ``check_indices=False`` (the default), :func:`_run_device`: planned and checked on the GPU."""
    if plan is None and check_indices is False:
        return _run_device(spec, args, output, lse, natural_lse, arch, num_sms)
    key = None
    sm_scale = args[-1]
    # not bool/int/numpy for sm_scale, nor 1/'no' for the flags: those equal a float or a bool in a key
    if sm_scale.__class__ is float and natural_lse.__class__ is bool and check_indices.__class__ is bool:
        try:
            key = (spec, *map(id, index), plan if plan is None else id(plan),
                   plan is not None and check_indices, output is None, lse is None, natural_lse, arch, num_sms,
                   sm_scale)
            sig = _signature(spec, args, output, lse)  # the function the contract tests check, not a copy
            hit = _FAST.lookup(key, sig, index, plan)
        except Exception:  # junk where a tensor or option goes: the full rules name it
            key = hit = None
        if hit is not None:
            return _launch(hit, plan, args, output, lse, natural_lse)
    hit = _run_full(spec, args, index, output, lse, plan, check_indices, natural_lse, arch, num_sms)
    out = _launch(hit, plan, args, output, lse, natural_lse)
    if key is not None:  # remembered only once it has launched: a failing call is re-checked in full
        hit.sig = sig
        try:
            _FAST.insert(key, index, plan, hit)
        except TypeError:  # a plan object without weakref support: no fast path for it
            pass
    return out


def _run_full(spec, args, index, output, lse, plan, check_indices, natural_lse, arch, num_sms) -> _Hit:
    """Every rule, then the config and the plan (cached or the caller's): what a fast-path hit reuses."""
    validate.check_flag("natural_lse", natural_lse)
    validate.check_flag("check_indices", check_indices)
    if plan is not None and not isinstance(plan, DevicePlan):
        raise TypeError(f"plan must be a DevicePlan (from plan_{spec.name}), got {type(plan).__name__}")
    problem, config = _checked_config(spec, args, output, lse, arch)
    if plan is None:
        # the value rules also read the page count and total_q: a smaller cache makes old page ids invalid
        plan_key = (config, num_sms, problem.num_pages, problem.total_q)
        # inference tensors (torch.inference_mode) keep no version counter, so nothing proves that their
        # values are the ones a cached plan was made from: they plan every call
        cacheable = not any(t.is_inference() for t in index)
        device_plan = _PLANS.get(plan_key, index) if cacheable else None
        if device_plan is None:  # planning reads the index values anyway, so they are always checked here
            _, host = spec.check(*args, output, lse, check_indices=True)
            _raise_device_errors(problem.device)
            device_plan = _plan(spec, config, host, problem.device, num_sms, problem)
            if cacheable:
                _PLANS.put(plan_key, index, device_plan)
        # a hit: the same, unmodified index tensors as when this plan was made and checked
    else:
        if _shapes_config(plan.config) != config:
            raise ValueError(f"plan was made for {plan.config.cache_key()}, these inputs need {config.cache_key()}")
        if plan.items.device != problem.device:
            raise ValueError(f"plan lives on {plan.items.device}, the inputs on {problem.device}: make the plan "
                             "with these inputs (plan_*) or DevicePlan.allocate on their device")
        if check_indices:
            spec.check(*args, output, lse, check_indices=True)
        config = plan.config  # equal to ours; a hit checks the plan still holds this very object
        device_plan = None  # the caller's, passed at every launch; the fast path must not keep it alive
    launcher = find_launcher(config)
    if launcher is None:
        planned = (device_plan or plan).plan
        raise NotImplementedError(
            f"no {config.arch} kernel for {config.kind} is implemented yet in this version of cute_attn "
            f"(inputs validated and planned: {planned.num_items} work items)"
        )
    alloc = (problem.total_q, problem.num_qo_heads, problem.head_dim_v, problem.device)
    route = (device_plan or plan).route
    if route is not None and (route.batch, route.num_pages) != (problem.batch_size, problem.num_pages):
        route = None  # a plan refreshed for another batch, or a pool of another size: its lists, as any plan's
    return _Hit(config, device_plan, launcher, alloc, route)


def _launch(hit: _Hit, plan, args, output, lse, natural_lse):
    if output is None:
        total_q, heads, head_dim_v, device = hit.alloc
        output = torch.empty(total_q, heads, head_dim_v, dtype=torch.bfloat16, device=device)
        lse = torch.empty(total_q, heads, dtype=torch.float32, device=device)
    route = hit.route
    if route is not None:  # planner + attention (+ combine) in one host call (kernels/common/launch_chain.py)
        device = hit.alloc[3]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _keep_for_graphs(route)
        if route.schedules_itself:  # index checks + a self-scheduling kernel (unit_schedule_route.py)
            route.launch(args, output, lse, natural_lse, _current_stream(device), device)
            return output, lse
        plan = route.slot(hit.config, _current_stream(device), device)
        hit.launcher(plan, *args, output, lse, natural_lse=natural_lse, planned=route.planned(plan, args, output, lse))
        return output, lse
    hit.launcher(hit.device_plan if plan is None else plan, *args, output, lse, natural_lse=natural_lse)
    return output, lse


def plan_for(spec, args: tuple, *, arch: str | None, num_sms: int | None, on_device: bool = False,
             into: DevicePlan | None = None, recycle: DevicePlan | None = None) -> DevicePlan:
    """``plan_<kind>``: every rule (index values included), the config (its kernel's rules), then the plan.

    ``on_device=True``: the shape rules only, then the device planner fills a new DevicePlan in the current stream
    (no host sync; index faults go to the device error word, and a broken indptr leaves an empty plan, so the
    outputs of the launches that use it are not written: check :func:`cute_attn.raise_on_device_error`).
    ``into``: a DevicePlan an earlier ``on_device`` call of the same shapes made, planned again in place (its
    buffers are what captured launches read: the FlashInfer-compatible wrappers' graph mode re-plans at every
    ``plan()``); a plan of other shapes is a ValueError. ``recycle``: the same when it fits these shapes, else a new
    plan (the wrappers' eager steps: the previous batch's plan, whose launches are earlier in the stream)."""
    validate.check_flag("on_device", on_device)
    if (into is not None or recycle is not None) and not on_device:
        raise ValueError("into= and recycle= refill a device plan: pass on_device=True")
    if on_device:
        from .device_planning import DevicePlanRoute, allocate_planned, planner_fits

        problem, config = _checked_config(spec, args, None, None, arch)
        num_ctas = _num_ctas(config, problem.device, num_sms)
        config = _device_plan_config(spec, config, problem.device, num_ctas)
        route = DevicePlanRoute.resolve(spec, config, problem, num_ctas)
        def fits(plan) -> bool:
            return (isinstance(plan, DevicePlan) and plan.config == config and planner_fits(plan, route)
                    and plan.items.device == problem.device)

        if into is not None and not fits(into):
            raise ValueError(f"into must be a DevicePlan that plan_{spec.name}(..., on_device=True) made for inputs "
                             "of these shapes")
        plan = into if into is not None else recycle if recycle is not None and fits(recycle) else None
        if plan is None:
            plan = allocate_planned(config, route.capacity, route.num_ctas, route.batch, problem.device,
                                    route.writers)
        no_rows = torch.empty(0, config.num_qo_heads, config.head_dim_v, dtype=torch.bfloat16, device=problem.device)
        route.plan(plan, args, no_rows, torch.empty(0, config.num_qo_heads, device=problem.device))
        return plan
    problem, host = spec.check(*args, check_indices=True)
    _raise_device_errors(problem.device)
    config = _make_config(spec, problem, arch)
    return _plan(spec, config, host, problem.device, num_sms, problem)


def self_schedules(spec, args: tuple, *, arch: str | None = None, num_sms: int | None = None,
                   reused: bool = False) -> bool:
    """Whether the default call of ``spec`` on ``args`` (outputs omitted) takes the planner-free route
    (``OpSpec.self_schedule``: from shapes alone; the shape rules run first). A caller that plans once per batch
    (the FlashInfer-compatible wrappers, ``reused=True``: the batch runs once a layer) leaves such batches to the
    default call where the route is no slower run after run (``OpSpec.self_schedule_when_reused``): it needs no
    plan."""
    if spec.self_schedule is None or (spec.self_schedule_policy is not None and not spec.self_schedule_policy()):
        return False  # the policy is off: no config to make (the wrappers ask once per batch)
    if reused and not spec.self_schedule_when_reused:
        return False  # a plan made once and reused is cheaper than the route's work at every call
    problem, config = _checked_config(spec, args, None, None, arch)
    return _takes_self_schedule(spec, config, problem, _num_ctas(config, problem.device, num_sms))


def _takes_self_schedule(spec, config, problem, num_ctas: int) -> bool:
    """The default call's choice of the planner-free route (``OpSpec.self_schedule``), in :func:`_device_route`
    and :func:`self_schedules` alike."""
    return spec.self_schedule is not None and bool(spec.self_schedule(config, problem, num_ctas))


def _raise_device_errors(device) -> None:
    """Host-synchronising calls report what earlier device-planned calls found (cute_attn.raise_on_device_error)."""
    if device.type == "cuda":
        from .device_errors import raise_on_device_error

        raise_on_device_error(device)
