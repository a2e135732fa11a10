"""MLA at every page size and multi-token MLA decode, on the CPU: the reference, the rules, the planned items.

Launches are stood in for (``api.find_launcher`` records them, ``api._require_cuda`` lets CPU tensors through), so
what is checked is what reaches a kernel: the canonical inputs and the plan's items.
"""

import math

import pytest
import torch

import cute_attn
from cute_attn import api, reference, testing
from cute_attn.ops import mla_decode
from cute_attn.plan import ItemField as F
from cpu_stand_ins import host_planned_route


def _small(q_lens, kv_lens, page_size, seed=0, **kw):
    return testing.make_mla_prefill_case(q_lens, kv_lens, num_heads=4, ckv_dim=32, kpe_dim=16, page_size=page_size,
                                         seed=seed, **kw)


def _same_keys_at_page_size_1(case):
    """The same batch as one latent row per page (the ps1 order): the reference must not care."""
    rows_ckv, rows_kpe, ids = [], [], []
    ptr = case.kv_indptr.tolist()
    for b, n in enumerate(case.kv_lens):
        pages = case.kv_indices[ptr[b]:ptr[b + 1]]
        rows_ckv.append(reference.gather_paged_kv(case.ckv_cache, pages, n))
        rows_kpe.append(reference.gather_paged_kv(case.kpe_cache, pages, n))
    ckv = torch.cat(rows_ckv)[:, None]
    kpe = torch.cat(rows_kpe)[:, None]
    flipped = torch.arange(ckv.shape[0] - 1, -1, -1, dtype=torch.int32)  # stored in reverse: ids matter
    ids = flipped.argsort().to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(case.kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (case.q_nope, case.q_pe, ckv[flipped], kpe[flipped], case.qo_indptr, kv_indptr, ids, case.sm_scale)


@pytest.mark.parametrize("page_size", [2, 16, 64, 128])
def test_paged_reference_equals_the_page_size_1_reference(page_size):
    case = _small([3, 0, 5, 1], [70, 4, 5, 0], page_size, seed=page_size)
    out, lse = case.reference()
    out1, lse1 = reference.mla_paged_prefill_ref(*_same_keys_at_page_size_1(case))
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    assert torch.isfinite(out).all()  # the NaN in unused pages and last-page tails is never read


def test_the_paged_pool_is_poisoned_where_no_request_owns_a_slot():
    case = _small([1, 1], [5, 16], 16)
    assert case.kv_last_page_len.tolist() == [5, 16]
    first_page = int(case.kv_indices[0])
    assert torch.isnan(case.ckv_cache[first_page, 5:]).all() and not torch.isnan(case.ckv_cache[first_page, :5]).any()
    owned = set(case.kv_indices.tolist())
    for p in range(case.ckv_cache.shape[0]):
        if p not in owned:
            assert torch.isnan(case.kpe_cache[p]).all()


def test_multi_token_decode_reference_is_bottom_right_causal():
    """Query i of q_len sees keys j <= kv_len - q_len + i: each token alone, at its own kv length, agrees."""
    q_lens, kv_lens = [4, 1, 3, 2], [9, 6, 3, 70]
    case = _small(q_lens, kv_lens, 4, seed=3)
    out, lse = case.reference()
    qo = case.qo_indptr.tolist()
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        for i in range(q):
            # the same request cut to its first kv - q + i + 1 keys, one query: it sees all of them
            keys = kv - q + i + 1
            pages = math.ceil(keys / 4)
            p0 = case.kv_indptr[b].item()
            one = reference.mla_paged_prefill_ref(
                case.q_nope[qo[b] + i:qo[b] + i + 1], case.q_pe[qo[b] + i:qo[b] + i + 1], case.ckv_cache,
                case.kpe_cache, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
                case.kv_indices[p0:p0 + pages], torch.tensor([keys - (pages - 1) * 4], dtype=torch.int32),
                case.sm_scale)
            assert torch.equal(one[0][0], out[qo[b] + i])
            assert torch.allclose(one[1][0], lse[qo[b] + i], rtol=1e-6, atol=1e-6)  # masked logits: ulps apart


def _real(q_lens, kv_lens, page_size, **kw):
    """The kernels' head dims (ckv 512 + kpe 64), few heads: configs can_implement() accepts."""
    return testing.make_mla_prefill_case(q_lens, kv_lens, num_heads=4, page_size=page_size, **kw)


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "find_launcher", lambda config: lambda plan, *a, natural_lse=False: calls.append(
        (plan, a)))

    monkeypatch.setattr(api, "_run_device", host_planned_route)
    cute_attn.clear_plan_cache()
    yield calls
    cute_attn.clear_plan_cache()


def test_paged_prefill_plans_kv_lengths_from_pages(launches):
    case = _real([3, 0, 5], [70, 4, 5], 64)
    cute_attn.mla_paged_prefill(*case.inputs(), arch="sm_90a", num_sms=8)
    (plan, inputs), = launches
    assert plan.config.page_size == 64 and inputs[7] is case.kv_last_page_len and inputs[8] == case.sm_scale
    items = plan.plan.valid_items()
    ends = {int(r): int(items[items[:, F.REQUEST] == r][:, F.KV_END].max()) for r in set(items[:, F.REQUEST])}
    assert ends == {0: 70, 2: 5}  # request 1 has no query: no item
    # the ps1 order still works and launches kv_last_page_len None
    ps1 = _real([2, 3], [4, 3], 1)
    cute_attn.mla_paged_prefill(*ps1.inputs(), arch="sm_90a", num_sms=8)
    assert launches[-1][1][7] is None and launches[-1][1][8] == ps1.sm_scale


def test_paged_decode_takes_the_definitions_order(launches):
    case = _real([1, 1, 1], [70, 0, 64], 64)
    args = (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices,
            case.kv_last_page_len, case.sm_scale)
    cute_attn.mla_paged_decode(*args, arch="sm_90a", num_sms=8)
    plan, inputs = launches[-1]
    assert inputs[4].tolist() == [0, 1, 2, 3] and inputs[7] is case.kv_last_page_len
    with pytest.raises(ValueError, match="kv_last_page_len is required at page_size 64"):
        cute_attn.mla_paged_decode(*args[:6], case.sm_scale)
    bad = case.kv_last_page_len.clone()
    bad[0] = 65
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] = 65 must be in 1..page_size \(64\)"):
        cute_attn.mla_paged_decode(*args[:6], bad, case.sm_scale)


@pytest.mark.parametrize("page_size", [1, 64])
def test_multi_token_decode_runs_the_causal_prefill_plan(launches, page_size):
    q_lens, kv_lens = [4, 1, 3, 2], [9, 6, 3, 200]
    case = _real(q_lens, kv_lens, page_size, with_last_page_len=page_size > 1)
    args = (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices,
            *((case.kv_last_page_len,) if page_size > 1 else ()), case.sm_scale)
    cute_attn.mla_paged_decode(*args, qo_indptr=case.qo_indptr, arch="sm_90a", num_sms=8)
    plan, inputs = launches[-1]
    assert inputs[4] is case.qo_indptr
    items = plan.plan.valid_items()
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        mine = items[items[:, F.REQUEST] == b]
        assert (mine[:, F.Q_ROW_START] == 0).all() and (mine[:, F.Q_ROW_COUNT] == 4 * q).all()  # one tile (4 heads)
        assert (mine[:, F.CAUSAL_OFFSET] == kv - q).all()  # bottom-right
    planned = mla_decode.plan_mla_paged_decode(*args, qo_indptr=case.qo_indptr, arch="sm_90a", num_sms=8)
    assert planned.config == plan.config


def test_multi_token_decode_rules(launches):
    case = _real([4, 1, 2], [9, 6, 3], 16)
    args = (case.q_nope, case.q_pe, case.ckv_cache, case.kpe_cache, case.kv_indptr, case.kv_indices,
            case.kv_last_page_len, case.sm_scale)

    def call(qo, q_nope=case.q_nope, **kw):
        # the host check (check_indices=True) is where the q_len rule lives; the device planner does not check q_len
        cute_attn.mla_paged_decode(q_nope, *args[1:], qo_indptr=qo, arch="sm_90a", num_sms=8,
                                   **{"check_indices": True, **kw})

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="qo_indptr gives request 0 5 query tokens: decode takes 1..4"):
        call(i32(0, 5, 6, 7))
    with pytest.raises(ValueError, match="qo_indptr gives request 1 0 query tokens"):
        call(i32(0, 4, 4, 7))
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\] \(6\) must equal total_q"):
        call(i32(0, 4, 5, 6))
    with pytest.raises(ValueError, match=r"qo_indptr.shape\[0\] must equal len\(kv_indptr\)"):
        call(i32(0, 4, 7))
    with pytest.raises(TypeError, match="qo_indptr must have dtype torch.int32"):
        call(case.qo_indptr.long())
    with pytest.raises(ValueError, match=r"q_nope.shape\[0\] \(13\) must be in batch_size .. 4 x batch_size"):
        big = torch.zeros(13, *case.q_nope.shape[1:], dtype=torch.bfloat16)
        call(i32(0, 4, 8, 13), q_nope=big)
    with pytest.raises(ValueError, match=r"q_nope.shape\[0\] must equal batch_size.*pass qo_indptr="):
        cute_attn.mla_paged_decode(*args, arch="sm_90a", num_sms=8)
    # check_indices=False skips the value rule (the engine vouches for qo_indptr); a valid one passes either way
    call(case.qo_indptr)
    call(case.qo_indptr, check_indices=False)
    assert len(launches) == 2


def test_both_orders_name_a_misplaced_argument():
    case = _small([1], [3], 1)
    with pytest.raises(TypeError, match="too many positional arguments"):
        cute_attn.mla_paged_prefill(*case.inputs(), *case.new_outputs(), case.new_outputs()[1])
    with pytest.raises(TypeError, match="sm_scale must be a real number"):
        cute_attn.mla_paged_prefill(*case.inputs()[:7])


def _mla_problem(q_lens, kv_lens, page_size=1):
    """The problem ``spec.check`` sees for an MLA batch of these lengths (shapes only, like the device route)."""
    from cute_attn.ops import mla_prefill
    from cute_attn.validate import PagedProblem

    pages = sum(-(-n // page_size) for n in kv_lens)
    return mla_prefill, PagedProblem(len(q_lens), sum(q_lens), 16, 1, 576, 512, page_size, 1 << 20,
                                     torch.device("cpu"), num_kv_slots=pages * page_size)


@pytest.mark.parametrize("q_lens, kv_lens, long_items", [
    ([16384], [16387], True),  # 8195 keys an item: the measured -7% of the smem epilogue
    ([1] * 22, [807] * 22, True),  # decode-like rows over long caches
    ([1028], [1038], False),  # 524 keys an item: the smem epilogue wins (47.3 against 52.3 us)
    ([70] * 28, [73] * 28, False),  # the seed's shape: short items
])
def test_mla_consumer_split_follows_the_items_length(q_lens, kv_lens, long_items):
    """sm_90a picks the consumer split by the batch's shapes (never an index value): the long-item split where the
    mean keys an item reaches LONG_ITEM_KEYS, else SM90_CONSUMERS; other arches and the one-token tiles keep theirs."""
    mla_prefill, problem = _mla_problem(q_lens, kv_lens)
    assert (mla_prefill.keys_per_item(problem) >= mla_prefill.LONG_ITEM_KEYS) == long_items
    config = api._make_config(mla_prefill.SPEC, problem, "sm_90a")
    split = mla_prefill.SM90_LONG_ITEM_CONSUMERS if long_items else mla_prefill.SM90_CONSUMERS
    expected = {**mla_prefill.CONSUMER_KNOBS, **mla_prefill.SM90_CONSUMER_SPLITS[split]}
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.can_implement() is None
    assert api._make_config(mla_prefill.SPEC, problem, "sm_100a") == api._config_for(
        mla_prefill.SPEC, 16, 1, 576, 512, 1, "sm_100a")
    one_token = api._make_config(mla_decode.ONE_TOKEN_SPEC, problem, "sm_90a")
    assert one_token.tile_q_rows == 16 and not one_token.score_warpgroup
    with mla_prefill.consumer_split("score_wg_sepi"):  # a forced split holds for every batch
        assert api._make_config(mla_prefill.SPEC, problem, "sm_90a").smem_epilogue


def test_fused_merge_policy_flips_every_sm90_mla_config_and_restores():
    """``fused_merge_policy(True)``: the MLA prefill configs and the decode entry's one-token configs fold in-kernel
    (what the GPU tier and sanitizer cases run before it is the default); outside the block the default holds."""
    from cute_attn.ops import mla_prefill

    mla, problem = _mla_problem([1] * 4, [4096] * 4)
    seed, seed_problem = _mla_problem([70] * 28, [73] * 28)

    def configs():
        return (api._make_config(mla.SPEC, seed_problem, "sm_90a"), api._make_config(mla.SPEC, problem, "sm_90a"),
                api._make_config(mla_decode.ONE_TOKEN_SPEC, problem, "sm_90a"))

    default = configs()
    assert [c.fused_merge for c in default] == [mla_prefill.FUSED_MERGE] * 3
    with mla_prefill.fused_merge_policy(True):
        fused = configs()
        assert all(c.fused_merge and c.can_implement() is None for c in fused)
        assert fused[2].tile_q_rows == 16 and fused[1].score_warpgroup and not fused[1].smem_epilogue
        assert api._make_config(mla.SPEC, problem, "sm_100a").fused_merge is False  # sm_90a only
    assert configs() == default


def test_decode_fused_merge_policy_flips_the_one_token_configs_only():
    """``mla_decode.decode_fused_merge_policy``: the decode entry's one-token configs fold in-kernel inside the block
    (None there: the prefill kind's ``FUSED_MERGE``), the prefill kind's configs keep theirs, and the default holds
    again outside."""
    from cute_attn.ops import mla_prefill

    mla, problem = _mla_problem([1] * 4, [4096] * 4)

    def configs():
        return (api._make_config(mla.SPEC, problem, "sm_90a"),
                api._make_config(mla_decode.ONE_TOKEN_SPEC, problem, "sm_90a"))

    default = configs()
    for enabled in (True, False):
        with mla_decode.decode_fused_merge_policy(enabled):
            prefill, one_token = configs()
            assert one_token.fused_merge is enabled and one_token.can_implement() is None
            assert prefill.fused_merge is mla_prefill.FUSED_MERGE
    with mla_decode.decode_fused_merge_policy(None), mla_prefill.fused_merge_policy(True):
        assert configs()[1].fused_merge is True
    assert configs() == default


def test_one_query_indptrs_are_kept_for_good():
    """``mla_paged_decode`` without ``qo_indptr`` launches on a cached ``0..batch`` tensor; a captured CUDA graph reads
    that very tensor at every replay, so the cache never drops one (it used to clear itself at 64 batch sizes)."""
    q = torch.zeros(3, 16, 512, dtype=torch.bfloat16)
    first = mla_decode._qo_indptr(q, torch.zeros(4, dtype=torch.int32))
    for batch in range(4, 80):
        mla_decode._qo_indptr(torch.zeros(batch, 16, 512, dtype=torch.bfloat16), torch.zeros(batch + 1,
                                                                                          dtype=torch.int32))
    assert mla_decode._qo_indptr(q, torch.zeros(4, dtype=torch.int32)) is first
    assert first.tolist() == [0, 1, 2, 3]
