"""Host side shared by the paged kernels (both arches): GQA fake compile arguments and the launch.

Every GQA paged kernel's ``@cute.jit`` entry takes the same arguments, in this order::

    q, k_cache, v_cache, [qo_indptr, [kv_indptr,]] kv_indices, work_indptr, items,
    [merge_indptr, merge_counters,] output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream

(``qo_indptr`` and ``kv_indptr`` for prefill; ``qo_indptr`` alone for multi-token decode, whose packed rows
are tokens ``qo_indptr[b] + r // group``; neither for decode, whose token is its request; decode items carry
their ``kv_indices`` position (``ItemField.KV_PAGE_START``); ``merge_indptr``/``merge_counters`` only for
kernels that fold their own split-KV merges, i.e. decode: no combine launch follows them).
``scale_log2 = sm_scale * log2(e)``
so logits go straight into ``exp2``; ``lse_out_scale`` is 1 (base-2 LSE) or ``ln 2`` (natural LSE).
Batch, token, page, index and plan-capacity extents are symbolic, so one compile serves every batch.
K and V page strides are symbolic too (16-byte aligned), so strided views of one KV tensor work.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from ...compile import compile_kernel
from ...config import PagedAttentionConfig
from ...plan import ItemField
from .combine import CombineConfig, combine_arguments
from .launch_chain import LaunchChainConfig

LOG2_E = math.log2(math.e)
_BF16_PER_16_BYTES = 8


def paged_fake_args(config: PagedAttentionConfig, *, prefill_indptrs: bool, with_fused_merge: bool = False,
                    with_qo_indptr: bool = False) -> tuple:
    """Fake tensors (symbolic extents) for ``cute.compile``, in the entry's argument order (``with_qo_indptr``:
    ``qo_indptr`` without ``kv_indptr``, the multi-token decode kernels)."""
    bf16, i32, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Float32
    hq, hkv, d, dv, ps = (config.num_qo_heads, config.num_kv_heads, config.head_dim_qk, config.head_dim_v,
                          config.page_size)
    fake = cute.runtime.make_fake_compact_tensor
    rows = cute.sym_int(symbol="total_q")  # prefill: query tokens; decode: the batch
    num_pages = cute.sym_int(symbol="num_pages")
    slots = cute.sym_int(symbol="partial_slots")

    def cache(name: str, dim: int):
        stride = cute.sym_int64(divisibility=_BF16_PER_16_BYTES, symbol=f"{name}_page_stride")
        return cute.runtime.make_fake_tensor(bf16, (num_pages, ps, hkv, dim), stride=(stride, hkv * dim, dim, 1),
                                             assumed_align=16)

    indptrs = (fake(i32, (cute.sym_int(symbol="batch_plus_1"),)), fake(i32, (cute.sym_int(symbol="kv_indptr_len"),)))
    fused_merge = (fake(i32, (cute.sym_int(symbol="max_merges_plus_1"),)),
                   fake(i32, (cute.sym_int(symbol="merge_counters"),)))
    return (
        fake(bf16, (rows, hq, d), stride_order=(2, 1, 0), assumed_align=16),
        cache("k", d),
        cache("v", dv),
        *(indptrs if prefill_indptrs else indptrs[:1] if with_qo_indptr else ()),
        fake(i32, (cute.sym_int(symbol="num_indices"),)),
        fake(i32, (cute.sym_int(symbol="ctas_plus_1"),)),
        fake(i32, (cute.sym_int(symbol="max_items"), len(ItemField)), stride_order=(1, 0)),
        *(fused_merge if with_fused_merge else ()),
        fake(bf16, (rows, hq, dv), stride_order=(2, 1, 0), assumed_align=16),
        fake(f32, (rows, hq), stride_order=(1, 0)),
        fake(bf16 if config.bf16_partials else f32, (slots, config.tile_q_rows, dv), stride_order=(2, 1, 0),
             assumed_align=16),
        fake(f32, (slots, config.tile_q_rows), stride_order=(1, 0)),
        f32(1.0),
        f32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def dynamic_schedule_fake_args(config: PagedAttentionConfig) -> tuple:
    """Fake arguments of a self-scheduling prefill build's ``call_dynamic`` entry: ``q, k_cache, v_cache, qo_indptr,
    kv_indptr, kv_indices, kv_last_page_len, request_faults, unit_state, error_word, output, lse, scale_log2,
    lse_out_scale, num_pages, num_ctas, stream`` (no plan: ``kernels/common/unit_schedule.py``)."""
    from .unit_schedule import UNIT_STATE_WORDS

    base = paged_fake_args(config, prefill_indptrs=True)
    q, k, v, qo_indptr, kv_indptr, kv_indices = base[:6]
    output, lse, scale_log2, lse_out_scale, stream = base[8], base[9], base[12], base[13], base[14]
    fake = cute.runtime.make_fake_compact_tensor
    i32 = cutlass.Int32
    return (q, k, v, qo_indptr, kv_indptr, kv_indices, fake(i32, (cute.sym_int(symbol="batch"),)),
            fake(i32, (cute.sym_int(symbol="request_faults"),)), fake(i32, (UNIT_STATE_WORDS,)), fake(i32, (4,)),
            output, lse, scale_log2, lse_out_scale, i32(1), i32(1), stream)


def line_schedule_fake_args(config: PagedAttentionConfig) -> tuple:
    """Fake arguments of a ``line_schedule`` decode build's ``call_line`` entry: ``q, k_cache, v_cache, kv_indptr,
    kv_indices, kv_last_page_len, merge_counters, request_faults, unit_state, error_word, output, lse, partial_out,
    partial_lse, scale_log2, lse_out_scale, num_pages, num_ctas, stream`` (no plan:
    ``kernels/common/line_schedule.py``)."""
    from .unit_schedule import UNIT_STATE_WORDS

    base = paged_fake_args(config, prefill_indptrs=False)
    q, k, v, kv_indices = base[:4]
    *_, output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, stream = base
    fake = cute.runtime.make_fake_compact_tensor
    i32 = cutlass.Int32
    return (q, k, v, fake(i32, (cute.sym_int(symbol="batch_plus_1"),)), kv_indices,
            fake(i32, (cute.sym_int(symbol="batch"),)), fake(i32, (cute.sym_int(symbol="merge_counters"),)),
            fake(i32, (cute.sym_int(symbol="request_faults"),)), fake(i32, (UNIT_STATE_WORDS,)), fake(i32, (4,)),
            output, lse, partial_out, partial_lse, scale_log2, lse_out_scale, i32(1), i32(1), stream)


LN2 = math.log(2.0)  # lse_out_scale of a natural-log LSE

# id(config) -> (config, check_config, compile_kernel, fn): the kernel's rules and the compile-cache lookup
# run once per config, not per launch (hashing a config costs as much as the rest of the launch). The
# entry holds its config, so the id cannot be recycled; compile_kernel is compared so that a stand-in
# patched into this module (tests) is honoured.
_RESOLVED: dict[int, tuple] = {}


def _resolve(check_config, config: PagedAttentionConfig) -> tuple:
    reason = check_config(config)
    if reason is not None:
        raise ValueError(f"{config.kind} on {config.arch}: unsupported configuration: {reason}")
    resolved = (config, check_config, compile_kernel, compile_kernel(config))
    if len(_RESOLVED) >= 256:
        _RESOLVED.clear()
    _RESOLVED[id(config)] = resolved
    return resolved


def launch_paged(device_plan, check_config, inputs: tuple, sm_scale, output, lse, natural_lse: bool, *,
                 fused_merge: bool = False, planned=None) -> None:
    """Run the plan's work items with ``device_plan.config``'s kernel, then the combine if anything split.

    ``fused_merge``: the kernel folds its merges itself (it takes ``merge_indptr, merge_counters`` after
    ``items``; see ``DevicePlan.merge_counters``), so no combine launch follows.

    ``inputs`` are the kernel's leading tensor arguments in its order (GQA: ``q, k_cache, v_cache,
    [qo_indptr, kv_indptr,] kv_indices``; MLA: ``q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr,
    kv_indices``); the plan, output and scale arguments follow. ``check_config(config) -> reason | None`` is
    the kernel's own rule set. ``planned``: ``(route, planner arguments)`` from a device-planned route
    (``device_planning.DevicePlanRoute``): the planner, this kernel and the combine go out in one host call
    (``launch_chain.py``).
    """
    config = device_plan.config
    resolved = _RESOLVED.get(id(config))
    if resolved is None or resolved[0] is not config or resolved[1] is not check_config \
            or resolved[2] is not compile_kernel:
        resolved = _resolve(check_config, config)
    lse_out_scale = LN2 if natural_lse else 1.0
    partial_out, partial_lse, merge_counters = device_plan.scratch()  # this stream's (DevicePlan: streams)
    # the kernel counts its split items in their merges: it folds them itself (fused_merge), an eager combine does,
    # or (cluster_merge_flags) it flags the merges its clusters folded for the combine to skip
    merge_args = (device_plan.merge_indptr, merge_counters) \
        if fused_merge or config.eager_combine or config.cluster_merge_flags else ()
    args = (*inputs, device_plan.work_indptr, device_plan.items, *merge_args, output, lse, partial_out, partial_lse,
            float(sm_scale) * LOG2_E, lse_out_scale)
    # the combine goes out in the same host call as the attention kernel (launch_chain.py): from its own call it
    # reached the GPU ~10 us after a short attention kernel had ended
    folds_all = config.cluster_merge and not config.cluster_merge_flags  # a host plan of the cluster shape
    combine = () if fused_merge or folds_all or not device_plan.may_merge else combine_arguments(
        device_plan, output, lse, lse_out_scale, partial_out, partial_lse, merge_counters)
    if planned is not None:
        route, planner_args = planned
        route.chain(config, bool(combine))(*planner_args, *args, *combine)
    elif combine:
        _attend_then_combine(resolved)(*args, *combine)
    else:
        resolved[3](*args)


def _attend_then_combine(resolved: tuple):
    """The compiled attention + combine chain of a resolved config (looked up once per config, as ``_RESOLVED``)."""
    if len(resolved) == 4:
        config = resolved[0]
        chain = compile_kernel(LaunchChainConfig(arch=config.arch, stages=(config, CombineConfig.for_paged(config))))
        resolved = _RESOLVED[id(config)] = (*resolved, chain)
    return resolved[4]


# ----------------------------------------------------------------------------- per-kind entry points
# One (build, launch) pair per kernel kind, shared by the arch twins: the argument convention (which
# inputs, whether the merge is fused) is stated once here, so build's fake arguments and launch's real
# ones cannot drift apart between a kernel and its twin.
def checked_build(kernel_cls, check_config, config: PagedAttentionConfig, fake_args: tuple) -> tuple:
    """``(kernel object, fake_args)`` once ``check_config`` accepts ``config``; else ValueError with why."""
    reason = check_config(config)
    if reason is not None:
        raise ValueError(f"{config.cache_key()}: {reason}")
    return kernel_cls(config), fake_args


def gqa_prefill_entry(kernel_cls, check_config) -> tuple:
    """``(build, launch)`` of a GQA prefill kernel class (entry arguments with ``qo_indptr``; combine after, or with
    ``config.fused_merge`` the kernel's ``call_fused`` entry, which folds its merges itself)."""

    def build(config: PagedAttentionConfig) -> tuple:
        if config.dynamic_schedule:
            kernel, fake = checked_build(kernel_cls, check_config, config, dynamic_schedule_fake_args(config))
            return kernel.call_dynamic, fake
        fake = paged_fake_args(config, prefill_indptrs=True, with_fused_merge=config.fused_merge)
        kernel, fake = checked_build(kernel_cls, check_config, config, fake)
        return (kernel.call_fused if config.fused_merge else kernel), fake

    def launch(device_plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
               output, lse, natural_lse: bool = False, planned=None) -> None:
        """Run the plan's items (kv_last_page_len is already folded into their KV_END), then the combine (none
        with ``fused_merge``)."""
        launch_paged(device_plan, check_config, (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices), sm_scale,
                     output, lse, natural_lse, fused_merge=device_plan.config.fused_merge, planned=planned)

    return build, launch


def gqa_decode_entry(kernel_cls, check_config) -> tuple:
    """``(build, launch)`` of a GQA decode kernel class (no indptrs: the items carry their page positions;
    merges fold in-kernel)."""

    def build(config: PagedAttentionConfig) -> tuple:
        if config.line_schedule:
            kernel, fake = checked_build(kernel_cls, check_config, config, line_schedule_fake_args(config))
            return kernel.call_line, fake
        fake = paged_fake_args(config, prefill_indptrs=False, with_fused_merge=True)
        return checked_build(kernel_cls, check_config, config, fake)

    def launch(device_plan, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse,
               natural_lse: bool = False, planned=None) -> None:
        """Run the plan's items (kv_indptr and kv_last_page_len are already folded into their KV_PAGE_START
        and KV_END); merges fold in-kernel."""
        launch_paged(device_plan, check_config, (q, k_cache, v_cache, kv_indices), sm_scale,
                     output, lse, natural_lse, fused_merge=True, planned=planned)

    return build, launch



def gqa_multi_token_decode_entry(kernel_cls, check_config) -> tuple:
    """``(build, launch)`` of a multi-token GQA decode kernel class: the decode kernel with ``qo_indptr`` (packed
    row r of request b is token ``qo_indptr[b] + r // group``); merges fold in-kernel."""

    def build(config: PagedAttentionConfig) -> tuple:
        fake = paged_fake_args(config, prefill_indptrs=False, with_fused_merge=True, with_qo_indptr=True)
        return checked_build(kernel_cls, check_config, config, fake)

    def launch(device_plan, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
               output, lse, natural_lse: bool = False, planned=None) -> None:
        """Run the plan's items (kv_indptr and kv_last_page_len are already folded into their KV_PAGE_START and
        KV_END, the causal trim into KV_END and CAUSAL_OFFSET); merges fold in-kernel."""
        launch_paged(device_plan, check_config, (q, k_cache, v_cache, qo_indptr, kv_indices), sm_scale,
                     output, lse, natural_lse, fused_merge=True, planned=planned)

    return build, launch
