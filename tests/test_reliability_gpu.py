"""Reliability of the sm_90a kernels on a GPU: hostile inputs, concurrent streams, determinism, batch invariance.

Through the public entries, on the registered configs only (decode h20/kv4 d128 page 64, prefill h32/kv4
d128 page 64, MLA h16 ckv512 kpe64 page 1), with the NaN-poisoned pools and NaN-prefilled outputs of
``cute_attn.testing``. What each test expects, and why: ``cute_attn/hostile.py``, ``docs/determinism.md``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402

from case_surgery import no_split_plan, query_lens, request_rows, solo_request  # noqa: E402
from cute_attn import hostile, testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STREAM_ITERATIONS = 100
HOLD_CYCLES = 50_000_000  # ~25 ms of GPU sleep: the host queues every launch before the first one runs


@pytest.fixture(autouse=True)
def _fresh_plans():
    import cute_attn
    import cute_attn.kernels.sm90.gqa_decode  # noqa: F401  the three launchers this file runs
    import cute_attn.kernels.sm90.gqa_prefill  # noqa: F401
    import cute_attn.kernels.sm90.mla_prefill  # noqa: F401

    torch.cuda.init()  # resolve_arch asks the device only once CUDA is initialised
    cute_attn.clear_plan_cache()
    yield


def decode_case(kv_lens, seed):
    return testing.make_gqa_decode_case(kv_lens, device="cuda", seed=seed)


def prefill_case(q_lens, kv_lens, seed):
    return testing.make_gqa_prefill_case(q_lens, kv_lens, device="cuda", seed=seed)


def mla_case(q_lens, kv_lens, seed):
    return testing.make_mla_prefill_case(q_lens, kv_lens, num_pages=sum(kv_lens) + 97, device="cuda", seed=seed)


HOSTILE = {  # small ragged batches with an empty request
    "decode": lambda: decode_case([3232, 0, 70, 129], seed=21),
    "prefill": lambda: prefill_case([5, 0, 40], [300, 3, 40], seed=22),
    "mla": lambda: mla_case([3, 0, 17], [50, 4, 17], seed=23),
}
SPLIT = {  # batches whose KV splits: partial slots and merges (decode folds them in-kernel, the others combine)
    "decode": lambda: decode_case([3232, 9000], seed=12),
    "prefill": lambda: prefill_case([64, 7], [16384, 300], seed=24),
    "mla": lambda: mla_case([16, 5], [4000, 40], seed=25),
}
BATCH = {  # batches to cut requests out of
    "decode": lambda: decode_case([3232, 9000, 70, 0, 4096, 1, 700], seed=31),
    "prefill": lambda: prefill_case([64, 7, 0, 300], [16384, 300, 5, 300], seed=33),
    "mla": lambda: mla_case([16, 5, 40], [4000, 40, 40], seed=34),
}


def run(case, out=None, lse=None, **kw):
    if out is None:
        out, lse = case.new_outputs()
    hostile.entry_for(case).run(*case.inputs(), out, lse, **kw)
    return out, lse


def check_reference(case, out, lse, what=""):
    torch.cuda.synchronize()
    ref_out, ref_lse = case.reference()
    testing.assert_close_benchmark(out, ref_out, f"output{what}")
    testing.assert_close_benchmark(lse, ref_lse, f"lse{what}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)  # NaN == NaN, -0 != +0


def assert_same_bits(actual, expected, what):
    differ = _bits(actual) != _bits(expected)
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} of {differ.numel()} elements differ"


def split_plan(case):
    plan = hostile.entry_for(case).plan(*case.inputs())
    assert plan.plan.num_merges > 0, "the case must split KV to exercise partials and merges"
    return plan


# ---------------------------------------------------------------------------------------------
# Hostile inputs: an error naming the argument, before any launch; the GPU is fine afterwards
# ---------------------------------------------------------------------------------------------
def _expect_named_error(case, corruption):
    out, lse = case.new_outputs()
    with pytest.raises(ValueError) as err:
        run(case, out, lse, check_indices=True)  # the host check (debugging); the default checks on the GPU
    torch.cuda.synchronize()  # a launch that slipped through and faulted would surface here
    named = hostile.first_named_argument(str(err.value))
    assert named == corruption.names, f"{corruption.description}: error names {named!r}: {err.value}"
    # NaN-prefilled outputs still all NaN: nothing was launched (a kernel writes every row it owns)
    assert torch.isnan(out).all() and torch.isnan(lse).all(), f"{corruption.description}: a launch wrote outputs"


@pytest.mark.parametrize("entry", sorted(HOSTILE))
def test_drawn_corruptions_raise_naming_the_argument_before_any_launch(entry):
    case = HOSTILE[entry]()
    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]

    @settings(max_examples=20)
    @given(drawn=hostile.corruptions(case, kinds))
    def check(drawn):
        _expect_named_error(*drawn)

    check()
    out, lse = run(case)  # the process and the GPU are still sane
    check_reference(case, out, lse)


@pytest.mark.parametrize("entry", sorted(HOSTILE))
def test_in_place_corruption_of_validated_index_tensors_is_caught(entry):
    """Engines refill the same index buffers: after a good call (fast path and plan cache primed), each
    corruption written into those very tensors is caught, and the restored batch gives the first bits."""
    case = HOSTILE[entry]()
    good_out, good_lse = run(case)
    check_reference(case, good_out, good_lse)
    kinds = [k for k in hostile.applicable_kinds(case) if k in hostile.INPUT_ERROR_KINDS]
    for bad, corruption in hostile.each_corruption(case, kinds):
        target = getattr(case, corruption.field)
        saved = target.clone()
        target.copy_(getattr(bad, corruption.field))
        _expect_named_error(case, corruption)
        target.copy_(saved)
        out, lse = run(case)
        torch.cuda.synchronize()
        assert_same_bits(out, good_out, f"output after {corruption.description} was undone")
        assert_same_bits(lse, good_lse, f"lse after {corruption.description} was undone")


@pytest.mark.parametrize("kind", hostile.NON_FINITE_Q_KINDS)
@pytest.mark.parametrize("entry, token, head, dim", [
    ("decode", 0, 7, 100), ("decode", 1, 19, 0),
    ("prefill", 3, 13, 64), ("prefill", 66, 31, 127),
    ("mla", 2, 5, 10), ("mla", 17, 15, 530),  # 530: q_pe
], ids=str)
def test_non_finite_q_stays_in_its_row(entry, token, head, dim, kind):
    """Not an input error: every other row (the other heads of its tile, the other requests) keeps the bits it
    has without the poison, under the same split plan; the poisoned row's lse is not finite."""
    case = SPLIT[entry]()
    plan = split_plan(case)
    clean_out, clean_lse = run(case, plan=plan)
    check_reference(case, clean_out, clean_lse)
    bad, corruption = hostile.corrupt(case, kind, choice=hostile.query_choice(case, token, head, dim))
    assert corruption.poisoned_row == (token, head)
    out, lse = run(bad, plan=plan)
    torch.cuda.synchronize()
    keep = hostile.unpoisoned_rows(bad, corruption)
    assert_same_bits(out[keep], clean_out[keep], f"output rows other than {corruption.description}")
    assert_same_bits(lse[keep], clean_lse[keep], f"lse rows other than {corruption.description}")
    assert not torch.isfinite(lse[token, head]), f"{corruption.description}: lse {float(lse[token, head])}"


# ---------------------------------------------------------------------------------------------
# Concurrency: launches on two streams, interleaved with no sync in between
# ---------------------------------------------------------------------------------------------
def _on_streams(cases, iterations, **kw):
    """Case i on stream i, ``iterations`` launches each into fresh NaN-filled outputs, interleaved without a
    sync. Every stream starts with a GPU sleep after the first round (which may plan, and planning reads
    the indices), so the launches queue up and then run back to back, both streams at once."""
    streams = [torch.cuda.Stream() for _ in cases]
    outputs = [[case.new_outputs() for _ in range(iterations)] for case in cases]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())  # the cases and outputs were made on this stream
    for i in range(iterations):
        for case, stream, outs in zip(cases, streams, outputs):
            with torch.cuda.stream(stream):
                if i == 1:
                    torch.cuda._sleep(HOLD_CYCLES)
                run(case, *outs[i], **kw)
    torch.cuda.synchronize()
    return outputs


def _assert_every_run_matches(outputs, baselines, what):
    for s, (outs, (base_out, base_lse)) in enumerate(zip(outputs, baselines)):
        for i, (out, lse) in enumerate(outs):
            assert_same_bits(out, base_out, f"{what}: stream {s} run {i} output")
            assert_same_bits(lse, base_lse, f"{what}: stream {s} run {i} lse")


def test_two_streams_each_with_its_own_decode_batch():
    """Two engines' batches, one per stream, each with the automatic plan cache: each run gives the bits of a
    single-stream run of its batch."""
    import cute_attn

    cases = [decode_case([3232, 9000], seed=12), decode_case([70, 5000, 1, 777], seed=32)]
    baselines = [run(case) for case in cases]
    for case, (out, lse) in zip(cases, baselines):
        check_reference(case, out, lse)
        assert split_plan(case).plan.num_merges  # both batches use the fused merge's counters
    cute_attn.clear_plan_cache()  # each stream plans its own batch, on its own stream
    outputs = _on_streams(cases, STREAM_ITERATIONS)
    _assert_every_run_matches(outputs, baselines, "own batches")


@pytest.mark.parametrize("queries", ["same_q", "other_q"])
@pytest.mark.parametrize("plan_source", ["plan_cache", "explicit_plan"])
def test_one_decode_batch_on_two_streams_at_once(plan_source, queries):
    """The same index tensors (so the same cached or explicit plan, whose merges split) on two streams at once:
    with the same q (the counters are shared) and another q (the partial slots would be too)."""
    case = decode_case([3232, 9000], seed=12)
    second = case if queries == "same_q" else dataclasses.replace(case, q=decode_case([3232, 9000], seed=13).q)
    kw = {} if plan_source == "plan_cache" else {"plan": split_plan(case)}
    cases = [case, second]
    baselines = [run(c, **kw) for c in cases]
    for c, (out, lse) in zip(cases, baselines):
        check_reference(c, out, lse)
    outputs = _on_streams(cases, STREAM_ITERATIONS, **kw)
    _assert_every_run_matches(outputs, baselines, f"{plan_source}, {queries}")


def test_one_prefill_batch_on_two_streams_at_once():
    """Prefill's split items write partial slots that a combine launch reads: two streams, one batch, two q."""
    case = SPLIT["prefill"]()
    split_plan(case)
    second = dataclasses.replace(case, q=prefill_case(case.q_lens, case.kv_lens, seed=99).q)
    cases = [case, second]
    baselines = [run(c) for c in cases]
    for c, (out, lse) in zip(cases, baselines):
        check_reference(c, out, lse)
    outputs = _on_streams(cases, 20)
    _assert_every_run_matches(outputs, baselines, "prefill")


# ---------------------------------------------------------------------------------------------
# Determinism and batch invariance (docs/determinism.md)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", sorted(SPLIT))
def test_same_inputs_and_plan_give_the_same_bits(entry):
    """20 calls with one plan whose KV splits: no float atomics, merges fold slots in a fixed order. A call
    through the host plan cache (the same planner, the same lengths) gives those bits too; the default device
    plan cuts where its own rule says (other bits, within tolerance), and gives its bits on every call."""
    case = SPLIT[entry]()
    plan = split_plan(case)
    first_out, first_lse = run(case, plan=plan)
    check_reference(case, first_out, first_lse)
    for call in range(1, 20):
        out, lse = run(case, plan=plan)
        torch.cuda.synchronize()
        assert_same_bits(out, first_out, f"output of call {call}")
        assert_same_bits(lse, first_lse, f"lse of call {call}")
    out, lse = run(case, check_indices=True)  # host-checked: the host planner, through its plan cache
    torch.cuda.synchronize()
    assert_same_bits(out, first_out, "output through the plan cache")
    assert_same_bits(lse, first_lse, "lse through the plan cache")
    device_out, device_lse = run(case)  # the default: planned on the GPU
    check_reference(case, device_out, device_lse, " (device plan)")
    for call in range(1, 5):
        out, lse = run(case)
        torch.cuda.synchronize()
        assert_same_bits(out, device_out, f"device-planned output of call {call}")
        assert_same_bits(lse, device_lse, f"device-planned lse of call {call}")


def test_decode_request_is_close_to_its_solo_run_under_default_plans():
    """Default plans cut a request's keys where the batch decides (not bitwise invariant): within the
    benchmark tolerance of its solo run, always."""
    case = BATCH["decode"]()
    out, lse = run(case)
    check_reference(case, out, lse)
    for b in range(len(case.kv_lens)):
        solo = solo_request(case, b)
        solo_out, solo_lse = run(solo)
        torch.cuda.synchronize()
        rows = request_rows(case, b)
        testing.assert_close_benchmark(out[rows], solo_out, f"request {b} output, batch vs solo")
        testing.assert_close_benchmark(lse[rows], solo_lse, f"request {b} lse, batch vs solo")


@pytest.mark.parametrize("entry", sorted(BATCH))
def test_no_split_plans_make_each_request_bitwise_batch_invariant(entry):
    """With allow_split=False a request's items are the ones it gets alone: the same bits in any batch."""
    case = BATCH[entry]()
    out, lse = run(case, plan=no_split_plan(case))
    check_reference(case, out, lse)
    for b in range(len(case.kv_lens)):
        if query_lens(case)[b] == 0:  # no rows to compare (and a batch of zero rows is not this test's topic)
            continue
        solo = solo_request(case, b)
        solo_out, solo_lse = run(solo, plan=no_split_plan(solo))
        torch.cuda.synchronize()
        rows = request_rows(case, b)
        assert_same_bits(out[rows], solo_out, f"request {b} output, batch vs solo")
        assert_same_bits(lse[rows], solo_lse, f"request {b} lse, batch vs solo")
