"""Hostile inputs on CPU tensors: each corrupted field is an error naming it, or (non-finite q) no error at all.

Cases use the registered configs' shapes, so the public entries get past every config rule and only the
order of the checks decides what a CPU caller hears. The same corruptions run on the GPU in
``test_reliability_gpu.py``.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_attn import hostile, testing
from cute_attn.api import DevicePlan

CASES = {
    "decode": testing.make_gqa_decode_case([70, 0, 129, 1], seed=1),
    "decode_one_request": testing.make_gqa_decode_case([130], seed=2),
    "decode_no_pages": testing.make_gqa_decode_case([0, 0], seed=3),
    "prefill": testing.make_gqa_prefill_case([5, 0, 9, 1], [70, 3, 9, 64], seed=4),
    "mla": testing.make_mla_prefill_case([2, 3, 0], [4, 3, 6], seed=5),
    "mla_one_request": testing.make_mla_prefill_case([3], [5], seed=6),
    "mla_paged": testing.make_mla_prefill_case([2, 3, 0], [40, 3, 6], page_size=16, seed=7),  # kv_last_page_len
}

EACH = {name: hostile.each_corruption(case) for name, case in CASES.items()}
ALL = [(name, i) for name in CASES for i in range(len(EACH[name]))]
ERRORS = [(n, i) for n, i in ALL if EACH[n][i][1].expect_error]
NON_FINITE = [(n, i) for n, i in ALL if not EACH[n][i][1].expect_error]


def _ids(params):
    return [f"{n}-{EACH[n][i][1].kind}-{i % 2}" for n, i in params]


def _names_it(error: Exception, corruption: hostile.Corruption) -> None:
    named = hostile.first_named_argument(str(error))
    assert named == corruption.names, (
        f"{corruption.description}: the error must name {corruption.names!r} first, it names {named!r}: {error}"
    )


def _check(case, **kw):
    return hostile.entry_for(case).check(*case.inputs(), *case.new_outputs(), **kw)


def test_base_cases_are_valid():
    for name, case in CASES.items():
        _, host = _check(case, check_indices=True)
        assert host.kv_lens.tolist() == case.kv_lens, name


def test_each_case_takes_the_corruptions_its_fields_allow():
    gqa_index = {"page_id_past_end", "page_id_negative", "kv_indptr_decreases", "kv_indptr_overshoots",
                 "last_page_len_zero", "last_page_len_past_page", "last_page_len_negative"}
    q = {"q_nan", "q_inf"}
    qo = {"qo_indptr_decreases", "qo_indptr_overshoots"}
    expected = {
        "decode": gqa_index | q,
        "decode_one_request": gqa_index | q,
        "decode_no_pages": {"kv_indptr_decreases", "kv_indptr_overshoots", "last_page_len_past_page",
                            "last_page_len_negative"} | q,
        "prefill": gqa_index | qo | q,
        "mla": {"page_id_past_end", "page_id_negative", "kv_indptr_decreases", "kv_indptr_overshoots"} | qo | q,
        "mla_paged": gqa_index | qo | q,
    }
    for name, kinds in expected.items():
        assert set(hostile.applicable_kinds(CASES[name])) == kinds, name
    assert set(hostile.INPUT_ERROR_KINDS) | set(hostile.NON_FINITE_Q_KINDS) == gqa_index | qo | q
    with pytest.raises(ValueError, match="does not apply"):
        hostile.corrupt(CASES["decode"], "qo_indptr_overshoots")


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_a_corruption_changes_one_element_of_one_field(name, data):
    case = CASES[name]
    before = {f.name: getattr(case, f.name) for f in case.__dataclass_fields__.values()}
    bad, corruption = data.draw(hostile.corruptions(case))
    original = before[corruption.field].clone()
    for field, value in before.items():
        if field != corruption.field:
            assert getattr(bad, field) is value, f"{corruption.description}: {field} was replaced too"
    new = getattr(bad, corruption.field)
    assert new is not before[corruption.field]
    assert (new.shape, new.dtype, new.device) == (original.shape, original.dtype, original.device)
    assert int((new != original).sum()) == 1, corruption.description  # the base has no NaN in q or indices
    assert torch.equal(before[corruption.field], original), "the base case was written"
    assert corruption.expect_error == (corruption.kind in hostile.INPUT_ERROR_KINDS)
    assert corruption.names == (corruption.field if corruption.expect_error else "")


@pytest.mark.parametrize("name,i", ALL, ids=_ids(ALL))
def test_corruptions_pass_the_metadata_rules(name, i):
    """Every corruption is in index values or q values: only the value rules (check_indices=True) can see it."""
    bad, _ = EACH[name][i]
    _, host = _check(bad, check_indices=False)
    assert host is None


@pytest.mark.parametrize("name,i", ERRORS, ids=_ids(ERRORS))
def test_value_rules_reject_each_corruption_naming_it(name, i):
    bad, corruption = EACH[name][i]
    with pytest.raises(ValueError) as err:
        _check(bad, check_indices=True)
    _names_it(err.value, corruption)


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_value_rules_reject_drawn_corruptions_naming_them(name, data):
    case = CASES[name]
    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]
    bad, corruption = data.draw(hostile.corruptions(case, kinds))
    with pytest.raises(ValueError) as err:
        _check(bad, check_indices=True)
    _names_it(err.value, corruption)


@pytest.mark.parametrize("name,i", NON_FINITE, ids=_ids(NON_FINITE))
def test_value_rules_accept_non_finite_q(name, i):
    bad, _ = EACH[name][i]
    _, host = _check(bad, check_indices=True)
    assert host.kv_lens.tolist() == bad.kv_lens


@pytest.mark.parametrize("name,i", ERRORS, ids=_ids(ERRORS))
def test_plan_entries_reject_each_corruption_naming_it(name, i):
    bad, corruption = EACH[name][i]
    with pytest.raises(ValueError) as err:
        hostile.entry_for(bad).plan(*bad.inputs(), arch="sm_90a")
    _names_it(err.value, corruption)


@pytest.mark.parametrize("name,i", NON_FINITE, ids=_ids(NON_FINITE))
def test_plan_entries_plan_batches_with_non_finite_q(name, i):
    """Not an input error, and planning never reads q: the plan is the clean batch's."""
    bad, _ = EACH[name][i]
    plan = hostile.entry_for(bad).plan(*bad.inputs(), arch="sm_90a")
    clean = hostile.entry_for(bad).plan(*CASES[name].inputs(), arch="sm_90a")
    assert isinstance(plan, DevicePlan)
    assert np.array_equal(plan.plan.valid_items(), clean.plan.valid_items())


def test_run_entries_report_value_errors_before_the_device_rule():
    """On CPU tensors a corrupted index must be reported as such, not hidden behind 'run on a CUDA device'.

    One test over every corruption (not one per corruption): it flips as a whole when the order changes.
    """
    wrong = []
    for name, i in ERRORS:
        bad, corruption = EACH[name][i]
        try:
            hostile.entry_for(bad).run(*bad.inputs(), arch="sm_90a")
        except ValueError as error:
            if hostile.first_named_argument(str(error)) != corruption.names:
                wrong.append(f"{name}: {corruption.description} -> {error}")
        else:
            wrong.append(f"{name}: {corruption.description} -> no error")
    assert not wrong, f"{len(wrong)} of {len(ERRORS)} corruptions not named:\n" + "\n".join(wrong[:5])


@pytest.mark.parametrize("name,i", NON_FINITE, ids=_ids(NON_FINITE))
def test_run_entries_object_to_non_finite_q_only_for_the_device(name, i):
    bad, _ = EACH[name][i]
    with pytest.raises(ValueError, match="run on a CUDA device"):
        hostile.entry_for(bad).run(*bad.inputs(), arch="sm_90a")


_CLEAN_REFERENCE = {}


@pytest.mark.parametrize("name", ["decode", "prefill", "mla", "mla_one_request"])
@settings(max_examples=20)
@given(data=st.data())
def test_reference_keeps_non_finite_q_in_its_row(name, data):
    """The outcome hostile.py promises for non-finite q, held against the fp32 reference: every other row
    bit for bit as without the poison, the poisoned row's lse not finite."""
    case = CASES[name]
    if name not in _CLEAN_REFERENCE:
        _CLEAN_REFERENCE[name] = case.reference()
    clean_out, clean_lse = _CLEAN_REFERENCE[name]
    bad, corruption = data.draw(hostile.corruptions(case, hostile.NON_FINITE_Q_KINDS))
    out, lse = bad.reference()
    keep = hostile.unpoisoned_rows(bad, corruption)
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep]), corruption.description
    assert not torch.isfinite(lse[corruption.poisoned_row]), corruption.description
    assert int(keep.sum()) == keep.numel() - 1


def test_an_mla_decode_case_is_not_served_the_prefill_entry():
    """``MlaDecodeCase`` subclasses the prefill case but its ``inputs()`` are the decode order: entry_for says so
    rather than hand it the prefill entry (whose argument check would then name the wrong tensor)."""
    case = testing.make_mla_decode_case([5, 0, 70], page_size=64)
    with pytest.raises(TypeError, match="mla_paged_decode"):
        hostile.entry_for(case)


def test_an_mla_decode_case_takes_no_qo_indptr_corruption():
    """The MLA decode entry takes no ``qo_indptr`` (it makes ``0, 1, ..., batch`` itself), so a corrupted one would
    never reach it: a hostile test drawing one would expect a ValueError no correct kernel raises."""
    for page_size in (1, 64):
        kinds = set(hostile.applicable_kinds(testing.make_mla_decode_case([5, 0, 70], page_size=page_size)))
        assert not kinds & {"qo_indptr_decreases", "qo_indptr_overshoots"}
        assert {"page_id_past_end", "kv_indptr_decreases"} <= kinds
