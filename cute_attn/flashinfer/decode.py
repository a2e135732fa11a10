"""``BatchDecodeWithPagedKVCacheWrapper`` with FlashInfer 0.7.x's constructor, ``plan`` and ``run``, on cute_attn.

Supported: NHD caches (a ``(k, v)`` tuple or one ``[pages, 2, page_size, heads, dim]`` tensor), bf16,
one query per request, no positional encoding / soft-cap / window, ``sm_scale`` (default
``1 / sqrt(head_dim)``), ``out=``, ``lse=``, ``return_lse``. LSE is base 2, as FlashInfer's.
Everything else that changes the attention raises ``NotImplementedError`` naming the argument.

Ignored, as they select among FlashInfer's own kernels or buffers: the workspace buffer (cute_attn
keeps its plans itself), ``use_tensor_cores``, ``backend``, ``enable_pdl``, ``non_blocking`` (only used for
the index copies), ``rope_scale`` / ``rope_theta`` (read only with RoPE, which is rejected).

Plans, as FlashInfer's: the first ``run()`` after a ``plan()`` launches cute_attn's device planner once (no host
sync) and every ``run()`` of the batch (each layer) uses that plan (``step_plan.py``), so layers pay no planner.

CUDA graphs (``use_cuda_graph=True``), as FlashInfer's: the constructor takes the three index buffers, whose
lengths fix the batch size and the page capacity; every ``plan()`` checks the new batch on the host and copies
it into them in place and re-plans on the GPU into the device plan the captured runs read, so a ``run()``
captured once replays any later plan's batch, with no planner in the graph. Make one ``run()`` before capturing
(it compiles, allocates and makes that device plan; a first ``run()`` inside a capture raises), as engines'
warm-up passes do. Engines that replace ``plan()`` with their own fast path into FlashInfer's internals (SGLang's
``fast_decode_plan``, vLLM's ``fast_plan_decode``) reach attributes these wrappers do not have: keep ``plan()``.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools

import importlib

# the package object, whatever its import name (an exported FlashInfer-Bench Solution ships a copy under
# another one); its public entry points are looked up at call time
_package = importlib.import_module(__package__.rpartition(".")[0])

from . import arguments as arg
from .indices import PagedKv, graph_buffer, paged_kv, refill
from .step_plan import StepPlan

__all__ = ["BatchDecodeWithPagedKVCacheWrapper"]

_WHERE = "BatchDecodeWithPagedKVCacheWrapper"


@dataclass(frozen=True)
class _DecodePlan:
    index: PagedKv
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float


class BatchDecodeWithPagedKVCacheWrapper:
    """Drop-in for ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (plan once per step, run every layer)."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend: str = "auto",
        jit_args=None,
    ) -> None:
        where = f"{_WHERE}()"
        self.device = arg.workspace_device(where, float_workspace_buffer)
        arg.check_kv_layout(where, kv_layout)
        arg.require_none(where, jit_args=jit_args)
        self._kv_layout = kv_layout
        self._use_tensor_cores = bool(use_tensor_cores)
        self._plan: _DecodePlan | None = None
        self._step = StepPlan(bool(use_cuda_graph))  # one device plan for every run() of a batch (step_plan.py)
        self._graph: PagedKv | None = None  # use_cuda_graph: the caller's buffers (kv_lens unused)
        if use_cuda_graph:
            last = graph_buffer(where, "paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer, self.device)
            self._graph = PagedKv(
                graph_buffer(where, "paged_kv_indptr_buffer", paged_kv_indptr_buffer, self.device, last.numel() + 1),
                graph_buffer(where, "paged_kv_indices_buffer", paged_kv_indices_buffer, self.device), last, None)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph is not None

    @property
    def use_tensor_cores(self) -> bool:
        # what the caller asked for, as FlashInfer reports it; cute_attn's kernels use tensor cores either way
        return self._use_tensor_cores

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        self.device = arg.workspace_device(f"{_WHERE}.reset_workspace_buffer()", float_workspace_buffer)

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        # FlashInfer 0.7 takes these through *deprecated_positional_args/**kwargs in this order
        # (decode.py: _BATCH_DECODE_PLAN_LEGACY_POS_ARGS); named here so they work both ways.
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking: bool = True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        *,
        window_right: int = 0,
        is_causal=None,
    ) -> None:
        """Check the batch's page table and options; each :meth:`run` plans on the GPU (see indices.py)."""
        where = f"{_WHERE}.plan()"
        self._plan = None  # a plan() that fails leaves no older batch behind for run() to use
        arg.require_value(where, "pos_encoding_mode", pos_encoding_mode, ("NONE",))
        arg.require_value(where, "window_left", window_left, (-1,))
        arg.require_value(where, "window_right", window_right, (0,))
        arg.require_no_soft_cap(where, logits_soft_cap)
        # FlashInfer: data_type fills whichever of q/kv data types is None (q's default is float16)
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        arg.bf16_dtype(where, "q_data_type", q_data_type)
        arg.bf16_dtype(where, "kv_data_type", q_data_type if kv_data_type is None else kv_data_type)
        if o_data_type is not None:
            arg.bf16_dtype(where, "o_data_type", o_data_type)
        arg.require_none(where, block_tables=block_tables, seq_lens=seq_lens)
        if fixed_split_size is not None:  # FlashInfer's "no fixed split" is None or -1 (vLLM passes -1)
            arg.require_value(where, "fixed_split_size", fixed_split_size, (-1,))
        arg.require_false(where, disable_split_kv=disable_split_kv)
        arg.require_value(where, "q_len_per_req", q_len_per_req, (1,))
        if is_causal is not None:
            arg.require_value(where, "is_causal", is_causal, (False,))  # one query: nothing to mask
        num_qo_heads = arg.count(where, "num_qo_heads", num_qo_heads)
        num_kv_heads = arg.count(where, "num_kv_heads", num_kv_heads)
        head_dim = arg.count(where, "head_dim", head_dim)
        page_size = arg.count(where, "page_size", page_size)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{where}: num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        scale = arg.resolve_sm_scale(where, sm_scale, head_dim)
        graph = self._graph
        index = paged_kv(where, indptr, indices, last_page_len, page_size, self.device, non_blocking,
                         names=("indptr", "indices", "last_page_len"))
        if graph is not None:  # into the captured buffers, in place
            pages = int(((index.kv_lens + page_size - 1) // page_size).sum())  # the ids the batch owns
            refill(where, [("indptr", index.kv_indptr, "paged_kv_indptr_buffer", graph.kv_indptr, True),
                           ("indices", index.kv_indices[:pages], "paged_kv_indices_buffer", graph.kv_indices,
                            False),
                           ("last_page_len", index.kv_last_page_len, "paged_kv_last_page_len_buffer",
                            graph.kv_last_page_len, True)], non_blocking)
            index = PagedKv(graph.kv_indptr, graph.kv_indices, graph.kv_last_page_len, index.kv_lens)
        self._step.new_batch()  # graph mode: re-plans now; a failure leaves self._plan None (run() refuses)
        self._plan = _DecodePlan(index, num_qo_heads, num_kv_heads, head_dim, page_size, scale)

    begin_forward = plan

    def run(
        self,
        q,
        paged_kv_cache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse: bool = False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
        q_len_per_req=None,
        skip_softmax_threshold_scale_factor=None,
        kv_cache_sf=None,
    ):
        """Attention of ``q [batch, num_qo_heads, head_dim]`` over the planned pages: ``out`` or ``(out, lse)``."""
        where = f"{_WHERE}.run()"
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{where} called before a successful plan(): plan the batch's page table first")
        if args:
            arg.reject(where, "*args", arg.Shown(f"<{len(args)} extra positional arguments>"),
                       "none (they feed custom JIT kernels)")
        arg.require_unit_scale(where, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if window_left is not None:
            arg.require_value(where, "window_left", window_left, (-1,))
        if q_len_per_req is not None:
            arg.require_value(where, "q_len_per_req", q_len_per_req, (1,))
        arg.require_none(where, sinks=sinks, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                         kv_cache_sf=kv_cache_sf)
        k_cache, v_cache = arg.unpack_paged_kv(where, paged_kv_cache)
        arg.check_gqa_shapes(where, q, k_cache, v_cache, rows=plan.index.batch_size, num_qo_heads=plan.num_qo_heads,
                             num_kv_heads=plan.num_kv_heads, head_dim_qk=plan.head_dim, head_dim_vo=plan.head_dim,
                             page_size=plan.page_size)
        out, lse = arg.destinations(out, lse, plan.index.batch_size, plan.num_qo_heads, plan.head_dim, q.device)
        index = plan.index
        args = (q, k_cache, v_cache, index.kv_indptr, index.kv_indices, index.kv_last_page_len, plan.sm_scale)
        step_plan = self._step.for_run(_package.ops.gqa_decode.SPEC, args)
        out, lse = _package.gqa_paged_decode(*args, out, lse, plan=step_plan)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

