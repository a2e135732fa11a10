"""Batch invariance on CPU: the tools the GPU tests use, and the planner facts that decide it.

A request's output can only be independent of the rest of its batch, bit for bit, if the work the kernel
does for it is: the same items (key ranges, rows, partial slots) reading the same pages. The default
decode plan cuts a request's keys at points that depend on the whole batch; a plan with
``allow_split=False`` gives every request the items it would have alone (docs/determinism.md).
"""

import dataclasses

import numpy as np
import pytest
import torch

from case_surgery import no_split_plan, query_lens, request_rows, solo_request
from cute_attn import hostile, testing
from cute_attn.config import default_paged_config
from cute_attn.plan import ItemField, plan_work

BATCHES = {
    "decode": testing.make_gqa_decode_case([3232, 9000, 70, 0, 4096, 1, 700], seed=31),
    "prefill": testing.make_gqa_prefill_case([64, 7, 0, 30], [2000, 300, 5, 30], seed=33),
    "mla": testing.make_mla_prefill_case([16, 5, 4], [400, 40, 4], seed=34),
}
PLAN_KW = dict(arch="sm_90a", num_sms=132)  # an H200's SM count: the plans the GPU tier will run
# the item fields that decide a request's arithmetic (REQUEST and KV_PAGE_START are positions in the batch)
WORK_FIELDS = [ItemField.KV_HEAD, ItemField.Q_ROW_START, ItemField.Q_ROW_COUNT, ItemField.KV_START,
               ItemField.KV_END, ItemField.PARTIAL_SLOT, ItemField.CAUSAL_OFFSET, ItemField.MERGE]


def _items_of(plan, b):
    items = plan.plan.valid_items()
    mine = items[items[:, ItemField.REQUEST] == b]
    return mine[np.lexsort((mine[:, ItemField.KV_START], mine[:, ItemField.Q_ROW_START], mine[:, ItemField.KV_HEAD]))]


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_solo_request_is_the_same_request(name):
    """Cut out alone, each request's reference output and lse are its batch rows, bit for bit."""
    case = BATCHES[name]
    out, lse = case.reference()
    for b in range(len(case.kv_lens)):
        solo = solo_request(case, b)
        rows = request_rows(case, b)
        assert query_lens(solo) == [query_lens(case)[b]] and solo.kv_lens == [case.kv_lens[b]]
        solo_out, solo_lse = solo.reference()
        assert torch.equal(solo_out, out[rows]) and torch.equal(solo_lse, lse[rows]), f"request {b}"
        hostile.entry_for(solo).check(*solo.inputs(), check_indices=True)  # a valid batch of its own


def test_default_decode_plan_cuts_a_request_where_its_batch_decides():
    """Why decode is not bitwise batch-invariant: the split cap is total keys / (chunks per CTA x CTAs)."""
    config = default_paged_config("gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4,
                                  head_dim_qk=128, head_dim_v=128, page_size=64, causal=False)
    plan_config = config.plan_config(132)
    batch = BATCHES["decode"].kv_lens

    def cuts(kv_lens, cfg):
        items = plan_work(cfg, [1] * len(kv_lens), kv_lens).valid_items()
        mine = items[items[:, ItemField.REQUEST] == 0]
        return sorted(map(tuple, mine[:, [ItemField.KV_HEAD, ItemField.KV_START, ItemField.KV_END]].tolist()))

    alone, in_batch = cuts(batch[:1], plan_config), cuts(batch, plan_config)
    assert len(alone) > 4 and len(in_batch) > 4  # request 0 is split both ways ...
    assert alone != in_batch  # ... at other points: other partials, another merge order of fp32 sums
    no_split = dataclasses.replace(plan_config, allow_split=False)
    whole = [(h, 0, batch[0]) for h in range(4)]
    assert cuts(batch[:1], no_split) == cuts(batch, no_split) == whole


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_no_split_plans_give_a_request_the_work_it_gets_alone(name):
    case = BATCHES[name]
    plan = no_split_plan(case, **PLAN_KW)
    default = hostile.entry_for(case).plan(*case.inputs(), **PLAN_KW)
    assert plan.config == default.config  # what the entry checks a caller's plan against
    assert plan.plan.num_merges == 0 and plan.plan.num_partials == 0
    for b in range(len(case.kv_lens)):
        solo = solo_request(case, b)
        solo_plan = no_split_plan(solo, **PLAN_KW)
        mine, alone = _items_of(plan, b), _items_of(solo_plan, 0)
        assert len(mine) or query_lens(case)[b] == 0, f"request {b} has no work"
        assert np.array_equal(mine[:, WORK_FIELDS], alone[:, WORK_FIELDS]), f"request {b}"
        # and the same pages: the batch's page position and the solo one's name one page id (items with keys;
        # an empty one's position may point past its request)
        live = mine[:, ItemField.KV_END] > mine[:, ItemField.KV_START]
        assert torch.equal(case.kv_indices[mine[live, ItemField.KV_PAGE_START]],
                           solo.kv_indices[alone[live, ItemField.KV_PAGE_START]]), f"request {b}"
