"""The float32 reference against a naive per-element loop and hand-computed cases."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_attn import reference, testing

LOG2E = 1 / math.log(2)


def naive_paged(q, k_cache, v_cache, qo, kv_pages, kv_indices, kv_lens, sm_scale, causal):
    """One (token, head, key) at a time, in float64: shares no code with the reference."""
    total_q, hq, _ = q.shape
    page_size, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group = hq // hkv
    out = torch.zeros(total_q, hq, dv, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    for b in range(len(qo) - 1):
        lq, lkv = qo[b + 1] - qo[b], kv_lens[b]
        pages = kv_indices[kv_pages[b] : kv_pages[b + 1]]
        for i in range(lq):
            for h in range(hq):
                logits, values = [], []
                for j in range(lkv):
                    if causal and j > i + lkv - lq:
                        continue
                    page, slot = pages[j // page_size], j % page_size
                    kk = k_cache[page, slot, h // group].double()
                    logits.append(sm_scale * float(q[qo[b] + i, h].double() @ kk))
                    values.append(v_cache[page, slot, h // group].double())
                if not logits:
                    continue
                mx = max(logits)
                w = [math.exp(s - mx) for s in logits]
                tot = sum(w)
                out[qo[b] + i, h] = sum(wi * vi for wi, vi in zip(w, values)) / tot
                lse[qo[b] + i, h] = (mx + math.log(tot)) * LOG2E
    return out, lse


def check_against_naive(case, causal=True):
    qo = [int(x) for x in case.qo_indptr]
    kvp = [int(x) for x in case.kv_indptr]
    idx = [int(x) for x in case.kv_indices]
    want_o, want_lse = naive_paged(case.q, case.k_cache, case.v_cache, qo, kvp, idx, case.kv_lens, case.sm_scale, causal)
    got_o, got_lse = reference.gqa_paged_prefill_ref(*case.inputs(), causal=causal)
    assert got_o.dtype == torch.bfloat16 and got_lse.dtype == torch.float32
    torch.testing.assert_close(got_o.double(), want_o.to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@given(batch=testing.ragged_batches(max_batch=3, max_q=6, max_kv=11, kv_at_least_q=False),
       page_size=st.sampled_from([1, 2, 4]), heads=st.sampled_from([(4, 2), (5, 1), (2, 2)]),
       seed=st.integers(0, 2**16))
def test_prefill_matches_naive_loop(batch, page_size, heads, seed):
    q_lens, kv_lens = batch
    case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=heads[0], num_kv_heads=heads[1],
                                         head_dim=8, page_size=page_size, seed=seed)
    check_against_naive(case)


@given(kv_lens=testing.decode_batches(max_batch=4, max_kv=9), seed=st.integers(0, 2**16))
def test_decode_matches_naive_loop(kv_lens, seed):
    case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=5, num_kv_heads=1, head_dim=8, page_size=4, seed=seed)
    qo = list(range(len(kv_lens) + 1))
    kvp = [int(x) for x in case.kv_indptr]
    idx = [int(x) for x in case.kv_indices]
    want_o, want_lse = naive_paged(case.q, case.k_cache, case.v_cache, qo, kvp, idx, kv_lens, case.sm_scale, False)
    got_o, got_lse = case.reference()
    torch.testing.assert_close(got_o.double(), want_o.to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@given(batch=testing.ragged_batches(max_batch=3, max_q=5, max_kv=9), seed=st.integers(0, 2**16))
def test_mla_matches_naive_loop(batch, seed):
    q_lens, kv_lens = batch
    case = testing.make_mla_prefill_case(q_lens, kv_lens, num_heads=3, ckv_dim=8, kpe_dim=4, seed=seed)
    # MLA is GQA with one KV head whose key is [ckv, kpe] and whose value is ckv, over page size 1
    k = torch.cat([case.ckv_cache, case.kpe_cache], dim=-1)[:, :, None, :]
    v = case.ckv_cache[:, :, None, :]
    q = torch.cat([case.q_nope, case.q_pe], dim=-1)
    qo = [int(x) for x in case.qo_indptr]
    kvp = [int(x) for x in case.kv_indptr]
    idx = [int(x) for x in case.kv_indices]
    want_o, want_lse = naive_paged(q, k, v, qo, kvp, idx, kv_lens, case.sm_scale, True)
    got_o, got_lse = case.reference()
    assert got_o.shape == case.q_nope.shape
    torch.testing.assert_close(got_o.double(), want_o.to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-4, rtol=1e-5)


def test_one_key_gives_v_and_scaled_logit():
    """One visible key: softmax weight 1, so output = v and lse = s * log2(e)."""
    case = testing.make_gqa_prefill_case([1], [1], num_qo_heads=8, num_kv_heads=1, head_dim=16, page_size=4, seed=3)
    out, lse = case.reference()
    page = int(case.kv_indices[0])
    k, v = case.k_cache[page, 0, 0].float(), case.v_cache[page, 0, 0].float()
    for h in range(8):
        s = case.sm_scale * float(case.q[0, h].float() @ k)
        assert lse[0, h].item() == pytest.approx(s * LOG2E, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(out[0, h], v.to(torch.bfloat16))


def test_two_equal_keys_average_values():
    """Two identical keys: weights 1/2 each and lse = s*log2(e) + 1."""
    case = testing.make_gqa_prefill_case([1], [2], num_qo_heads=2, num_kv_heads=2, head_dim=8, page_size=2, seed=5)
    page = int(case.kv_indices[0])
    case.k_cache[page, 1] = case.k_cache[page, 0]
    out, lse = case.reference()
    for h in range(2):
        s = case.sm_scale * float(case.q[0, h].float() @ case.k_cache[page, 0, h].float())
        assert lse[0, h].item() == pytest.approx(s * LOG2E + 1.0, rel=1e-5)
        want = (case.v_cache[page, 0, h].float() + case.v_cache[page, 1, h].float()) / 2
        torch.testing.assert_close(out[0, h], want.to(torch.bfloat16))


def test_rows_that_see_no_key_are_zero_and_minus_inf():
    # request 0: 3 queries over 1 key -> rows 0 and 1 see nothing (bottom-right causal); request 1: empty kv
    case = testing.make_gqa_prefill_case([3, 2], [1, 0], num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    out, lse = case.reference()
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isneginf(lse[:2]).all() and torch.isfinite(lse[2]).all()
    assert torch.equal(out[3:], torch.zeros_like(out[3:])) and torch.isneginf(lse[3:]).all()


def test_natural_lse_option_differs_by_ln2():
    case = testing.make_gqa_prefill_case([4], [6], num_qo_heads=4, num_kv_heads=1, head_dim=8, page_size=4)
    _, lse2 = reference.gqa_paged_prefill_ref(*case.inputs())
    _, lse_e = reference.gqa_paged_prefill_ref(*case.inputs(), natural_lse=True)
    torch.testing.assert_close(lse_e, lse2 * math.log(2))


def test_poison_never_reaches_the_reference():
    case = testing.make_gqa_prefill_case([5, 3], [70, 3], num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=16)
    assert torch.isnan(case.k_cache).any()  # the pool really is poisoned
    out, lse = case.reference()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_merge_partials_equals_whole():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    whole = reference.attend(q, k, v, 0.3)
    a = reference.attend(q, k[:4], v[:4], 0.3)
    b = reference.attend(q, k[4:], v[4:], 0.3)
    empty = reference.attend(q, k[:0], v[:0], 0.3)
    merged = reference.merge_partials([a[0], empty[0], b[0]], [a[1], empty[1], b[1]])
    torch.testing.assert_close(merged[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged[1], whole[1], rtol=1e-5, atol=1e-6)


def test_long_request_is_chunked_identically(monkeypatch):
    case = testing.make_gqa_prefill_case([40], [50], num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=8)
    want = case.reference()
    monkeypatch.setattr(reference, "_MAX_LOGITS", 4 * 50 * 3)  # 3 query rows per chunk
    got = case.reference()
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_benchmark_rule():
    y = torch.tensor([1.0, 100.0, 0.0, -math.inf])
    ok = torch.tensor([1.009, 100.9, 0.0099, -math.inf])
    assert not testing.benchmark_mismatches(ok, y).any()
    bad = torch.tensor([1.02, 102.0, math.nan, 0.0])
    assert testing.benchmark_mismatches(bad, y).tolist() == [True, True, True, True]
    with pytest.raises(AssertionError, match="1 of 4"):
        testing.assert_close_benchmark(torch.tensor([1.0, 100.0, 0.0, math.inf]), y)


def test_reference_is_reachable_from_the_package_and_stays_cheap():
    """``import cute_attn; cute_attn.reference.gqa_paged_decode_ref`` in a fresh interpreter, without
    pulling in the DSL (the references are torch only)."""
    import json
    import os
    import subprocess
    import sys

    probe = ("import json, sys, cute_attn\n"
             "fn = cute_attn.reference.gqa_paged_decode_ref  # before any import of the submodule by name\n"
             "from cute_attn.reference import gqa_paged_decode_ref\n"
             "print(json.dumps([fn is gqa_paged_decode_ref, 'reference' in cute_attn.__all__,\n"
             "                  'cutlass' in sys.modules]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == [True, True, False]
