"""Host plans that launch the planner-free build (``config.ROUTE_PLAN_KINDS``; built in session 37, on since 42):
the rule (``plan_units.self_schedule_wins``) on the bench's rows, the plan's route, and the launch path (CPU: the
launch is a stand-in; the GPU tier is ``tests/test_dynamic_schedule_gpu.py -k route_plan``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cute_attn
from cute_attn import api, testing, tuning
from cute_attn import config as policies
from cute_attn.plan import plan_work
from cute_attn.plan_units import claim_late_makespan, self_schedule_wins, unit_costs
from cute_attn.unit_schedule_route import UnitScheduleRoute

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import dynamic_schedule_model as model  # noqa: E402

#: the rule's verdict at 132 CTAs, and the H200's default call on the route over the host plan's kernel (session 37,
#: ``docs/perf/h200-late-claim.json``): the rule takes the route only where it ran no slower
VERDICTS = {
    "n1_q992": False,  # 248 units, under two a CTA: 1.01x
    "n4_q992": True,  # 0.98x
    "n8_q992": True,  # 0.97x
    "n32_q992": True,  # 0.91x
    "n4_q512_kv4096": True,  # 0.99x
    "n8_q128_kv2048": False,  # 256 units: 1.00x
    "ragged_12": False,  # 1.04x
    "mla_n1_q43_kv46": False,  # 11 units: 1.10x
    "mla_n1_q1028_kv1038": False,  # 257 units: 1.01x
    "mla_n28_q1954_kv2044": False,  # the seed: 1.07x
    "mla_n20_q3842_kv3916": False,  # 1.01x
    "mla_n22_q22_kv17759": False,  # 22 units
    "mla_n1_q16384_kv16387": True,  # a tie
}


def _verdict(kind, q_lens, kv_lens, max_units=16384, **layout) -> bool:
    """The rule for the late build at 132 CTAs against the host plan of the same batch, in the order the route runs
    it (rank-major where ``config.RANK_MAJOR_KINDS`` holds the kind)."""
    workload = tuning.Workload.for_kind(kind, kv_lens, q_lens, **layout)
    config = tuning.api_config(kind, workload, "sm_90a").plan_config(132)
    host = int(plan_work(config, q_lens, kv_lens).cta_cost.max())
    rank_major = policies.RANK_MAJOR_MAX_UNITS_PER_CTA if kind in policies.RANK_MAJOR_KINDS else 0
    return self_schedule_wins(config, q_lens, kv_lens, host, True, 2, max_units, rank_major)


@pytest.mark.parametrize("label", list(VERDICTS))
def test_the_rule_takes_the_route_where_it_ran_no_slower(label):
    q_lens, kv_lens = {**model.ROWS, **model.mla_rows()}[label]
    kind = "mla_paged_prefill" if label.startswith("mla_") else "gqa_paged_prefill"
    assert _verdict(kind, q_lens, kv_lens) is VERDICTS[label]


#: H200 session 37: 1.19x / 0.93x; H100 session 42 (the plan's kernel against the route, same process): h5/kv1 and
#: h6/kv1 +0.9 us (the rank-major model alone took them), h32/kv16 170.2 -> 150.1 us
@pytest.mark.parametrize("heads, kv_heads, wins", [(5, 1, False), (6, 1, False), (32, 16, True)])
def test_the_rule_on_two_fib_layouts(heads, kv_heads, wins):
    lens = [992] * 8
    assert _verdict("gqa_paged_prefill", lens, lens, num_qo_heads=heads, num_kv_heads=kv_heads) is wins
    # past the cap (2048 units at h32/kv16): no model, no route
    assert not _verdict("gqa_paged_prefill", lens, lens, 2047, num_qo_heads=heads, num_kv_heads=kv_heads)


def test_a_rank_major_batch_must_win_in_request_major_order_too():
    lens = [992] * 8  # h5/kv1: 320 units, 2.4 a CTA; the rank-major order alone models a win
    workload = tuning.Workload.for_kind("gqa_paged_prefill", lens, lens, num_qo_heads=5, num_kv_heads=1)
    config = tuning.api_config("gqa_paged_prefill", workload, "sm_90a").plan_config(132)
    host = int(plan_work(config, lens, lens).cta_cost.max())
    rank_major = policies.RANK_MAJOR_MAX_UNITS_PER_CTA
    rank_busiest = model_busiest(config, lens, rank_major)
    assert rank_busiest <= host < model_busiest(config, lens, 0)  # the two orders disagree here
    assert not self_schedule_wins(config, lens, lens, host, True, 2, 16384, rank_major)
    assert self_schedule_wins(config, lens, lens, max(host, model_busiest(config, lens, 0)), True, 2, 16384,
                              rank_major)


def model_busiest(config, lens, rank_major_units):
    costs = unit_costs(config, lens, lens, rank_major_units)
    return claim_late_makespan(costs, config.num_ctas, 2 * config.kv_tile)


def test_the_policy_is_on_for_both_prefill_kinds():
    assert set(policies.ROUTE_PLAN_KINDS) == {"gqa_paged_prefill", "mla_paged_prefill"}  # since session 42's A/B
    with policies.route_plan_policy(False):
        assert policies.ROUTE_PLAN_KINDS == ()
        with policies.route_plan_policy(True):
            assert set(policies.ROUTE_PLAN_KINDS) == {"gqa_paged_prefill", "mla_paged_prefill"}
    assert set(policies.ROUTE_PLAN_KINDS) == {"gqa_paged_prefill", "mla_paged_prefill"}


def _gqa(q_lens, kv_lens, **kw):
    return testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                         **kw)


def test_a_host_plan_carries_the_route_where_the_rule_holds():
    many = _gqa([512] * 8, [512] * 8)  # 256 units on 8 CTAs
    few = _gqa([200] * 4, [200] * 4)  # 56 units: the plan's splits balance them better
    with policies.route_plan_policy(False):
        assert cute_attn.plan_gqa_paged_prefill(*many.inputs(), arch="sm_90a", num_sms=8).route is None
    with policies.route_plan_policy(True):
        plan = cute_attn.plan_gqa_paged_prefill(*many.inputs(), arch="sm_90a", num_sms=8)
        assert cute_attn.plan_gqa_paged_prefill(*few.inputs(), arch="sm_90a", num_sms=8).route is None
        assert cute_attn.plan_gqa_paged_prefill(*many.inputs(), arch="sm_100a", num_sms=8).route is None
        mla = cute_attn.plan_mla_paged_prefill(*testing.make_mla_prefill_case([512] * 4, [512] * 4).inputs(),
                                               arch="sm_90a", num_sms=8)
    route = plan.route
    assert isinstance(route, UnitScheduleRoute) and (route.num_ctas, route.batch) == (8, 8)
    assert route.config.dynamic_schedule and route.config.late_claim == ("gqa_paged_prefill" in
                                                                         policies.LATE_CLAIM_KINDS)
    assert api._shapes_config(plan.config) == plan.config and not plan.config.dynamic_schedule  # the lists' config
    assert mla.route is not None and mla.route.config.kind == "mla_paged_prefill"


def test_a_launch_with_the_plan_takes_its_route(monkeypatch):
    """The plan's route launches (no items), for the batch size and pool it was made for; a call of another batch size
    or another pool with the plan launches its lists, as any plan's."""
    routed, listed = [], []
    monkeypatch.setattr(api, "_require_cuda", lambda device: None)
    monkeypatch.setattr(api, "find_launcher", lambda config: lambda plan, *args, natural_lse=False: listed.append(plan))
    monkeypatch.setattr(UnitScheduleRoute, "launch", lambda self, args, output, lse, natural_lse, stream, device:
                        routed.append((self, args[0])))
    monkeypatch.setattr(api, "_current_stream", lambda device: 0)
    cute_attn.clear_plan_cache()
    case = _gqa([512] * 8, [512] * 8, extra_pages=40)  # 256 + 40 pages
    with policies.route_plan_policy(True):
        plan = cute_attn.plan_gqa_paged_prefill(*case.inputs(), arch="sm_90a", num_sms=8)
    out, lse = case.new_outputs()
    for _ in range(2):  # the full path, then the fast path's hit
        cute_attn.gqa_paged_prefill(*case.inputs(), out, lse, plan=plan, arch="sm_90a", num_sms=8)
    assert len(routed) == 2 and all(r is plan.route and q is case.q for r, q in routed) and listed == []
    fewer = _gqa([512] * 7, [512] * 7, extra_pages=72)  # the same 296 pages, 7 requests
    larger_pool = _gqa([512] * 8, [512] * 8, extra_pages=41)
    for other in (fewer, larger_pool):
        out, lse = other.new_outputs()
        cute_attn.gqa_paged_prefill(*other.inputs(), out, lse, plan=plan, arch="sm_90a", num_sms=8)
    assert listed == [plan, plan] and len(routed) == 2
    cute_attn.clear_plan_cache()
