"""``tools/sanitize.py``'s cases of the planner-free builds (sm_90a): the prefill route (``dynamic_schedule``, its late
claim and rank-major order) and the planner-free decode (``line_schedule``, GQA and MLA), each with a page id past the
pool in some cases (the fault is reported; the rows' values are the GPU tiers' business). Each case is
``name -> (kind, run)`` as ``sanitize._cases`` makes them; ``run_api`` and ``fault_reported`` are its helpers."""

from __future__ import annotations


def page_past_the_pool(case, request: int, mla: bool) -> None:
    """Request ``request``'s last page id set 3 past the end of the case's pool, in place."""
    pool = (case.ckv_cache if mla else case.k_cache).shape[0]
    case.kv_indices[int(case.kv_indptr[request + 1]) - 1] = pool + 3


def planner_free_cases(arch: str, run_api, fault_reported) -> dict:
    """``name -> (kind, run)`` of the planner-free builds' cases for ``arch`` (sm_90a)."""
    import cute_attn
    from cute_attn import testing

    cases = {}

    def dynamic_schedule(page_size, fault=False, mla=False, late=False, rank=False):  # the planner-free default call
        def run():  # (rank: a uniform batch, its units rank-major)
            from cute_attn.config import late_claim_policy, rank_major_policy
            from cute_attn.ops import gqa_prefill, mla_prefill, policy

            ops = mla_prefill if mla else gqa_prefill
            with ops.dynamic_schedule_policy(True), policy(vars(ops), DYNAMIC_MIN_UNITS_PER_CTA=0), \
                    late_claim_policy(late or rank), rank_major_policy(rank):
                make = testing.make_mla_prefill_case if mla else testing.make_gqa_prefill_case
                q_lens, kv_lens = ([200] * 5, [700, 240, 205, 1500, 300]) if rank else \
                    ([1, 40, 0, 200, 300], [700, 40, 5, 1500, 300])
                case = make(q_lens, kv_lens, page_size=page_size, device="cuda", seed=90 + page_size)
                if fault:  # a page id past the pool: the request's units get no keys, nothing outside is read
                    page_past_the_pool(case, 3, mla)
                result = run_api(cute_attn.mla_paged_prefill if mla else cute_attn.gqa_paged_prefill, case, arch,
                                 route="rank_major_units" if rank else "dynamic_schedule")
                return fault_reported(result) if fault else result
        return run

    cases["dynamic-schedule-p64"] = ("gqa_paged_prefill", dynamic_schedule(64))
    cases["dynamic-schedule-p1"] = ("gqa_paged_prefill", dynamic_schedule(1))
    cases["dynamic-schedule-fault"] = ("gqa_paged_prefill", dynamic_schedule(16, fault=True))
    cases["mla-dynamic-schedule-p64"] = ("mla_paged_prefill", dynamic_schedule(64, mla=True))
    cases["mla-dynamic-schedule-p1"] = ("mla_paged_prefill", dynamic_schedule(1, mla=True))
    cases["mla-dynamic-schedule-fault"] = ("mla_paged_prefill", dynamic_schedule(16, fault=True, mla=True))
    cases["dynamic-schedule-fault-p1"] = ("gqa_paged_prefill", dynamic_schedule(1, fault=True))
    cases["mla-dynamic-schedule-fault-p1"] = ("mla_paged_prefill", dynamic_schedule(1, fault=True, mla=True))
    cases["late-claim-p64"] = ("gqa_paged_prefill", dynamic_schedule(64, late=True))
    cases["late-claim-p1"] = ("gqa_paged_prefill", dynamic_schedule(1, late=True))
    cases["mla-late-claim-p64"] = ("mla_paged_prefill", dynamic_schedule(64, mla=True, late=True))
    cases["mla-late-claim-p1"] = ("mla_paged_prefill", dynamic_schedule(1, mla=True, late=True))
    for page_size in (64, 1):  # uniform batches taken rank-major (session 39), one with a page fault
        cases[f"rank-major-p{page_size}"] = ("gqa_paged_prefill", dynamic_schedule(page_size, rank=True))
        cases[f"mla-rank-major-p{page_size}"] = ("mla_paged_prefill", dynamic_schedule(page_size, mla=True,
                                                                                         rank=True))
    cases["rank-major-fault"] = ("gqa_paged_prefill", dynamic_schedule(16, fault=True, rank=True))

    def line_schedule(page_size, kv_lens, fault=False, num_sms=None, mla=False, scan=1, uniform=False):
        def run():  # the planner-free decode (scan: page ids a pass of its scan, config.line_scan_policy; uniform:
            # a uniform batch's closed form, config.line_uniform_policy)
            from cute_attn.config import line_scan_policy, line_uniform_policy
            from cute_attn.ops import gqa_decode, mla_decode

            with ((mla_decode if mla else gqa_decode).line_schedule_policy(True), line_scan_policy(scan),
                  line_uniform_policy(uniform)):
                make = testing.make_mla_decode_case if mla else testing.make_gqa_decode_case
                case = make(kv_lens, page_size=page_size, device="cuda", seed=39 if mla else 38 + page_size)
                if fault:  # a page id past the pool: read as a zero-filled box or row, the request's rows 0 / -inf
                    page_past_the_pool(case, 1, mla)
                result = run_api(cute_attn.mla_paged_decode if mla else cute_attn.gqa_paged_decode, case, arch,
                                 num_sms=num_sms, route="line_schedule")
                return fault_reported(result) if fault else result
        return run

    # ragged cuts with merges on 7 CTAs, even pieces, faults
    cases["line-schedule-p64"] = ("gqa_paged_decode", line_schedule(64, [3000, 0, 9000, 70, 640], num_sms=7))
    cases["line-schedule-p16"] = ("gqa_paged_decode", line_schedule(16, [2048] * 16))
    cases["line-schedule-fault"] = ("gqa_paged_decode", line_schedule(64, [3000, 500, 9000, 70], fault=True))
    cases["line-schedule-p1"] = ("gqa_paged_decode", line_schedule(1, [3000, 500, 9000, 70], fault=True))
    cases["mla-line-schedule-p1"] = ("mla_paged_decode", line_schedule(1, [3000, 0, 9000, 70, 640], num_sms=7,
                                                                        mla=True))
    cases["mla-line-schedule-p64"] = ("mla_paged_decode", line_schedule(64, [3000, 500, 9000, 70], fault=True,
                                                                         num_sms=7, mla=True))
    # the batched scan (session 40): one CTA, so ~12.6k ids are four passes of 8 x 384, a fault in one of them
    cases["line-scan-p1"] = ("gqa_paged_decode", line_schedule(1, [3000, 500, 9000, 70], fault=True, num_sms=1,
                                                               scan=8))
    cases["mla-line-scan-p1"] = ("mla_paged_decode", line_schedule(1, [3000, 0, 9000, 70, 640], fault=True,
                                                                   num_sms=1, mla=True, scan=8))
    # a uniform batch's closed form (session 42): whole tiles, even pieces (merges), a fault in a uniform batch, MLA
    cases["line-uniform-p64"] = ("gqa_paged_decode", line_schedule(64, [2048] * 64, uniform=True))
    cases["line-uniform-even"] = ("gqa_paged_decode", line_schedule(64, [3232] * 3, num_sms=7, uniform=True))
    cases["line-uniform-fault"] = ("gqa_paged_decode", line_schedule(1, [2048] * 16, fault=True, uniform=True))
    cases["mla-line-uniform-p1"] = ("mla_paged_decode", line_schedule(1, [4096] * 16, mla=True, uniform=True))
    return cases
