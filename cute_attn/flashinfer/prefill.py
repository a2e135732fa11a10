"""``BatchPrefillWithPagedKVCacheWrapper`` with FlashInfer 0.7.x's constructor, ``plan`` and ``run``, on cute_attn.

Supported: ``causal=True`` (bottom-right aligned per request, as FlashInfer's), NHD caches (a ``(k, v)``
tuple or one ``[pages, 2, page_size, heads, dim]`` tensor), bf16, ``head_dim_vo == head_dim_qk``, no
positional encoding / soft-cap / window / custom mask, ``sm_scale`` (default ``1 / sqrt(head_dim_qk)``),
``out=``, ``lse=``, ``return_lse`` with ``lse_base`` ``"log2"`` (default) or ``"ln"``, ``lse_layout="NH"``.
``causal=False`` (FlashInfer's default) raises ``NotImplementedError``: cute_attn's prefill kernels are
built causal. Everything else that changes the attention raises ``NotImplementedError`` naming it.

Plans, as FlashInfer's: the first ``run()`` after a ``plan()`` launches cute_attn's device planner once (no host
sync) and every ``run()`` of the batch (each layer) uses that plan (``step_plan.py``).

Ignored, as they select among FlashInfer's own kernels or buffers: the workspace buffer, ``backend``,
the CUDA-graph index buffers (``use_cuda_graph=True`` is rejected: see the constructor), ``enable_pdl``,
``non_blocking``, ``max_token_per_sequence`` / ``max_sequence_kv`` (cuDNN sizing hints), ``use_fp16_softmax`` /
``uses_spcompress`` (trtllm-gen cubin picks, which FlashInfer's other backends ignore too), ``rope_scale`` /
``rope_theta`` (read only with RoPE, which is rejected).
"""

from __future__ import annotations

from dataclasses import dataclass
import functools

import importlib

# the package object, whatever its import name (an exported FlashInfer-Bench Solution ships a copy under
# another one); its public entry points are looked up at call time
_package = importlib.import_module(__package__.rpartition(".")[0])

from . import arguments as arg
from .indices import PagedKv, on_device, paged_kv, qo_lengths
from .step_plan import StepPlan

__all__ = ["BatchPrefillWithPagedKVCacheWrapper"]

_WHERE = "BatchPrefillWithPagedKVCacheWrapper"


@dataclass(frozen=True)
class _PrefillPlan:
    qo_indptr: object  # torch.Tensor on the wrapper's device
    total_q: int
    index: PagedKv
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float


class BatchPrefillWithPagedKVCacheWrapper:
    """Drop-in for ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` (causal paged prefill / append)."""

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
    ) -> None:
        where = f"{_WHERE}()"
        self.device = arg.workspace_device(where, float_workspace_buffer)
        arg.check_kv_layout(where, kv_layout)
        if use_cuda_graph:  # FlashInfer pads captured queries (qo_indptr[-1] <= rows); our kernels read every row
            arg.reject(where, "use_cuda_graph", use_cuda_graph, "False for prefill (capture "
                       "cute_attn.gqa_paged_prefill itself, with qo_indptr[-1] == q.shape[0] at every replay; the "
                       "decode and MLA wrappers take use_cuda_graph=True)")
        arg.require_false(where, variant_owns_mask=variant_owns_mask)
        arg.require_none(where, custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf, jit_args=jit_args,
                         jit_kwargs=jit_kwargs)
        self._kv_layout = kv_layout
        self._plan: _PrefillPlan | None = None
        self._step = StepPlan()  # one device plan for every run() of a batch (step_plan.py)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        self.device = arg.workspace_device(f"{_WHERE}.reset_workspace_buffer()", float_workspace_buffer)

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv: bool = False,
        uniform_q_len=None,  # 0.7.2.post1's scheduling hint (every request has this q length): no effect here
    ) -> None:
        """Check the batch's query and page tables and options; each :meth:`run` plans on the GPU."""
        where = f"{_WHERE}.plan()"
        self._plan = None  # a plan() that fails leaves no older batch behind for run() to use
        if causal is not True:
            arg.reject(where, "causal", causal, "True (cute_attn's prefill kernels are built causal, bottom-right)")
        arg.require_none(where, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                         prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                         max_item_len_ptr=max_item_len_ptr, seq_lens=seq_lens, seq_lens_q=seq_lens_q,
                         block_tables=block_tables)
        if fixed_split_size is not None:  # FlashInfer's "no fixed split" is None or -1 (vLLM passes -1)
            arg.require_value(where, "fixed_split_size", fixed_split_size, (-1,))
        arg.require_value(where, "token_pos_in_items_len", token_pos_in_items_len, (0,))
        arg.require_value(where, "pos_encoding_mode", pos_encoding_mode, ("NONE",))
        arg.require_value(where, "window_left", window_left, (-1,))
        arg.require_no_soft_cap(where, logits_soft_cap)
        arg.require_false(where, use_fp16_qk_reduction=use_fp16_qk_reduction, disable_split_kv=disable_split_kv)
        arg.bf16_dtype(where, "q_data_type", q_data_type)
        arg.bf16_dtype(where, "kv_data_type", q_data_type if kv_data_type is None else kv_data_type)
        if o_data_type is not None:
            arg.bf16_dtype(where, "o_data_type", o_data_type)
        num_qo_heads = arg.count(where, "num_qo_heads", num_qo_heads)
        num_kv_heads = arg.count(where, "num_kv_heads", num_kv_heads)
        head_dim_qk = arg.count(where, "head_dim_qk", head_dim_qk)
        page_size = arg.count(where, "page_size", page_size)
        if head_dim_vo is not None and arg.count(where, "head_dim_vo", head_dim_vo) != head_dim_qk:
            arg.reject(where, "head_dim_vo", head_dim_vo, f"None or head_dim_qk ({head_dim_qk})")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{where}: num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        scale = arg.resolve_sm_scale(where, sm_scale, head_dim_qk)
        index = paged_kv(where, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, self.device,
                         non_blocking)
        q_lens = qo_lengths(where, "qo_indptr", qo_indptr, index.batch_size)
        self._step.new_batch()
        self._plan = _PrefillPlan(on_device(qo_indptr, self.device, non_blocking), int(q_lens.sum()), index,
                                  num_qo_heads, num_kv_heads, head_dim_qk, page_size, scale)

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
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl=None,
        window_left=None,
        sinks=None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
        use_fp16_softmax=None,
        uses_spcompress=None,
    ):
        """Causal attention of ``q [qo_indptr[-1], num_qo_heads, head_dim]``: ``out`` or ``(out, lse)``."""
        where = f"{_WHERE}.run()"
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{where} called before a successful plan(): plan the batch's query and page "
                               "tables first")
        if args:
            arg.reject(where, "*args", arg.Shown(f"<{len(args)} extra positional arguments>"),
                       "none (they feed custom JIT kernels)")
        arg.require_unit_scale(where, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if lse_base not in ("log2", "ln"):
            raise ValueError(f"{where}: lse_base must be 'log2' or 'ln', got {lse_base!r}")
        arg.require_value(where, "lse_layout", lse_layout, ("NH",))
        if window_left is not None:
            arg.require_value(where, "window_left", window_left, (-1,))
        arg.require_none(where, sinks=sinks, kv_cache_sf=kv_cache_sf,
                         skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor)
        k_cache, v_cache = arg.unpack_paged_kv(where, paged_kv_cache)
        arg.check_gqa_shapes(where, q, k_cache, v_cache, rows=plan.total_q, num_qo_heads=plan.num_qo_heads,
                             num_kv_heads=plan.num_kv_heads, head_dim_qk=plan.head_dim, head_dim_vo=plan.head_dim,
                             page_size=plan.page_size)
        out, lse = arg.destinations(out, lse, plan.total_q, plan.num_qo_heads, plan.head_dim, q.device)
        index = plan.index
        args = (q, k_cache, v_cache, plan.qo_indptr, index.kv_indptr, index.kv_indices, index.kv_last_page_len,
                plan.sm_scale)
        step_plan = self._step.for_run(_package.ops.gqa_prefill.SPEC, args)
        out, lse = _package.gqa_paged_prefill(*args, out, lse, natural_lse=lse_base == "ln", plan=step_plan)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)
