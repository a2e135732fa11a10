"""Multi-token (speculative) decode on the CPU: its rules, its plans, and the decode kernels' row arithmetic.

``gqa_paged_multi_token_decode`` is prefill's math (1..8 draft tokens per request, bottom-right causal) run by the
decode kernels. The kernels map packed row r of an item to token ``qo_indptr[b] + Q_ROW_START // group + r // group``
and head ``KV_HEAD * group + r % group``, and mask key j of that row unless ``j < min(KV_END, t + CAUSAL_OFFSET + 1)``
(t: the row's token in its request). :func:`_kernel_model` executes a plan with exactly that arithmetic (and the
fused merge's fold, from the split item's own fields) against the float32 reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cute_attn
from cute_attn import reference, testing
from cute_attn.config import default_paged_config
from cute_attn.ops import gqa_multi_token_decode as mtd
from cute_attn.plan import ItemField as F
from cute_attn.plan import plan_work

KIND = "gqa_paged_multi_token_decode"


def _config(num_qo_heads=20, num_kv_heads=4, head_dim=128, page_size=64, arch="sm_90a"):
    return default_paged_config(KIND, arch=arch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                head_dim_qk=head_dim, head_dim_v=head_dim, page_size=page_size, causal=True)


# --------------------------------------------------------------------------------------------- rules
def test_entry_and_plan_are_exported():
    assert cute_attn.gqa_paged_multi_token_decode is mtd.gqa_paged_multi_token_decode
    assert cute_attn.plan_gqa_paged_multi_token_decode is mtd.plan_gqa_paged_multi_token_decode
    assert mtd.SPEC.causal and mtd.SPEC.reference is reference.gqa_paged_prefill_ref
    assert mtd.SPEC.kernel_modules == {"sm_90a": ".kernels.sm90.gqa_decode",
                                       "sm_100a": ".kernels.sm100.gqa_decode"}


def test_valid_batch_passes_the_rules():
    case = testing.make_gqa_multi_token_decode_case([1, 8, 3], [1, 8, 4000])
    problem, host = mtd.check(*case.inputs(), *case.new_outputs())
    assert problem.total_q == 12 and problem.batch_size == 3
    assert np.array_equal(np.diff(host.qo_indptr), [1, 8, 3])


@pytest.mark.parametrize("q_lens,kv_lens,words", [
    ([2, 0, 1], [5, 5, 5], "request 1 has 0 query tokens"),
    ([9], [100], "request 0 has 9 query tokens"),
    ([4, 3], [100, 2], "request 1 has 2 keys for 3 query tokens"),
])
def test_rules_refuse_token_counts_the_kernels_do_not_take(q_lens, kv_lens, words):
    case = testing.make_gqa_multi_token_decode_case(q_lens, kv_lens)
    with pytest.raises(ValueError, match=words):
        mtd.check(*case.inputs())
    with pytest.raises(ValueError, match=words):
        cute_attn.gqa_paged_multi_token_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    mtd.check(*case.inputs(), check_indices=False)  # metadata alone cannot see it


def test_prefill_rules_apply():
    case = testing.make_gqa_multi_token_decode_case([2, 2], [10, 10])
    with pytest.raises(ValueError, match="qo_indptr"):
        mtd.check(case.q, case.k_cache, case.v_cache, case.qo_indptr[:-1], case.kv_indptr, case.kv_indices,
                  case.kv_last_page_len, case.sm_scale)
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]"):
        mtd.check(case.q[:3], case.k_cache, case.v_cache, case.qo_indptr, case.kv_indptr, case.kv_indices,
                  case.kv_last_page_len, case.sm_scale)


def test_cpu_inputs_are_validated_then_refused():
    case = testing.make_gqa_multi_token_decode_case([3], [70])
    with pytest.raises(ValueError, match="CUDA device"):
        cute_attn.gqa_paged_multi_token_decode(*case.inputs(), arch="sm_90a", num_sms=8)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_default_config_is_decodes_and_a_decode_kernel_builds_it(arch):
    config = _config(arch=arch)
    decode = default_paged_config("gqa_paged_decode", arch=arch, num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                  head_dim_v=128, page_size=64, causal=False)
    assert (config.tile_q_rows, config.kv_tile, config.min_chunk_keys) == \
        (decode.tile_q_rows, decode.kv_tile, decode.min_chunk_keys)
    assert config.can_implement() is None
    import importlib

    from cute_attn.kernels import find_launcher

    module = importlib.import_module(mtd.SPEC.kernel_modules[arch], package="cute_attn")
    assert find_launcher(config) is module.multi_token_launch
    assert find_launcher(decode) is module.launch


def test_group_that_does_not_fit_the_tile_is_refused():
    reason = _config(num_qo_heads=128, num_kv_heads=1).can_implement()
    assert reason is not None and "group" in reason


# --------------------------------------------------------------------------------------------- plans
@settings(max_examples=40, deadline=None)
@given(group=st.integers(1, 16), num_kv=st.sampled_from([1, 2, 4]), batch=testing.multi_token_batches(
    max_batch=12, max_kv=3000))
def test_items_hold_whole_tokens_within_the_kernels_row_bound(group, num_kv, batch):
    from cute_attn.kernels.sm90.gqa_decode import live_rows

    q_lens, kv_lens = batch
    config = _config(num_qo_heads=group * num_kv, num_kv_heads=num_kv)
    plan = plan_work(config.plan_config(16), q_lens, kv_lens)
    items = plan.valid_items()
    assert (items[:, F.Q_ROW_START] % group == 0).all() and (items[:, F.Q_ROW_COUNT] % group == 0).all()
    assert (items[:, F.Q_ROW_COUNT] <= live_rows(config)).all()  # the exchange buffer's and live warps' bound
    q = np.asarray(q_lens)[items[:, F.REQUEST]]
    kv = np.asarray(kv_lens)[items[:, F.REQUEST]]
    assert np.array_equal(items[:, F.CAUSAL_OFFSET], kv - q)
    # one tile per (request, KV head) whenever the request's rows fit 64: the cache is read once per KV head
    whole = q * group <= config.packed_rows_per_tile
    assert (items[whole, F.Q_ROW_START] == 0).all()


def test_q_len_4_plans_as_many_items_as_q_len_1():
    """q_len 4 x group 5 = 20 rows: the same items (and key ranges) as single-token decode, hence its bandwidth."""
    config = _config()
    one = plan_work(config.plan_config(132), [1] * 64, [2048] * 64)
    four = plan_work(config.plan_config(132), [4] * 64, [2048] * 64)
    assert one.num_items == four.num_items and one.num_merges == four.num_merges
    cols = [F.REQUEST, F.KV_HEAD, F.KV_START, F.KV_END, F.PARTIAL_SLOT, F.MERGE, F.KV_PAGE_START]
    assert np.array_equal(one.valid_items()[:, cols], four.valid_items()[:, cols])
    assert (four.valid_items()[:, F.Q_ROW_COUNT] == 20).all()


# --------------------------------------------------------------------------------------------- kernel model
def _kernel_model(plan, case, group):
    """Execute ``plan`` with the decode kernels' multi-token arithmetic (fp32, base-2 LSE)."""
    qo = case.qo_indptr.tolist()
    kvp = case.kv_indptr.tolist()
    q = case.q.float()
    out = torch.full((q.shape[0], q.shape[1], case.v_cache.shape[-1]), math.nan)
    lse = torch.full(q.shape[:2], math.nan)
    partial_o, partial_l, arrivals = {}, {}, {}
    for item in plan.valid_items().tolist():
        b, h, row_start, rows, k0, k1, slot = (item[F.REQUEST], item[F.KV_HEAD], item[F.Q_ROW_START],
                                               item[F.Q_ROW_COUNT], item[F.KV_START], item[F.KV_END],
                                               item[F.PARTIAL_SLOT])
        keys = reference.gather_paged_kv(case.k_cache, case.kv_indices[kvp[b]:kvp[b + 1]], case.kv_lens[b]).float()
        vals = reference.gather_paged_kv(case.v_cache, case.kv_indices[kvp[b]:kvp[b + 1]], case.kv_lens[b]).float()
        token0 = qo[b] + row_start // group  # qo_indptr[REQUEST] + Q_ROW_START // group
        o_rows, l_rows, where = [], [], []
        for r in range(rows):
            token, head = token0 + r // group, h * group + r % group
            limit = min(k1, (row_start + r) // group + item[F.CAUSAL_OFFSET] + 1)
            s = (keys[k0:max(k0, limit), h] @ q[token, head]) * case.sm_scale / math.log(2.0)
            if s.numel():
                m = s.max()
                p = torch.exp2(s - m)
                o_rows.append(p @ vals[k0:limit, h] / p.sum())
                l_rows.append(m + torch.log2(p.sum()))
            else:
                o_rows.append(torch.zeros(vals.shape[-1]))
                l_rows.append(torch.tensor(-math.inf))
            where.append((token, head))
        if slot < 0:
            for (token, head), o, lv in zip(where, o_rows, l_rows):
                out[token, head], lse[token, head] = o, lv
            continue
        partial_o[slot], partial_l[slot] = torch.stack(o_rows), torch.stack(l_rows)
        m = item[F.MERGE]
        arrivals[m] = arrivals.get(m, 0) + 1
        slots = range(int(plan.merge_indptr[m]), int(plan.merge_indptr[m + 1]))
        if arrivals[m] == len(slots):  # the fold writes the item's rows from the item's own fields
            o, lv = reference.merge_partials([partial_o[s] for s in slots], [partial_l[s] for s in slots])
            for i, (token, head) in enumerate(where):
                out[token, head], lse[token, head] = o[i], lv[i]
    return out, lse


@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([1, 2, 5, 8, 16]), num_kv=st.sampled_from([1, 2]),
       batch=testing.multi_token_batches(max_batch=5, max_kv=300), num_ctas=st.sampled_from([1, 3, 40]),
       seed=st.integers(0, 1000))
def test_kernel_arithmetic_reproduces_the_reference(group, num_kv, batch, num_ctas, seed):
    """q_len 1..8, groups 1..16, with and without splits (40 CTAs split the long requests into chunks whose rows
    see no key at all, the causal trim and the fused merge's fold)."""
    q_lens, kv_lens = batch
    case = testing.make_gqa_multi_token_decode_case(q_lens, kv_lens, num_qo_heads=group * num_kv,
                                                    num_kv_heads=num_kv, head_dim=16, page_size=16, seed=seed)
    config = _config(num_qo_heads=group * num_kv, num_kv_heads=num_kv, page_size=16)
    plan_config = config.plan_config(num_ctas)
    plan = plan_work(type(plan_config)(**{**plan_config.__dict__, "min_chunk_keys": 16}), q_lens, kv_lens)
    out, lse = _kernel_model(plan, case, group)
    want_out, want_lse = case.reference()
    testing.assert_close_benchmark(out.to(torch.bfloat16), want_out, "output")
    testing.assert_close_benchmark(lse, want_lse, "lse")


def test_plan_entry_on_cpu_tensors_gives_the_kernels_plan():
    case = testing.make_gqa_multi_token_decode_case([4, 1, 8], [2048, 9, 30000])
    device_plan = cute_attn.plan_gqa_paged_multi_token_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    assert device_plan.config.kind == KIND and device_plan.config.causal
    assert device_plan.plan.num_merges > 0  # the long request splits: the fused merge folds it
    items = device_plan.items[: device_plan.plan.num_items]
    assert set(items[:, F.Q_ROW_COUNT].tolist()) == {20, 5, 40}


def test_spec_strategy_draws_one_to_eight_tokens():
    @settings(max_examples=30, deadline=None)
    @given(lens=mtd.strategy())
    def check(lens):
        assert all(1 <= q <= mtd.MAX_QUERY_TOKENS for q in lens["q_lens"])
        assert all(kv >= q for q, kv in zip(lens["q_lens"], lens["kv_lens"]))

    check()


@pytest.mark.parametrize("group", [1, 5, 16])
def test_requests_past_the_kernels_token_bound_are_planned_as_several_items(group):
    """The device path reads no q_len on the host, so a 12-token request must come out right, not truncated: no
    item holds more than MAX_QUERY_TOKENS tokens' rows (the rows the kernel computes), and every row is covered."""
    from cute_attn.config import default_paged_config
    from cute_attn.plan import ItemField
    from cute_attn.plan import plan_work
    from cute_attn.plan_executor import plan_coverage
    from cute_attn.plan_partition import partition_plan

    config = default_paged_config(mtd.SPEC.name, arch="sm_90a", num_qo_heads=2 * group, num_kv_heads=2,
                                  head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
    assert config.packed_rows_per_tile <= mtd.MAX_QUERY_TOKENS * group
    q_lens, kv_lens = [12, 3], [300, 40]
    for planner in (plan_work, partition_plan):
        plan = planner(config.plan_config(8), q_lens, kv_lens)
        assert (plan.valid_items()[:, ItemField.Q_ROW_COUNT] <= mtd.MAX_QUERY_TOKENS * group).all()
        for b, counts in enumerate(plan_coverage(plan, q_lens, kv_lens)):
            t = np.arange(q_lens[b])[:, None]
            j = np.arange(kv_lens[b])[None, :]
            assert (counts == (j <= t + kv_lens[b] - q_lens[b])).all()
