"""Compile-only tests of the device planner and of the launch order it relies on (no GPU needed).

The planner lets the attention kernel launch early (programmatic dependent launch): the planner issues
``griddepcontrol.launch_dependents`` and every attention kernel ``griddepcontrol.wait`` before its first global
read. A kernel that lost its wait would read a plan still being written, so each arch's PTX is checked here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config
from cute_attn.kernels.common import device_planner

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

ARCHES = ("sm_90a", "sm_100a")


def _decode_planner(arch: str):
    return device_planner.default_configs(arch)[0]


@pytest.mark.parametrize("arch", ARCHES)
def test_planner_triggers_the_dependent_launch_and_prefetches_the_indices(arch):
    ptx = compile_to_ptx(_decode_planner(arch))
    assert f".target {arch}" in ptx
    assert "griddepcontrol.launch_dependents" in ptx
    assert "prefetch.global.L2" in ptx
    # a production build reads no clocks (trace_phases is a development build)
    assert "%clock64" not in ptx and "%globaltimer" not in ptx
    shared = sum(int(n) for n in re.findall(r"\.shared[^;\n]*\[(\d+)\]", ptx))
    assert shared == 0, "the planner's shared memory is dynamic (SmemAllocator)"


def test_trace_build_stamps_clocks():
    ptx = compile_to_ptx(dataclasses.replace(_decode_planner("sm_90a"), trace_phases=True))
    assert "%clock64" in ptx and "%globaltimer" in ptx


@pytest.mark.parametrize("arch", ARCHES)
def test_scan_ctas_arrive_with_acq_rel_and_no_cta_waits(arch):
    """The page scan runs beside the planning CTA (``planner_scan.py``): scan CTAs count themselves with one
    ``atom.acq_rel.gpu`` add each, the planning CTA reads the count once (relaxed) before its lists and on the late way
    orders its bulk-copied rows before its own add; nothing spins on another CTA (a spin would hang a grid that cannot
    be resident at once). The test builds (late way forced, scan CTAs delayed) add only what they say."""
    ptx = compile_to_ptx(_decode_planner(arch))
    assert len(re.findall(r"atom\.global\.acq_rel\.add", ptx)) == 2  # a scan CTA's arrival, the planner's late one
    # the planner's one look at the arrivals, in each instantiation of its path (shared-memory and global-scratch batches)
    assert len(re.findall(r"ld\.relaxed\.gpu\.global", ptx)) == 2
    assert "fence.proxy.async.global" in ptx  # bulk-copied rows ordered before the late arrival
    late = compile_to_ptx(dataclasses.replace(_decode_planner(arch), late_scan=True))
    assert "%globaltimer" not in late
    delayed = compile_to_ptx(dataclasses.replace(_decode_planner(arch), late_scan=True, scan_delay_ns=50_000))
    assert "%globaltimer" in delayed and "%globaltimer" not in ptx
    assert device_planner.scan_ctas(0) == 1 and device_planner.scan_ctas(10**9) == device_planner.MAX_SCAN_CTAS
    assert device_planner.MAX_SCAN_CTAS + 1 <= 132  # with the planning CTA, resident at once on an H200


@pytest.mark.parametrize("arch", ARCHES)
def test_ranked_deal_builds_beside_the_sort_and_leaves_the_default_alone(arch):
    """``rank_deal_max_q_tiles`` (``rank_sort.py``, off by default) adds the ranked branch to the causal planners:
    a different build, still a multiple of 16 bytes of keys within the planning CTA's shared memory."""
    from cute_attn.kernels.common.sorted_deal import sort_key_slots

    for causal in device_planner.default_configs(arch)[1:]:
        ranked = dataclasses.replace(causal, rank_deal_max_q_tiles=4096)
        assert ranked.can_implement() is None
        assert compile_to_ptx(ranked) != compile_to_ptx(causal)
        assert sort_key_slots(ranked) == max(2 * causal.deal_max_q_tiles, 4096)
    assert "4096" in dataclasses.replace(_decode_planner(arch), rank_deal_max_q_tiles=2048).can_implement()


def test_shared_memory_arrays_fit_with_room_for_the_lists():
    # the planning CTA's requests, q tiles and cost line, plus the per-edge arrays, within one SM's 227 KiB
    per_edge = 7 * device_planner.NUM_THREADS * 4
    arrays = (device_planner.SMEM_REQUESTS * 16 + device_planner.SMEM_Q_TILES * 16
              + (device_planner.SMEM_Q_TILES + 1) * 8)
    assert per_edge + arrays < 100 * 1024


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kind, layout", [
    ("gqa_paged_decode", dict(num_qo_heads=20, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64,
                              causal=False)),
    ("gqa_paged_prefill", dict(num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64,
                               causal=True)),
    ("mla_paged_prefill", dict(num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512, page_size=1,
                               causal=True)),
])
def test_attention_kernels_wait_for_the_planner_before_reading(arch, kind, layout):
    ptx = compile_to_ptx(default_paged_config(kind, arch=arch, **layout))
    assert "griddepcontrol.wait" in ptx
    body = ptx[ptx.index(".entry"):]
    assert body.index("griddepcontrol.wait") < body.index("ld.global"), "a global read precedes the wait"


@pytest.mark.parametrize("arch", ARCHES)
def test_planned_launch_is_one_host_function_with_both_kernels(arch):
    from cute_attn.kernels.common.launch_chain import LaunchChainConfig

    attention = default_paged_config("gqa_paged_decode", arch=arch, num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
                                     head_dim_v=128, page_size=64, causal=False)
    fused = LaunchChainConfig(arch=arch, stages=(_decode_planner(arch), attention))
    assert fused.can_implement() is None
    ptx = compile_to_ptx(fused)
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert len(entries) == 2 and any("DevicePlanner" in e for e in entries) and any("GqaDecode" in e for e in entries)
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx
    other_arch = "sm_90a" if arch == "sm_100a" else "sm_100a"
    other = dataclasses.replace(fused, stages=(dataclasses.replace(fused.stages[0], arch=other_arch), attention))
    assert "must target" in other.can_implement()
    assert "two or more" in LaunchChainConfig(arch=arch, stages=(attention,)).can_implement()


@pytest.mark.parametrize("arch", ARCHES)
def test_attention_and_combine_chain_is_one_host_function(arch):
    """A split MLA decode's combine goes out in the attention kernel's host call, and waits for it (PDL)."""
    from cute_attn.kernels.common.combine import CombineConfig
    from cute_attn.kernels.common.launch_chain import LaunchChainConfig
    from cute_attn.ops.mla_decode import ONE_TOKEN_SPEC

    attention = default_paged_config("mla_paged_prefill", arch=arch, num_qo_heads=16, num_kv_heads=1,
                                     head_dim_qk=576, head_dim_v=512, page_size=1, causal=True, spec=ONE_TOKEN_SPEC)
    chain = LaunchChainConfig(arch=arch, stages=(attention, CombineConfig.for_paged(attention)))
    assert chain.can_implement() is None
    ptx = compile_to_ptx(chain)
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert len(entries) == 2 and any("LseCombine" in e for e in entries), entries
    combine_body = ptx[ptx.index(next(e for e in entries if "LseCombine" in e)):]
    assert "griddepcontrol.wait" in combine_body


@pytest.mark.parametrize("arch", ARCHES)
def test_the_causal_planners_carry_the_sorted_deal_and_the_decode_planner_does_not(arch):
    # the deal's sort and maxima are warp butterflies (shfl.sync.bfly); no other planner phase uses one. The decode
    # planner deals in line order (no sort: only the maxima's butterflies), and without the line deal has none
    decode, prefill, mla = device_planner.default_configs(arch)
    assert not decode.sorted_deal and prefill.sorted_deal and mla.sorted_deal
    assert not prefill.line_deal and not mla.line_deal
    assert "shfl.sync.bfly" not in compile_to_ptx(dataclasses.replace(decode, line_deal=False))
    decode_butterflies = compile_to_ptx(dataclasses.replace(decode, line_deal=True)).count("shfl.sync.bfly")
    for config in (prefill, mla):
        ptx = compile_to_ptx(config)
        assert f".target {arch}" in ptx and ptx.count("shfl.sync.bfly") > decode_butterflies > 0


def _bitonic_model(keys: list[int], size: int) -> list[int]:
    """sorted_deal.bitonic_stages run on the host: every (block, stride) compare-exchange of the device sort."""
    from cute_attn.kernels.common.sorted_deal import bitonic_stages

    keys = list(keys) + [2**31 - 1] * (size - len(keys))
    for block, stride, _ in bitonic_stages(size):
        for i in range(size):
            j = i ^ stride
            if j > i:
                low, high = min(keys[i], keys[j]), max(keys[i], keys[j])
                keys[i], keys[j] = (low, high) if (i & block) == 0 else (high, low)
    return keys


@pytest.mark.parametrize("size", [512, 1024])
def test_fast_sort_stages_sort_and_alternate_their_halves(size):
    """The unrolled sort's stage list sorts (as the device runs it: ascending blocks where ``index & block`` is 0),
    and its shared-memory exchanges alternate scratch halves (14 barriers at 1024 keys, 10 at 512)."""
    import random

    from cute_attn.kernels.common.sorted_deal import NUM_THREADS, WARP, bitonic_stages

    rng = random.Random(size)
    keys = rng.sample(range(2**30), size - 7)
    assert _bitonic_model(keys, size)[: len(keys)] == sorted(keys)
    exchanges = [half for _, stride, half in bitonic_stages(size) if WARP <= stride < NUM_THREADS]
    assert len(exchanges) == {512: 10, 1024: 14}[size]
    assert all(a != b for a, b in zip(exchanges, exchanges[1:]))


@pytest.mark.parametrize("arch", ARCHES)
def test_fast_sort_build_sorts_int32_keys_unrolled(arch):
    """The sorted deal's sort: its exchanges shuffle 32-bit keys (one ``shfl`` each; the Int64 sort it replaced took
    two), its stages are unrolled for 512 and 1024 keys (no runtime stride loop: every shared-memory stage its own
    barrier), and only the causal planners build it."""
    decode, prefill, mla = device_planner.default_configs(arch)
    assert mla.sorted_deal and prefill.sorted_deal and not decode.sorted_deal
    fast = compile_to_ptx(mla)
    shuffles = len(re.findall(r"shfl\.sync\.bfly\.b32", fast))
    # shuffle stages: 512 keys -> 35 (one key a thread), 1024 -> 40 x 2 keys; plus the maxima's butterflies
    assert shuffles >= 35 + 2 * 40
    # the shared-memory stages: 10 of the 512-key sort and 14 of the 1024-key one, each behind a barrier
    assert len(re.findall(r"bar\.sync\s+0;|barrier\.sync\s+0;", fast)) >= 10 + 14
    assert len(re.findall(r"shfl\.sync\.bfly\.b32", compile_to_ptx(decode))) < shuffles
    assert f".target {arch}" in fast


@pytest.mark.parametrize("arch", ARCHES)
def test_line_deal_planner_builds_without_the_sort(arch):
    """The decode's line deal (``PlanConfig.line_deal``, on by default) deals the line order: its build reads the
    deal's keys but runs no bitonic sort (no shuffle butterflies beyond the reductions' 5 + 4 a round)."""
    line = dataclasses.replace(_decode_planner(arch), page_size=1, line_deal=True)
    plain = dataclasses.replace(_decode_planner(arch), page_size=1, line_deal=False)
    sorted_build = dataclasses.replace(_decode_planner(arch), page_size=1, sorted_deal=True, line_deal=False)
    counts = {}
    for name, cfg in (("line", line), ("plain", plain), ("sorted", sorted_build)):
        ptx = compile_to_ptx(cfg)
        assert f".target {arch}" in ptx
        counts[name] = ptx.count("shfl.sync.bfly")
    # the line deal adds the vote's pair reduction and the deal's max, never the sort's dozens of exchanges
    assert counts["plain"] < counts["line"] < counts["sorted"], counts
    assert device_planner.DevicePlannerConfig(arch=arch, sorted_deal=True, line_deal=True).can_implement()


@pytest.mark.parametrize("arch", ARCHES)
def test_item_rows_go_out_as_bulk_copies_completed_before_the_grid_ends(arch):
    """The lists phase stores each 512-item chunk with one ``cp.async.bulk`` (thread 0, double-buffered stage): the
    rows are fenced to the async proxy before the copy, the previous copy's reads are waited for before its buffer
    is rebuilt, and every copy completes (``wait_group 0``) before the planning CTA exits."""
    for config in device_planner.default_configs(arch):
        ptx = compile_to_ptx(config)
        assert "cp.async.bulk.global.shared::cta.bulk_group" in ptx
        assert "fence.proxy.async.shared::cta" in ptx
        assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx)
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)


@pytest.mark.parametrize("arch", ARCHES)
def test_lists_phase_builds_one_or_two_rows_a_thread(arch):
    """``items_per_thread`` (default ``ITEMS_PER_THREAD``): two rows a thread a pass search their CTAs side by side
    (fixed steps: ``log2(NUM_THREADS)`` probes a row, no data-dependent loop); one keeps the binary search."""
    prefill = device_planner.default_configs(arch)[1]
    assert device_planner.ITEMS_PER_THREAD == 2 and prefill.rows_per_thread == 2
    assert dataclasses.replace(prefill, items_per_thread=3).can_implement() is not None
    one, two = (compile_to_ptx(dataclasses.replace(prefill, items_per_thread=n)) for n in (1, 2))
    assert one != two and two == compile_to_ptx(prefill)
    for ptx in (one, two):
        assert "cp.async.bulk.global.shared::cta.bulk_group" in ptx and "ld.local" not in ptx


@pytest.mark.parametrize("arch", ARCHES)
def test_q_tile_phase_builds_one_or_two_tiles_a_thread(arch):
    """``q_tiles_per_pass`` (default 1, ``Q_TILES_PER_PASS``): two neighbouring q tiles a thread a pass share a request
    search and one prefix sum; 0 chooses per launch (both paths in one build); the default build keeps one."""
    prefill = device_planner.default_configs(arch)[1]
    assert prefill.q_tiles_per_pass == device_planner.Q_TILES_PER_PASS == 1
    assert dataclasses.replace(prefill, q_tiles_per_pass=3).can_implement() is not None
    one = compile_to_ptx(prefill)
    two, either = (compile_to_ptx(dataclasses.replace(prefill, q_tiles_per_pass=n)) for n in (2, 0))
    assert len({one, two, either}) == 3 and "ld.local" not in two and "ld.local" not in either
    with device_planner.q_tile_pass_policy(0):
        assert device_planner.default_configs(arch)[1].q_tiles_per_pass == 0
    assert device_planner.default_configs(arch)[1].q_tiles_per_pass == 1


@pytest.mark.parametrize("arch", ARCHES)
def test_the_2048_key_sort_builds_four_keys_a_thread(arch):
    """``deal_max_q_tiles`` 2048 (``ops/gqa_prefill.DEAL_MAX_Q_TILES``, the default since session 22): the prefill
    planner's sort takes four keys a thread (one more level of in-register exchanges, twice the shared-memory keys);
    4096 is refused."""
    from cute_attn.ops.gqa_prefill import deal_max_q_tiles_policy

    wide = device_planner.default_configs(arch)[1]
    assert wide.deal_max_q_tiles == 2048 and wide.can_implement() is None
    with deal_max_q_tiles_policy(1024):
        prefill = device_planner.default_configs(arch)[1]
    assert prefill.deal_max_q_tiles == 1024
    assert "1024 or 2048" in dataclasses.replace(prefill, deal_max_q_tiles=4096).can_implement()
    plain_ptx, wide_ptx = compile_to_ptx(prefill), compile_to_ptx(wide)
    assert f".target {arch}" in wide_ptx and plain_ptx != wide_ptx and "ld.local" not in wide_ptx
    # the sort's register exchanges: min/max pairs of the thread's own keys, more of them with four keys a thread
    assert wide_ptx.count("min.s32") > plain_ptx.count("min.s32")


@pytest.mark.parametrize("arch", ARCHES)
def test_whole_cuts_deal_build_differs_only_in_the_deal_bound(arch):
    """``deal_whole_cuts`` (``ops/gqa_prefill.DEVICE_WHOLE_DEAL``, on since session 21): the prefill planner builds with
    the serpentine allowed within 1/16 of whole-tile cuts (a shift and an add in place of the W/32 test); the sort is
    the same."""
    dealing = device_planner.default_configs(arch)[1]
    assert dealing.deal_whole_cuts
    prefill = dataclasses.replace(dealing, deal_whole_cuts=False)
    assert dealing.can_implement() is None
    plain_ptx, dealing_ptx = compile_to_ptx(prefill), compile_to_ptx(dealing)
    assert f".target {arch}" in dealing_ptx and plain_ptx != dealing_ptx
    assert dealing_ptx.count("shfl.sync.bfly") == plain_ptx.count("shfl.sync.bfly")


@pytest.mark.parametrize("arch", ARCHES)
def test_deal_first_builds_hold_the_sort_once_with_one_site(arch):
    """``deal_first`` (on for GQA prefill since session 25): the default build makes the deal at two call sites (before
    the cuts, and after them where it was not made first), so the unrolled sort's shuffles are there twice; the
    ``deal_one_site`` A/B build holds them once (a smaller kernel), with the cuts' smaller code at two sites."""
    first, mla = device_planner.default_configs(arch)[1:]
    assert first.deal_first and not first.deal_one_site
    assert not mla.deal_first  # MLA prefill keeps the cuts first
    one_site = dataclasses.replace(first, deal_one_site=True)
    assert one_site.can_implement() is None
    first_ptx, one_site_ptx = compile_to_ptx(first), compile_to_ptx(one_site)
    assert f".target {arch}" in one_site_ptx
    # H200 builds (session 25): 1540 butterfly shuffles with two sites, 1022 with one, 806 cutting first
    assert one_site_ptx.count("shfl.sync.bfly") < first_ptx.count("shfl.sync.bfly")
    assert len(one_site_ptx) < len(first_ptx)


@pytest.mark.parametrize("arch", ARCHES)
def test_lap_lists_build_compiles_beside_the_default(arch):
    """``lap_lists`` (built in session 25, on with deal_first since session 26): a dealt plan's rows in one pass by
    (lap, CTA) slots, stored by a bulk copy of its own (GQA prefill's planner; MLA's, cuts first, builds without)."""
    decode, lap, mla = device_planner.default_configs(arch)
    assert lap.lap_lists and not mla.lap_lists and not decode.lap_lists
    config = dataclasses.replace(lap, lap_lists=False)
    assert config.can_implement() is None
    plain_ptx, lap_ptx = compile_to_ptx(config), compile_to_ptx(lap)
    assert f".target {arch}" in lap_ptx and lap_ptx != plain_ptx
    assert lap_ptx.count("cp.async.bulk.global.shared::cta") > plain_ptx.count("cp.async.bulk.global.shared::cta")


@pytest.mark.parametrize("arch", ARCHES)
def test_lap_turn_builds_beside_the_serpentine(arch):
    """``lap_turn`` (``sorted_deal.turned_deal_loads``, ``config.LAP_TURN_KINDS``: the GQA prefill default): the
    planner with the lap shifts' warp scan and the vote compiles without local memory, a different build from the
    serpentine's; it needs the sorted deal."""
    from cute_attn.kernels.common.sorted_deal import deal_slots, sort_key_slots, turn_slots

    turned = device_planner.default_configs(arch)[1]
    assert turned.lap_turn and turned.sorted_deal and turned.can_implement() is None
    serpentine = dataclasses.replace(turned, lap_turn=False)
    ptx = compile_to_ptx(turned)
    assert ptx != compile_to_ptx(serpentine) and ".local" not in ptx
    assert deal_slots(turned) == sort_key_slots(turned) + turn_slots(turned) and turn_slots(serpentine) == 0
    assert "sorted_deal" in dataclasses.replace(_decode_planner(arch), lap_turn=True).can_implement()


@pytest.mark.parametrize("arch", ARCHES)
def test_row_writers_build_arrives_once_more_and_one_writer_builds_do_not(arch):
    """A planner built with several row writers (``DevicePlannerConfig.row_writers``, off by default): besides the
    scan CTA's and the one planning CTA's arrivals, an early writer's (before its lists, in each instantiation of the
    planning path) and a late writer's after its rows (their bulk copies ordered before it); the default builds keep
    one writer and the arrivals of one planning CTA."""
    decode, prefill, mla = device_planner.default_configs(arch)
    assert decode.row_writers == prefill.row_writers == mla.row_writers == 1
    ptx = compile_to_ptx(dataclasses.replace(prefill, row_writers=device_planner.MAX_ROW_WRITERS))
    assert len(re.findall(r"atom\.global\.acq_rel\.add", ptx)) == 5
    assert len(re.findall(r"fence\.proxy\.async\.global", ptx)) == 2
    assert len(re.findall(r"ld\.relaxed\.gpu\.global", ptx)) == 2
    assert len(re.findall(r"atom\.global\.acq_rel\.add", compile_to_ptx(mla))) == 2


def test_row_shares_cover_every_row_once_with_aligned_starts():
    from cute_attn.kernels.common.planner_lists import row_share_host

    for num_items in (0, 1, 2, 3, 7, 248, 991, 992, 1984, 7936):
        for writers in range(1, device_planner.MAX_ROW_WRITERS + 1):
            shares = [row_share_host(num_items, w, writers) for w in range(writers)]
            covered = [r for first, end in shares for r in range(first, end)]
            assert covered == list(range(num_items)), (num_items, writers)
            assert all(first % 2 == 0 for first, end in shares if end > first)  # 80-byte rows: 16-byte aligned


def test_launch_writers_follow_the_tile_bound_and_stay_one_past_shared_memory():
    _, prefill, _ = device_planner.default_configs("sm_90a")  # h32/kv4, 128-row tiles: 62 q tiles a 992-token request
    assert device_planner.launch_writers(prefill, 32, 32 * 992) == 1  # the default build: one writer
    prefill = dataclasses.replace(prefill, row_writers=device_planner.MAX_ROW_WRITERS)
    per = device_planner.ROWS_PER_WRITER
    assert device_planner.launch_writers(prefill, 1, 992) == 1
    for batch in (4, 8, 16):
        assert device_planner.launch_writers(prefill, batch, batch * 992) == -(-(batch + batch * 62) * 4 // per)
    assert device_planner.launch_writers(prefill, 32, 32 * 992) == device_planner.MAX_ROW_WRITERS
    # past the planning CTA's shared memory (more than SMEM_Q_TILES q tiles, or SMEM_REQUESTS requests): one
    assert device_planner.launch_writers(prefill, 1, 128 * device_planner.SMEM_Q_TILES) == 1
    assert device_planner.launch_writers(prefill, device_planner.SMEM_REQUESTS + 1, 2000) == 1
    decode = device_planner.default_configs("sm_90a")[0]
    assert device_planner.launch_writers(decode, 64, 64) == 1
    assert device_planner.scan_ctas(10**9, 8) == device_planner.MAX_SCAN_CTAS + 1 - 8


def test_count_order_is_the_stable_longest_first_order():
    """The counting order's scheme (``count_sort.count_order_host``, the device code's chunks, bins and bin-major
    scan) puts every q tile where the twin's stable sort does: most kv tiles first, ties in index order."""
    import numpy as np

    from cute_attn.kernels.common.count_sort import COUNT_BINS, count_order_host

    rng = np.random.default_rng(7)
    for most in (1024, 2048):
        for n in (1, 31, 32, 33, 511, 512, 513, 1000, most):
            if n > most:
                continue
            for high in (2, 9, COUNT_BINS):
                tiles = rng.integers(0, high, size=n)
                slots = count_order_host(tiles, most)
                expected = np.empty(n, dtype=np.int64)
                expected[np.argsort(-tiles, kind="stable")] = np.arange(n)
                assert np.array_equal(slots, expected), (most, n, high)


@pytest.mark.parametrize("arch", ARCHES)
def test_count_sort_build_ranks_by_match_and_keeps_the_bitonic_fallback(arch):
    """``count_sort`` builds (off by default) rank a warp's equal keys with ``match.any`` and keep the bitonic sort
    for keys past COUNT_BINS kv tiles (its shuffles stay); the default builds have no ``match``."""
    _, prefill, mla = device_planner.default_configs(arch)
    assert not prefill.count_sort and not mla.count_sort
    ptx = compile_to_ptx(dataclasses.replace(prefill, count_sort=True))
    assert "match.any.sync" in ptx and "shfl.sync.bfly" in ptx and "popc" in ptx
    assert "match.any" not in compile_to_ptx(prefill)
