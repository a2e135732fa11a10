"""``BatchMLAPagedAttentionWrapper`` with FlashInfer 0.7.x's constructor, ``plan`` and ``run``, on cute_attn.

Absorbed MLA over a paged latent cache (``[num_pages, page_size, dim]``, page size a power of two in 1..128): ``s = sm_scale * (q_nope . ckv + q_pe . kpe)``,
``out = softmax(s) @ ckv``. Supported: the CSR metadata, flat (``qo_indptr, kv_indptr, kv_indices,
kv_len_arr``) or as ``metadata=MLAPlanMetadata.csr(...)`` (any object with those four attributes);
split query and cache (``q_nope, q_pe, ckv_cache, kpe_cache``, or ``query=(q_nope, q_pe)``,
``kv_cache=(ckv_cache, kpe_cache)``); bf16; ``causal=True`` (bottom-right, as FlashInfer's), and
``causal=False`` when every request has one query token (that token sees every key either way);
``out=``, ``lse=``, ``return_lse``, base-2 LSE unless ``return_lse_base_on_e`` (or ``lse_mode="basee"``).
Everything else that changes the attention raises ``NotImplementedError`` naming it.

Kernels and plans: a batch of one query per request (decode) runs ``mla_paged_decode``'s kernel (the swapped
product, split-KV), any other the MLA prefill kernel; the first ``run()`` after a ``plan()`` launches cute_attn's
device planner once (no host sync) and every ``run()`` of the batch (each layer) uses that plan (``step_plan.py``).

Ignored: the workspace buffer, ``backend``, ``enable_pdl``, ``max_q_len`` (a dense-metadata sizing hint).

CUDA graphs (``use_cuda_graph=True``), as FlashInfer's: the constructor takes the four CSR buffers
(``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr``), whose lengths fix the batch size and the page
capacity; every ``plan()`` checks the new batch on the host and copies it into them in place (and the last pages'
fill, derived from ``kv_len_arr``, into a buffer of the wrapper's own), then re-plans on the GPU into the device plan
the captured runs read, so a ``run()`` captured once replays any later plan's batch with no planner in the graph.
The query rows are fixed too (``q_nope.shape[0]`` must equal ``qo_indptr[-1]`` at every plan), and so is the choice
of kernel (one query a request or not): decode, one or a fixed number of tokens a request. Make one ``run()``
before capturing (it compiles, allocates and makes that device plan; a first ``run()`` inside a capture raises).
"""

from __future__ import annotations

from dataclasses import dataclass
import functools

import numpy as np
import torch

import importlib

# the package object, whatever its import name (an exported FlashInfer-Bench Solution ships a copy under
# another one); its public entry points are looked up at call time
_package = importlib.import_module(__package__.rpartition(".")[0])

from . import arguments as arg
from .indices import check_indptr, graph_buffer, host_ints, host_prefix, on_device, qo_lengths, refill
from .step_plan import StepPlan

__all__ = ["BatchMLAPagedAttentionWrapper"]

_WHERE = "BatchMLAPagedAttentionWrapper"
_LSE_MODES = ("none", "base2", "basee")


@dataclass(frozen=True)
class _MlaPlan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor | None  # None at page size 1 (a request has as many keys as pages)
    page_size: int
    total_q: int
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    sm_scale: float
    lse_mode: str
    one_token: bool  # every request has one query: the decode kernel (mla_paged_decode's), not the prefill one


class BatchMLAPagedAttentionWrapper:
    """Drop-in for ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (page sizes 1..128, powers of two)."""

    def __init__(
        self,
        float_workspace_buffer,
        use_cuda_graph: bool = False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend: str = "auto",
    ) -> None:
        where = f"{_WHERE}()"
        self.device = arg.workspace_device(where, float_workspace_buffer)
        self._plan: _MlaPlan | None = None
        self._step = StepPlan(bool(use_cuda_graph))  # one device plan for every run() of a batch (step_plan.py)
        self._graph: dict | None = None  # use_cuda_graph: CSR name -> the caller's buffer, and the last pages' fill
        if use_cuda_graph:
            kv_len = graph_buffer(where, "kv_len_arr", kv_len_arr, self.device)
            batch = kv_len.numel()
            self._graph = dict(
                qo_indptr=graph_buffer(where, "qo_indptr", qo_indptr, self.device, batch + 1),
                kv_indptr=graph_buffer(where, "kv_indptr", kv_indptr, self.device, batch + 1),
                kv_indices=graph_buffer(where, "kv_indices", kv_indices, self.device), kv_len_arr=kv_len,
                kv_last_page_len=torch.zeros(batch, dtype=torch.int32, device=self.device))

    def plan(
        self,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        num_heads=None,
        head_dim_ckv=None,
        head_dim_kpe=None,
        page_size=None,
        causal=None,
        sm_scale=None,
        q_data_type=None,
        kv_data_type=None,
        use_profiler: bool = False,
        *,
        metadata=None,
        cum_seq_lens_q=None,
        block_tables=None,
        seq_lens=None,
        max_q_len=None,
        query_layout=None,
        kv_cache_layout=None,
        lse_mode: str = "none",
        output_dtype=None,
        output_scale: str = "none",
        scale_mode: str = "default",
        skip_softmax: bool = False,
        enable_pdl=None,
        use_sinks: bool = False,
    ) -> None:
        """Check the batch's CSR metadata and options; each :meth:`run` plans on the GPU."""
        where = f"{_WHERE}.plan()"
        self._plan = None  # a plan() that fails leaves no older batch behind for run() to use
        csr = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if metadata is not None:
            if any(t is not None for t in csr):
                raise TypeError(f"{where}: pass metadata= or the flat qo_indptr/kv_indptr/kv_indices/kv_len_arr, "
                                "not both")
            csr = _csr_from_metadata(where, metadata)
        arg.require_none(where, cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables, seq_lens=seq_lens)
        if any(t is None for t in csr):
            missing = [n for n, t in zip(("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"), csr) if t is None]
            raise TypeError(f"{where}: CSR metadata is missing {', '.join(missing)}")
        required = dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                        page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                        kv_data_type=kv_data_type)
        missing = [name for name, value in required.items() if value is None]
        if missing:
            raise TypeError(f"{where}: missing required argument(s) {', '.join(missing)}")
        # the packed forms (one [.., ckv + kpe] tensor) would need copies: our kernels read the two parts apart
        for name, layout in (("query_layout", query_layout), ("kv_cache_layout", kv_cache_layout)):
            if layout is not None:
                arg.require_value(where, name, layout, ("split",))
        if lse_mode not in _LSE_MODES:
            raise ValueError(f"{where}: lse_mode must be one of {_LSE_MODES}, got {lse_mode!r}")
        arg.require_value(where, "output_scale", output_scale, ("none",))
        arg.require_value(where, "scale_mode", scale_mode, ("default",))
        arg.require_false(where, use_profiler=use_profiler, skip_softmax=skip_softmax, use_sinks=use_sinks)
        arg.bf16_dtype(where, "q_data_type", q_data_type)
        arg.bf16_dtype(where, "kv_data_type", kv_data_type)
        if output_dtype is not None:
            arg.bf16_dtype(where, "output_dtype", output_dtype)
        num_heads = arg.count(where, "num_heads", num_heads)
        head_dim_ckv = arg.count(where, "head_dim_ckv", head_dim_ckv)
        head_dim_kpe = arg.count(where, "head_dim_kpe", head_dim_kpe)
        ps = arg.count(where, "page_size", page_size)
        if ps < 1 or ps > 128 or ps & (ps - 1):
            arg.reject(where, "page_size", page_size, "a power of two in 1..128 (cute_attn's MLA kernels)")
        scale = arg.resolve_sm_scale(where, sm_scale, head_dim_ckv + head_dim_kpe)
        if not isinstance(causal, bool):
            raise TypeError(f"{where}: causal must be a bool, got {type(causal).__name__}")
        qo, kvp, kvi, kv_len = csr
        graph = self._graph
        kv_lens, last = _kv_lens_from_pages(where, kvp, kvi, kv_len, ps)
        q_lens = qo_lengths(where, "qo_indptr", qo, kv_lens.size)
        if not causal and (q_lens > 1).any():
            b = int(np.nonzero(q_lens > 1)[0][0])
            arg.reject(where, "causal", causal, f"True, or False when every request has one query token (request "
                       f"{b} has {q_lens[b]})")
        device = self.device
        last_dev = None if ps == 1 else on_device(torch.from_numpy(last.astype(np.int32)), device, False)
        index = [on_device(qo, device, True), on_device(kvp, device, True), on_device(kvi, device, True), last_dev]
        one_token = bool(q_lens.size) and bool((q_lens == 1).all())
        if graph is not None:  # into the captured buffers, in place
            total_q = graph.get("total_q", int(q_lens.sum()))  # the rows a captured run() reads
            if int(q_lens.sum()) != total_q:
                raise ValueError(f"{where}: qo_indptr[-1] ({int(q_lens.sum())}) must stay {total_q} with "
                                 "use_cuda_graph=True: a captured run() reads that many query rows")
            if graph.get("one_token", one_token) != one_token:  # the kernel a captured run() launches
                raise ValueError(f"{where}: with use_cuda_graph=True every plan must keep one query per request "
                                 f"(the first plan's batch {'had' if not one_token else 'did not have'} them) or "
                                 "not: a captured run() launches that batch's kernel")
            pages = int(-(-kv_lens // ps).sum())  # the ids the batch owns
            copies = [("qo_indptr", index[0], "qo_indptr", graph["qo_indptr"], True),
                      ("kv_indptr", index[1], "kv_indptr", graph["kv_indptr"], True),
                      ("kv_indices", index[2][:pages], "kv_indices", graph["kv_indices"], False),
                      ("kv_len_arr", on_device(kv_len, device, True), "kv_len_arr", graph["kv_len_arr"], True)]
            if last_dev is not None:
                copies.append(("kv_len_arr", last_dev, "kv_len_arr", graph["kv_last_page_len"], True))
            refill(where, copies, True)
            graph["total_q"], graph["one_token"] = total_q, one_token  # pinned by the first plan that got through
            index = [graph["qo_indptr"], graph["kv_indptr"], graph["kv_indices"],
                     None if last_dev is None else graph["kv_last_page_len"]]
        self._step.new_batch()  # graph mode: re-plans now; a failure leaves self._plan None (run() refuses)
        self._plan = _MlaPlan(*index, ps, int(q_lens.sum()), num_heads, head_dim_ckv, head_dim_kpe, scale, lse_mode,
                              one_token)

    def run(
        self,
        q_nope=None,
        q_pe=None,
        ckv_cache=None,
        kpe_cache=None,
        out=None,
        lse=None,
        return_lse: bool = False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e: bool = False,
        o_scale=None,
        *,
        query=None,
        kv_cache=None,
        ckv_scale=None,
        ckv_scale_arr=None,
        kpe_scale=None,
        sinks=None,
        skip_softmax_threshold_scale_factor=None,
        bmm1_scale=None,
        bmm2_scale=None,
    ):
        """Attention of the planned batch: ``out [total_q, num_heads, head_dim_ckv]`` or ``(out, lse)``."""
        where = f"{_WHERE}.run()"
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{where} called before a successful plan(): plan the batch's CSR metadata first")
        arg.require_none(where, profiler_buffer=profiler_buffer, kv_len=kv_len, page_table=page_table,
                         o_scale=o_scale, ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale,
                         sinks=sinks, skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                         bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale)
        q_nope, q_pe = _split_pair(where, "query", query, ("q_nope", "q_pe"), (q_nope, q_pe))
        ckv_cache, kpe_cache = _split_pair(where, "kv_cache", kv_cache, ("ckv_cache", "kpe_cache"),
                                           (ckv_cache, kpe_cache))
        expected = (plan.total_q, plan.num_heads, plan.head_dim_ckv)
        if tuple(q_nope.shape) != expected or tuple(q_pe.shape) != expected[:2] + (plan.head_dim_kpe,):
            raise ValueError(f"{where}: q_nope must be {expected} and q_pe {expected[:2] + (plan.head_dim_kpe,)} as "
                             f"planned, got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
        if isinstance(ckv_cache, torch.Tensor) and ckv_cache.dim() == 3 and ckv_cache.shape[1] != plan.page_size:
            raise ValueError(f"{where}: ckv_cache.shape[1] (page_size) must be {plan.page_size} as planned, got "
                             f"{tuple(ckv_cache.shape)}")
        out, lse = arg.destinations(out, lse, plan.total_q, plan.num_heads, plan.head_dim_ckv, q_nope.device)
        natural = bool(return_lse_base_on_e) or plan.lse_mode == "basee"
        args = (q_nope, q_pe, ckv_cache, kpe_cache, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                plan.kv_last_page_len, plan.sm_scale)
        ops = _package.ops
        # one query a request (decode): mla_paged_decode's kernel and spec, given this plan's own qo_indptr (0..batch:
        # the tensor the plan was made from, and the one a captured launch reads, kept alive by the plan)
        spec = ops.mla_decode.ONE_TOKEN_SPEC if plan.one_token else ops.mla_prefill.SPEC
        step_plan = self._step.for_run(spec, args)
        out, lse = ops.mla_prefill.run_mla(*args, out, lse, step_plan, False, natural, None, None, spec=spec)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)


def _csr_from_metadata(where: str, metadata) -> tuple:
    """FlashInfer's ``MLAPlanMetadata`` (read by attribute: no import of flashinfer): CSR only."""
    dense = [n for n in ("cum_seq_lens_q", "block_tables", "seq_lens") if getattr(metadata, n, None) is not None]
    if dense:
        arg.reject(where, "metadata", arg.Shown(f"<dense metadata: {', '.join(dense)}>"),
                   "MLAPlanMetadata.csr(...)")
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
    if not all(hasattr(metadata, n) for n in names):
        raise TypeError(f"{where}: metadata must carry {', '.join(names)} (MLAPlanMetadata.csr), got "
                        f"{type(metadata).__name__}")
    return tuple(getattr(metadata, n) for n in names)


def _kv_lens_from_pages(where: str, kv_indptr, kv_indices, kv_len_arr, page_size: int) -> tuple:
    """``(kv_lens, kv_last_page_len)``: ``kv_len_arr`` must fit the indptr's page counts
    (``pages == ceil(kv_len / page_size)``; at page size 1 it restates them). ``kv_indices`` may run past
    ``kv_indptr[-1]`` (engines size it with slack; a CUDA-graph capacity buffer): only the batch's ids are read."""
    kvp = host_ints(where, "kv_indptr", kv_indptr)
    check_indptr(where, "kv_indptr", kvp)
    ids = host_prefix(where, "kv_indices", kv_indices, int(kvp[-1]), "kv_indptr[-1]")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{where}: kv_indices holds a negative page id ({ids.min()})")
    lens = host_ints(where, "kv_len_arr", kv_len_arr)
    pages = np.diff(kvp)
    if lens.size != pages.size:
        raise ValueError(f"{where}: kv_len_arr must have batch_size = {pages.size} entries, got {lens.size}")
    need = -(-lens // page_size)
    if (lens < 0).any() or (need != pages).any():
        b = int(np.nonzero((lens < 0) | (need != pages))[0][0])
        if page_size == 1:
            raise ValueError(f"{where}: kv_len_arr[{b}] = {lens[b]} must equal request {b}'s page count "
                             f"({pages[b]}) at page_size 1")
        raise ValueError(f"{where}: kv_len_arr[{b}] = {lens[b]} must fill request {b}'s {pages[b]} pages at "
                         f"page_size {page_size}: ceil(kv_len / page_size) pages")
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
    return lens, last


def _split_pair(where: str, name: str, structural, leaf_names: tuple, leaves: tuple) -> tuple:
    """FlashInfer's two run forms: ``query=(q_nope, q_pe)`` or the legacy separate tensors."""
    if structural is not None:
        if any(t is not None for t in leaves):
            raise TypeError(f"{where}: pass either {name}= or {'/'.join(leaf_names)}, not both")
        if isinstance(structural, torch.Tensor):
            arg.reject(where, name, arg.Shown(f"<packed tensor {tuple(structural.shape)}>"),
                       f"a split pair ({', '.join(leaf_names)})")
        if not isinstance(structural, (tuple, list)) or len(structural) != 2:
            raise TypeError(f"{where}: {name} must be a ({', '.join(leaf_names)}) pair")
        leaves = tuple(structural)
    for leaf, t in zip(leaf_names, leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {leaf} must be a torch.Tensor, got {type(t).__name__}")
    return leaves
