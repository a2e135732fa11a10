"""One spec per op kind: everything a kind means, in one module (``ops/<kind>.py``).

A spec holds the kind's argument order, its validation rules, the fast path's metadata signature, its
float32 reference, its test case builder and hypothesis strategy, its default-config policy (tiles, page-size
handling) and the kernel module that serves it on each arch. ``api.py`` dispatches on specs generically:
``spec.check`` -> config (``spec.default_tiles`` + ``config.can_implement()``, which asks the kernel
registered for (kind, arch) before any planning) -> plan (cached) -> launch. The public entry of a kind lives
in its spec module, beside its rules.

Adding a kind: write ``ops/<kind>.py`` with its ``SPEC = OpSpec(...)``, its entry and ``plan_<kind>``, list the
module in ``SPEC_MODULES`` below, and register its kernels (``kernels.register_paged_kernel``) in the modules
``SPEC.kernel_modules`` names. Nothing else dispatches on the kind's name. A kind whose best knobs depend on the
batch (not only on the head layout) says so in ``workload_tiles``, from tensor shapes alone (MLA prefill picks its
consumer split by the mean keys an item).

An entry that is another kind with fixed arguments holds no spec: ``mla_decode.py`` is MLA prefill with one query
per request (it builds the ``qo_indptr`` and calls ``api.run`` with the MLA prefill spec).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

@contextlib.contextmanager
def policy(namespace: dict, **values):
    """A spec module's policy globals (``namespace``: its ``globals()``) set to ``values`` inside the block; the
    per-shape config and plan caches are cleared on the way in and out, so nothing built under the other policy is
    reused (A/Bs, the GPU tiers' fixtures, sanitizer cases)."""
    from .. import api

    saved = {name: namespace[name] for name in values}
    namespace.update(values)
    api._config_for.cache_clear()
    api.clear_plan_cache()
    try:
        yield
    finally:
        namespace.update(saved)
        api._config_for.cache_clear()
        api.clear_plan_cache()


#: spec modules, in the order kinds are listed (a new kind adds its module here)
SPEC_MODULES = ("gqa_prefill", "gqa_decode", "mla_prefill", "gqa_multi_token_decode")


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, a cheap fast-path key
class OpSpec:
    """What one op kind means (see the module docstring)."""

    name: str  # the kind, e.g. "gqa_paged_decode"; also PagedAttentionConfig.kind
    arg_names: tuple[str, ...]  # the definition's inputs in order (sm_scale last), then output, lse
    index_names: tuple[str, ...]  # the index tensors among them: plans are cached on their identity
    causal: bool  # the definition's mask
    #: (*inputs, output, lse, check_indices) -> (validate.PagedProblem, validate.HostIndices | None)
    check: Callable
    #: (*inputs) -> tuple: the metadata the rules read (api's fast path compares it, never the values)
    signature: Callable
    #: (*inputs) -> (output, lse): the float32 reference (bf16 output, fp32 base-2 lse)
    reference: Callable
    #: (**case parameters) -> a testing case (shuffled, NaN-poisoned pool)
    make_case: Callable
    #: () -> hypothesis strategy of make_case keyword arguments (lengths; shapes as the kind allows)
    strategy: Callable
    #: (arch, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_v, page_size) -> PagedAttentionConfig knobs
    default_tiles: Callable
    #: config -> reason | None: the kind's own shape rules (every kernel of the kind starts from them)
    shape_reason: Callable
    #: (config, problem) -> {knob: value}: what the batch's shapes change in the shape's config
    #: (``validate.PagedProblem``: batch, total_q, num_kv_slots; never an index value, so no host sync and the same
    #: choice inside a CUDA graph); an empty dict or None keeps the config
    workload_tiles: Callable | None = None
    #: (config, plan, device) -> {knob: value}: what a host plan's shape changes in its config (``plan_clusters``: a plan
    #: whose merges each fill a thread-block cluster); the DevicePlan then carries that config. Host plans only:
    #: device plans (the default call) keep the shapes' config. None or an empty dict keeps the config
    plan_tiles: Callable | None = None
    #: (config, device, num_ctas) -> {knob: value}: what a device plan (the default call, ``plan_*(on_device=True)``)
    #: changes in its config, knowing only the device and the grid (``ops/mla_decode.device_cluster_tiles``: clusters
    #: of 2 that check the plan's shape at run time). None or an empty dict keeps the config
    device_plan_tiles: Callable | None = None
    #: (config, problem, num_ctas) -> bool: whether the default call (no plan) runs this config's self-scheduling build
    #: (``PagedAttentionConfig.dynamic_schedule``: index checks, then CTAs taking units from a counter; no planner, no
    #: combine; :mod:`cute_attn.unit_schedule_route`) instead of planning on the device. Shapes only, as
    #: ``workload_tiles``. None: never
    self_schedule: Callable | None = None
    #: the knobs that make a config its self-scheduling build (None: ``dynamic_schedule`` with the kind's late claim,
    #: the prefills'; decode: ``line_schedule``)
    self_schedule_knobs: dict | None = None
    #: () -> bool: whether the kind's policy lets ``self_schedule`` route at all, asked before any config is made
    #: (:func:`cute_attn.api.self_schedules`; None: ``self_schedule`` alone decides)
    self_schedule_policy: Callable | None = None
    #: whether a batch run many times on one plan (the FlashInfer-compatible wrappers' layers, ``flashinfer/step_plan``)
    #: takes the self-scheduling route too: yes for the planner-free prefills (no slower than their plan's launches
    #: where they route); no for the decode line builds, which derive their stretch at every call (H200 session 39:
    #: h20/kv4 64 x 2048 default 79.2 against 75.5 us on a reused device plan), so one plan a step costs less from the
    #: third layer on
    self_schedule_when_reused: bool = True
    #: arch -> module that registers this kind's kernel for it, relative to the package (``.kernels.sm90.x``), so a
    #: copy of cute_attn shipped inside another package (FlashInfer-Bench's builder) loads its own kernels
    kernel_modules: dict[str, str] = field(default_factory=dict)


def shapes_promise_units(config, problem, num_ctas: int, min_units_per_cta: int, archs=("sm_90a",)) -> bool:
    """``OpSpec.self_schedule``'s shared rule: a causal config of an arch in ``archs`` whose self-scheduling build
    exists, and a batch whose shapes promise at least ``min_units_per_cta`` units a CTA (``ceil(total_q * group /
    rows) * kv_heads``, a lower bound of its units: fewer units leave CTAs idle, where the device planner's splits
    fill the grid)."""
    if config.arch not in archs or not config.causal:
        return False
    min_units = -(-problem.total_q * config.group_size // config.packed_rows_per_tile) * config.num_kv_heads
    if min_units < min_units_per_cta * num_ctas:
        return False
    return dataclasses.replace(config, dynamic_schedule=True).can_implement() is None


_SPECS: dict[str, OpSpec] = {}


def _load() -> dict[str, OpSpec]:
    if not _SPECS:
        for module in SPEC_MODULES:
            spec = importlib.import_module(f"{__name__}.{module}").SPEC
            _SPECS[spec.name] = spec
    return _SPECS


def get_spec(kind: str) -> OpSpec:
    """The spec of ``kind``; ValueError naming the kinds there are."""
    specs = _load()
    spec = specs.get(kind)
    if spec is None:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(specs)}")
    return spec


def kinds() -> tuple[str, ...]:
    """Every op kind, in SPEC_MODULES order."""
    return tuple(_load())
