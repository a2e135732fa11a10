"""How cute_attn.flashinfer's wrappers plan, on the CPU (entry points and device planner stood in):

- once per batch: the first ``run()`` after a ``plan()`` makes one device plan, every ``run()`` (layer) of the batch
  passes it, a later batch plans into the same buffers (``step_plan.py``); MLA batches of one query a request take
  the decode kernel's entry and spec;
- ``use_cuda_graph=True`` (decode and MLA): the caller's buffers are checked at construction, every ``plan()``
  refills them in place (all lengths checked before any copy) and re-plans into the device plan the captured runs
  read, and every ``run()`` hands the entry point those very tensors, so a captured ``run()`` replays later plans'
  batches. ``tests/test_flashinfer_graphs_gpu.py`` captures and replays on a GPU."""

from __future__ import annotations

import pytest
import torch

from cute_attn import testing
from cute_attn.flashinfer import (BatchDecodeWithPagedKVCacheWrapper, BatchMLAPagedAttentionWrapper,
                                  BatchPrefillWithPagedKVCacheWrapper)
from test_flashinfer_compat import BF16, _assert_equal, _workspace, reference_entries


@pytest.fixture
def entry_calls(monkeypatch):
    return reference_entries(monkeypatch)

BATCH, PAGES = 4, 40  # the buffers' capacity: requests, page ids


def _decode_buffers(batch=BATCH, pages=PAGES):
    return dict(paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32))


def _decode_case(kv_lens, seed):
    return testing.make_gqa_decode_case(kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                        seed=seed)


def _plan_decode(w, case, indices=None):
    w.plan(case.kv_indptr, case.kv_indices if indices is None else indices, case.kv_last_page_len, 8, 2, 64, 16,
           q_data_type=BF16)


def test_decode_plans_refill_the_buffers_and_runs_read_them(entry_calls):
    buffers = _decode_buffers()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **buffers)
    assert w.is_cuda_graph_enabled
    for step, kv_lens in enumerate(([70, 0, 130, 16], [5, 300, 1, 64], [0, 0, 0, 9])):
        case = _decode_case(kv_lens, seed=step)
        _plan_decode(w, case)
        pages = int(case.kv_indptr[-1])
        assert torch.equal(buffers["paged_kv_indptr_buffer"], case.kv_indptr)
        assert torch.equal(buffers["paged_kv_indices_buffer"][:pages], case.kv_indices)
        assert torch.equal(buffers["paged_kv_last_page_len_buffer"], case.kv_last_page_len)
        out = w.run(case.q, (case.k_cache, case.v_cache))
        _assert_equal(out, case.reference()[0], f"plan {step}")
        # the very buffers, every time: what a captured launch reads at replay
        got = entry_calls[-1].inputs[3:6]
        assert all(a is b for a, b in zip(got, buffers.values())), "run() must pass the graph buffers"


def test_decode_takes_the_indices_buffer_itself_and_longer_indices(entry_calls):
    """SGLang-style: the engine writes the page ids into the buffer and passes the whole buffer back."""
    buffers = _decode_buffers()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **buffers)
    case = _decode_case([70, 0, 130, 16], seed=3)
    pages = int(case.kv_indptr[-1])
    buffers["paged_kv_indices_buffer"][:pages] = case.kv_indices
    buffers["paged_kv_indices_buffer"][pages:] = -7  # past the batch: never read, never checked
    _plan_decode(w, case, indices=buffers["paged_kv_indices_buffer"])
    _assert_equal(w.run(case.q, (case.k_cache, case.v_cache)), case.reference()[0], "buffer as indices")
    longer = torch.cat([case.kv_indices, torch.full((5,), 99, dtype=torch.int32)])
    _plan_decode(w, case, indices=longer)
    assert torch.equal(buffers["paged_kv_indices_buffer"][:pages], case.kv_indices)


@pytest.mark.parametrize("change, match", [
    (dict(paged_kv_indptr_buffer=None), "use_cuda_graph=True needs paged_kv_indptr_buffer"),
    (dict(paged_kv_indices_buffer=torch.zeros(8, dtype=torch.int64)), "paged_kv_indices_buffer must be a contiguous"),
    (dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32)), "paged_kv_indptr_buffer must have 5 entries"),
    (dict(paged_kv_last_page_len_buffer=[0] * 4), "paged_kv_last_page_len_buffer must be a torch.Tensor"),
])
def test_decode_graph_buffers_are_checked_at_construction(change, match):
    with pytest.raises((ValueError, TypeError), match=match):
        BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **(_decode_buffers() | change))


def test_decode_graph_plans_keep_the_batch_and_capacity_and_fail_before_any_copy():
    buffers = _decode_buffers()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **buffers)
    good = _decode_case([70, 0, 130, 16], seed=1)
    _plan_decode(w, good)
    before = {k: v.clone() for k, v in buffers.items()}
    with pytest.raises(ValueError, match="indptr has 3 entries; the CUDA-graph buffer paged_kv_indptr_buffer"):
        _plan_decode(w, _decode_case([5, 6], seed=2))
    with pytest.raises(ValueError, match="indices has 43 entries; the CUDA-graph buffer paged_kv_indices_buffer "
                                         "takes at most 40"):
        _plan_decode(w, testing.make_gqa_decode_case([16 * 40, 16, 1, 1], num_qo_heads=8, num_kv_heads=2,
                                                     head_dim=64, page_size=16, seed=4))
    assert all(torch.equal(before[k], buffers[k]) for k in buffers), "a failed plan() wrote the buffers"
    with pytest.raises(RuntimeError, match="before a successful plan"):
        w.run(good.q, (good.k_cache, good.v_cache))


def test_prefill_graphs_are_refused_with_the_way_to_capture():
    with pytest.raises(NotImplementedError, match="capture cute_attn.gqa_paged_prefill itself"):
        BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True)


def _mla_buffers(batch=BATCH, pages=PAGES):
    return dict(qo_indptr=torch.zeros(batch + 1, dtype=torch.int32),
                kv_indptr=torch.zeros(batch + 1, dtype=torch.int32),
                kv_indices=torch.zeros(pages, dtype=torch.int32), kv_len_arr=torch.zeros(batch, dtype=torch.int32))


def _mla_case(kv_lens, page_size, seed, q_lens=(1, 1, 1, 1)):
    return testing.make_mla_prefill_case(list(q_lens), list(kv_lens), num_heads=4, ckv_dim=32, kpe_dim=16,
                                         page_size=page_size, seed=seed, num_pages=PAGES)


def _plan_mla(w, case, page_size):
    kv_len_arr = torch.tensor(case.kv_lens, dtype=torch.int32)
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, kv_len_arr, 4, 32, 16, page_size, True, case.sm_scale,
           BF16, BF16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_plans_refill_the_buffers_and_runs_read_them(entry_calls, page_size):
    buffers = _mla_buffers()
    w = BatchMLAPagedAttentionWrapper(_workspace(), True, **buffers)
    lens = ([5, 0, 30, 2], [1, 33, 3, 0], [0, 0, 0, 40 if page_size == 1 else 200])
    last_page_lens = []
    for step, kv_lens in enumerate(lens):
        case = _mla_case(kv_lens, page_size, seed=step)
        _plan_mla(w, case, page_size)
        assert torch.equal(buffers["kv_indptr"], case.kv_indptr) and torch.equal(buffers["qo_indptr"], case.qo_indptr)
        assert buffers["kv_len_arr"].tolist() == kv_lens
        out, lse = w.run(case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, return_lse=True)
        ref_out, ref_lse = case.reference()
        _assert_equal(out, ref_out, f"plan {step} output")
        _assert_equal(lse, ref_lse, f"plan {step} lse")
        inputs = entry_calls[-1].inputs  # canonical order (the decode kernel's spec: one query a request)
        assert inputs[4] is buffers["qo_indptr"] and inputs[5] is buffers["kv_indptr"]
        assert inputs[6] is buffers["kv_indices"] and entry_calls.plans[-1].args[4] is buffers["qo_indptr"]
        if page_size == 1:
            assert inputs[7] is None  # the ps1 order: a request has as many keys as pages
        else:  # the wrapper's own buffer, the same tensor at every plan
            assert torch.equal(inputs[7], case.kv_last_page_len)
            last_page_lens.append(inputs[7])
            assert inputs[7] is last_page_lens[0]


def test_mla_graph_plans_keep_the_query_rows():
    w = BatchMLAPagedAttentionWrapper(_workspace(), True, **_mla_buffers())
    _plan_mla(w, _mla_case([5, 0, 30, 2], 1, seed=0), 1)
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\] \(5\) must stay 4 with use_cuda_graph=True"):
        _plan_mla(w, _mla_case([5, 0, 30, 2], 1, seed=0, q_lens=(2, 1, 1, 1)), 1)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs kv_len_arr"):
        BatchMLAPagedAttentionWrapper(_workspace(), True, **(_mla_buffers() | dict(kv_len_arr=None)))


def test_one_device_plan_per_batch_shared_by_every_run(entry_calls):
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    case = _decode_case([70, 0, 130, 16], seed=0)
    _plan_decode(w, case)
    assert not entry_calls.plans, "plan() itself launches nothing outside graph mode"
    for _layer in range(3):
        w.run(case.q, (case.k_cache, case.v_cache))
    (made,) = entry_calls.plans
    assert made.into is None and made.spec.name == "gqa_paged_decode"
    assert all(c.plan is made.plan for c in entry_calls), "every layer runs the batch's one plan"
    other = _decode_case([5, 300, 1, 64], seed=1)
    _plan_decode(w, other)
    out = w.run(other.q, (other.k_cache, other.v_cache))
    _assert_equal(out, other.reference()[0], "the next batch")
    assert len(entry_calls.plans) == 2 and entry_calls.plans[1].recycle is made.plan, "the kept buffers offered"
    assert entry_calls.plans[1].args[3] is other.kv_indptr


def test_graph_mode_replans_at_plan_time_from_the_buffers(entry_calls):
    buffers = _decode_buffers()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **buffers)
    case = _decode_case([70, 0, 130, 16], seed=0)
    _plan_decode(w, case)
    assert not entry_calls.plans, "nothing to re-plan before the first run()"
    w.run(case.q, (case.k_cache, case.v_cache))  # the warm-up run: makes the plan a capture would read
    (made,) = entry_calls.plans
    other = _decode_case([5, 300, 1, 64], seed=1)
    _plan_decode(w, other)  # a replay step: plan() alone must refresh what the captured runs read
    replanned = entry_calls.plans[-1]
    assert len(entry_calls.plans) == 2 and replanned.into is made.plan and replanned.args[0] is case.q
    assert all(a is b for a, b in zip(replanned.args[3:6], buffers.values()))
    w.run(other.q, (other.k_cache, other.v_cache))
    assert len(entry_calls.plans) == 2 and entry_calls[-1].plan is made.plan


def test_mla_decode_batches_take_the_decode_kernel(entry_calls):
    w = BatchMLAPagedAttentionWrapper(_workspace())
    decode = _mla_case([5, 0, 30, 2], 1, seed=0)
    _plan_mla(w, decode, 1)
    out = w.run(decode.q_nope, decode.q_pe, decode.ckv_cache, decode.kpe_cache)
    _assert_equal(out, decode.reference()[0], "decode batch")
    from cute_attn.ops import mla_decode, mla_prefill

    assert entry_calls.plans[-1].spec is mla_decode.ONE_TOKEN_SPEC
    assert entry_calls[-1].options["spec"] is mla_decode.ONE_TOKEN_SPEC
    assert entry_calls[-1].inputs[4] is w._plan.qo_indptr, "the decode kernel reads the plan's own qo_indptr"
    prefill = _mla_case([5, 9, 20, 2], 1, seed=1, q_lens=(1, 3, 0, 2))
    _plan_mla(w, prefill, 1)
    out = w.run(prefill.q_nope, prefill.q_pe, prefill.ckv_cache, prefill.kpe_cache)
    _assert_equal(out, prefill.reference()[0], "prefill batch")
    assert entry_calls.plans[-1].spec is mla_prefill.SPEC and entry_calls[-1].options["spec"] is mla_prefill.SPEC


def test_mla_graph_plans_keep_the_kernel():
    w = BatchMLAPagedAttentionWrapper(_workspace(), True, **_mla_buffers())
    _plan_mla(w, _mla_case([5, 0, 30, 2], 1, seed=0), 1)
    with pytest.raises(ValueError, match="every plan must keep one query per request"):
        _plan_mla(w, _mla_case([5, 9, 20, 2], 1, seed=1, q_lens=(2, 0, 1, 1)), 1)


def test_batches_the_default_call_schedules_itself_get_no_plan(entry_calls):
    """Where the entry's default call takes the planner-free route (``api.self_schedules``: the planner-free
    prefills, for batches with enough units), the wrapper plans nothing and its runs take that route."""
    entry_calls.self_scheduled = True
    case = testing.make_gqa_prefill_case([3, 0, 17], [10, 5, 40], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                         page_size=16, seed=4)
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(case.qo_indptr, case.kv_indptr, case.kv_indices, case.kv_last_page_len, 4, 2, 64, 16, causal=True,
           q_data_type=BF16)
    for _layer in range(2):
        out = w.run(case.q, (case.k_cache, case.v_cache))
    _assert_equal(out, case.reference()[0], "self-scheduled batch")
    assert not entry_calls.plans and all(c.plan is None for c in entry_calls)


def test_a_failed_graph_replan_leaves_no_plan_to_run(entry_calls, monkeypatch):
    """Graph mode: plan() refills the buffers, then re-plans; if that re-plan fails, run() must refuse rather than
    run the previous batch's plan over the new buffers."""
    import cute_attn

    buffers = _decode_buffers()
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_cuda_graph=True, **buffers)
    case = _decode_case([70, 0, 130, 16], seed=0)
    _plan_decode(w, case)
    w.run(case.q, (case.k_cache, case.v_cache))

    def broken(*args, **kw):
        raise RuntimeError("planner launch failed")

    monkeypatch.setattr(cute_attn.api, "plan_for", broken)
    other = _decode_case([5, 300, 1, 64], seed=1)
    with pytest.raises(RuntimeError, match="planner launch failed"):
        _plan_decode(w, other)
    with pytest.raises(RuntimeError, match="before a successful plan"):
        w.run(other.q, (other.k_cache, other.v_cache))


def test_eager_plans_take_padded_indices_and_read_only_the_batch(entry_calls):
    """Engines size kv_indices with slack (SGLang's prefill: + 256): the ids past indptr[-1] are neither required
    nor copied to the host (an int64 tail past int32 would fail that copy's range check)."""
    case = testing.make_gqa_prefill_case([3, 0, 17], [10, 5, 40], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                         page_size=16, seed=4)
    padded = torch.cat([case.kv_indices.long(), torch.full((256,), 2**40, dtype=torch.int64)])
    w = BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(case.qo_indptr, case.kv_indptr, padded, case.kv_last_page_len, 4, 2, 64, 16, causal=True,
           q_data_type=BF16)
    assert w._plan.index.kv_indices.numel() == padded.numel()  # on the device as given (int32): the entry reads
    out = w.run(case.q, (case.k_cache, case.v_cache))  # only the batch's ids
    _assert_equal(out, case.reference()[0], "padded indices")


def test_plans_take_vllms_no_fixed_split(entry_calls):
    """vLLM passes ``fixed_split_size=-1`` (FlashInfer's "no fixed split", as None); a positive split is refused."""
    case = _decode_case([70, 0, 130, 16], seed=0)
    w = BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD")
    w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 8, 2, 64, 16, q_data_type=BF16,
           fixed_split_size=-1)
    _assert_equal(w.run(case.q, (case.k_cache, case.v_cache)), case.reference()[0], "fixed_split_size=-1")
    with pytest.raises(NotImplementedError, match="fixed_split_size=256"):
        w.plan(case.kv_indptr, case.kv_indices, case.kv_last_page_len, 8, 2, 64, 16, q_data_type=BF16,
               fixed_split_size=256)
    prefill = testing.make_gqa_prefill_case([3, 0, 17], [10, 5, 40], num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                            page_size=16, seed=4)
    BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD").plan(
        prefill.qo_indptr, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len, 4, 2, 64, 16,
        causal=True, q_data_type=BF16, fixed_split_size=-1)
