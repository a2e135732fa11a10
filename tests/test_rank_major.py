"""The planner-free prefills' rank-major unit order (``PagedAttentionConfig.rank_major_units``, off) on the CPU: the numpy
twin's order and when it applies, the kernel's decode of a unit index against it, the cost model's balance, the config
rules and policy, and the builds' PTX (the GPU tier is ``tests/test_rank_major_gpu.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from cute_attn import api, plan_units
from cute_attn.config import RANK_MAJOR_KINDS, RANK_MAJOR_MAX_UNITS_PER_CTA, default_paged_config, rank_major_policy
from cute_attn.plan import ItemField as F
from cute_attn.plan import plan_work


def _plan_config(heads=5, kv_heads=1, num_ctas=132, page_size=64):
    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=heads, num_kv_heads=kv_heads,
                                  head_dim_qk=128, head_dim_v=128, page_size=page_size, causal=True)
    return config.plan_config(num_ctas)


def _kernel_decode(u, batch, heads, q_lens, config):
    """What ``unit_schedule.find_unit`` and ``unit_fields`` give unit ``u`` of a rank-major batch: (request, kv head,
    first packed row)."""
    per_rank = batch * heads
    rank, within = divmod(u, per_rank)
    request, head = divmod(within, heads)
    tiles = -(-q_lens[request] * config.group_size // config.tile_q_rows)
    return request, head, (tiles - 1 - rank) * config.tile_q_rows


@pytest.mark.parametrize("layout", [(5, 1), (32, 4), (16, 2)])
def test_rank_major_covers_every_unit_once_longest_first(layout):
    config = _plan_config(*layout)
    q_lens, kv_lens = [300, 300, 299, 300], [300, 900, 340, 5000]  # 299: the same tile count, a shorter last tile
    items = plan_units.unit_items(config, q_lens, kv_lens, RANK_MAJOR_MAX_UNITS_PER_CTA)
    plain = plan_units.unit_items(config, q_lens, kv_lens)
    assert plan_units.rank_major(config, q_lens, RANK_MAJOR_MAX_UNITS_PER_CTA)
    key = [F.REQUEST, F.KV_HEAD, F.Q_ROW_START]
    assert sorted(map(tuple, items[:, key])) == sorted(map(tuple, plain[:, key]))  # the same units, once each
    heads = config.num_kv_heads
    for u, row in enumerate(items):  # the kernel's closed form decodes every index to the twin's unit
        assert _kernel_decode(u, len(q_lens), heads, q_lens, config) == tuple(row[key])
    last_row = max(plain[:, F.Q_ROW_START])
    assert all(items[: 4 * heads, F.Q_ROW_START] == last_row)  # every request's last tile first


def test_when_the_order_applies():
    config = _plan_config(32, 4, num_ctas=7)  # 2 x 40 at h32/kv4: 12 units a request
    assert plan_units.rank_major(config, [40, 40], 4)  # 24 <= 28
    assert not plan_units.rank_major(config, [40, 40], 3)  # 24 > 21
    assert plan_units.rank_major(config, [40, 41], 4)  # 320 and 328 packed rows: 3 tiles each, uniform units
    assert not plan_units.rank_major(config, [40, 200], 4)  # unequal tile counts
    assert not plan_units.rank_major(config, [40, 0], 4)  # an empty request
    assert not plan_units.rank_major(config, [40, 40], 0)  # off
    ragged = plan_units.unit_items(config, [40, 200], [40, 200], 4)
    assert (ragged == plan_units.unit_items(config, [40, 200], [40, 200])).all()  # request-major, unchanged


def test_the_model_balances_h5_kv1_8x992_as_the_host_plan():
    """The reason for the order: at h5/kv1 and h6/kv1 8 x 992 (2.4 and 2.9 units a CTA) the late claim over
    request-major units models 1.10x and 1.16x the host plan's busiest CTA; rank-major, 1.00x."""
    for heads, request_major in ((5, 1.10), (6, 1.16)):
        config = _plan_config(heads, 1)
        q, kv = [992] * 8, [992] * 8
        host = int(plan_work(config, q, kv).cta_cost.max())
        lead = 2 * config.kv_tile
        ranked = plan_units.claim_late_makespan(plan_units.unit_costs(config, q, kv, 4), 132, lead)
        plain = plan_units.claim_late_makespan(plan_units.unit_costs(config, q, kv), 132, lead)
        assert ranked <= host and plain / host == pytest.approx(request_major, abs=0.01)


def test_config_rules_and_policy():
    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=5, num_kv_heads=1,
                                  head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
    assert "rank_major_units" in dataclasses.replace(config, rank_major_units=4).can_implement()
    for bad in (-1, 1025):  # the cap keeps k x CTAs (the kernel's int32 rule) far from overflow
        assert "rank_major_units" in dataclasses.replace(config, dynamic_schedule=True,
                                                         rank_major_units=bad).can_implement()
    assert RANK_MAJOR_KINDS == ("gqa_paged_prefill",)  # on for GQA since session 39's A/B; MLA's has not run
    from cute_attn.ops import gqa_prefill, mla_prefill

    for spec in (gqa_prefill.SPEC, mla_prefill.SPEC):
        kind_config = api._config_for(spec, 16, 1 if spec is mla_prefill.SPEC else 2, *(
            (576, 512) if spec is mla_prefill.SPEC else (128, 128)), 64, "sm_90a")
        landed = RANK_MAJOR_MAX_UNITS_PER_CTA if spec is gqa_prefill.SPEC else 0
        assert api._self_schedule_config(spec, kind_config).rank_major_units == landed
        with rank_major_policy(False):
            assert api._self_schedule_config(spec, kind_config).rank_major_units == 0
        with rank_major_policy(True):
            assert api._self_schedule_config(spec, kind_config).rank_major_units == RANK_MAJOR_MAX_UNITS_PER_CTA


@pytest.mark.usefixtures("isolated_compile_cache")
@pytest.mark.parametrize("arch, kind", [("sm_90a", "gqa"), ("sm_90a", "mla"), ("sm_100a", "gqa"), ("sm_100a", "mla")])
def test_the_rank_major_builds_compile(arch, kind):
    """The rank-major builds of both prefill kernels on both arches: the grid size read for the rule, the closed-form
    decode's divisions, no local memory."""
    import re

    from cute_attn.compile import compile_to_ptx
    from cute_attn.kernels.common.mla import definition_config

    if kind == "gqa":
        config = default_paged_config("gqa_paged_prefill", arch=arch, num_qo_heads=32, num_kv_heads=4,
                                      head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)
    else:
        config = definition_config(arch, 1)
        if arch == "sm_90a":
            from cute_attn.ops.mla_prefill import CONSUMER_KNOBS, SM90_CONSUMER_SPLITS, SM90_LONG_ITEM_CONSUMERS

            config = dataclasses.replace(config, **{**CONSUMER_KNOBS, **SM90_CONSUMER_SPLITS[SM90_LONG_ITEM_CONSUMERS]})
    config = dataclasses.replace(config, dynamic_schedule=True, late_claim=True, rank_major_units=4)
    assert config.can_implement() is None
    ptx = compile_to_ptx(config)
    assert f".target {arch}" in ptx and "_Rank4" in ptx and "%nctaid.x" in ptx
    assert re.search(r"\bdiv\.[su]32", ptx) and not re.search(r"\.local\b", ptx)
