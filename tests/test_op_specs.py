"""Each op kind's spec agrees with itself: its argument order is its entry's and its rules', its index tensors are
among its inputs, and its case builder and strategy give cases its own rules accept (CPU tier)."""

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cute_attn
from cute_attn.ops import get_spec, kinds


@pytest.mark.parametrize("kind", kinds())
def test_argument_order_is_the_entrys_and_the_rules(kind):
    spec = get_spec(kind)
    entry = list(inspect.signature(getattr(cute_attn, kind)).parameters)
    rules = list(inspect.signature(spec.check).parameters)
    assert entry[: len(spec.arg_names)] == list(spec.arg_names) == rules[: len(spec.arg_names)]
    assert set(spec.index_names) <= set(spec.arg_names)
    assert spec.arg_names[-2:] == ("output", "lse")


@pytest.mark.parametrize("kind", kinds())
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_strategy_cases_pass_the_kinds_own_rules(kind, data):
    spec = get_spec(kind)
    case = spec.make_case(**data.draw(spec.strategy()))
    problem, host = spec.check(*case.inputs(), *case.new_outputs(), check_indices=True)
    assert host is not None and problem.total_q == case.new_outputs()[0].shape[0]
