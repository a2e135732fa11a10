"""Every registered kernel's host launch passes what its compiled entry expects (CPU, no kernel runs).

The compiled function is replaced by a recorder: the launch must hand it one argument per fake compile
argument (the stream comes from the environment, not the caller), tensors of the right dtype and rank in
the same order, and the combine must follow only when the plan has merges and the kernel does not fold
them itself (decode fuses its merge: it gets ``merge_indptr, merge_counters`` and no combine follows).
"""

import cutlass
import pytest
import torch

import cute_attn
from cute_attn import testing
from cute_attn.compile import import_all_kernels
from cute_attn.kernels import _PAGED
from cute_attn.kernels.common import combine, paged_launch

import_all_kernels()

DTYPES = {cutlass.BFloat16: torch.bfloat16, cutlass.Float32: torch.float32, cutlass.Int32: torch.int32}

FUSED_MERGE = {"gqa_paged_decode", "gqa_paged_multi_token_decode"}  # kinds whose kernels fold their split-KV merges in-kernel

CASES = {
    "gqa_paged_prefill": (cute_attn.plan_gqa_paged_prefill,
                          lambda: testing.make_gqa_prefill_case([5, 300], [70, 4000])),
    "gqa_paged_decode": (cute_attn.plan_gqa_paged_decode, lambda: testing.make_gqa_decode_case([3232])),
    "mla_paged_prefill": (cute_attn.plan_mla_paged_prefill, lambda: testing.make_mla_prefill_case([4, 40], [9, 60])),
    "gqa_paged_multi_token_decode": (cute_attn.plan_gqa_paged_multi_token_decode,
                                     lambda: testing.make_gqa_multi_token_decode_case([4, 1], [3232, 9])),
}


@pytest.mark.parametrize("kind,arch", sorted(_PAGED))
def test_launch_matches_the_compiled_signature(kind, arch, monkeypatch):
    plan_fn, make_case = CASES[kind]
    case = make_case()
    kernel = _PAGED[(kind, arch)]
    device_plan = plan_fn(*case.inputs(), arch=arch, num_sms=8)
    _, fake_args = kernel.build(device_plan.config)
    calls = []
    monkeypatch.setattr(paged_launch, "compile_kernel", lambda config: lambda *args: calls.append(("main", args)))
    monkeypatch.setattr(combine, "compile_kernel", lambda config: lambda *args: calls.append(("combine", args)))
    out, lse = case.new_outputs()
    kernel.launch(device_plan, *case.inputs(), out, lse)
    main = [args for name, args in calls if name == "main"]
    assert len(main) == 1
    args = main[0]
    assert len(args) == len(fake_args) - 1  # the stream is the environment's
    for i, (got, fake) in enumerate(zip(args, fake_args)):
        if isinstance(got, torch.Tensor):
            assert got.dim() == len(fake.shape), f"argument {i}: rank {got.dim()} vs {fake.shape}"
            assert got.dtype == DTYPES[fake.element_type], f"argument {i}: {got.dtype} vs {fake.element_type}"
        else:
            assert isinstance(got, float), f"argument {i}: {type(got).__name__} where a Float32 scalar goes"
    merged = [args for name, args in calls if name == "combine"]
    fused = kind in FUSED_MERGE or device_plan.config.fused_merge
    assert len(merged) == (1 if device_plan.plan.num_merges and not fused else 0)
    if fused:
        assert device_plan.plan.num_merges  # the case splits: the fused path is what runs
    handed = [a for a in args if isinstance(a, torch.Tensor)]
    assert any(a is device_plan.merge_counters for a in handed) == fused
    assert any(a is device_plan.merge_indptr for a in handed) == fused
    if fused:  # right after items, in the declared order
        i = next(i for i, a in enumerate(args) if a is device_plan.items)
        assert args[i + 1] is device_plan.merge_indptr and args[i + 2] is device_plan.merge_counters


def test_merge_counters_start_at_zero_and_refresh_leaves_them_alone():
    case = testing.make_gqa_decode_case([3232])
    device_plan = cute_attn.plan_gqa_paged_decode(*case.inputs(), arch="sm_90a", num_sms=8)
    counters = device_plan.merge_counters
    assert counters.dtype == torch.int32 and counters.dim() == 1
    assert counters.numel() == max(device_plan.plan.capacity.max_merges, 1)
    assert (counters == 0).all()
    counters.fill_(7)  # stands in for a kernel's state; refresh must not rewrite it
    device_plan.refresh(device_plan.plan)
    assert (counters == 7).all()


def test_find_launcher_imports_a_kind_whose_module_is_not_loaded_yet():
    """Importing one kernel module first (as a test or an engine may) must not hide the others."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import cute_attn.kernels.sm90.gqa_decode\n"
        "from cute_attn.config import default_paged_config\n"
        "from cute_attn.kernels import find_launcher\n"
        "c = default_paged_config('gqa_paged_prefill', arch='sm_90a', num_qo_heads=32, num_kv_heads=4,"
        " head_dim_qk=128, head_dim_v=128, page_size=64, causal=True)\n"
        "launch = find_launcher(c)\n"
        "assert launch is sys.modules['cute_attn.kernels.sm90.gqa_prefill'].launch, launch\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


FUSED_CASES = {
    ("mla_paged_prefill", "sm_90a"): (cute_attn.plan_mla_paged_prefill,
                                      lambda: testing.make_mla_prefill_case([2, 3], [3000, 2000])),
    ("mla_paged_prefill", "sm_100a"): (cute_attn.plan_mla_paged_prefill,
                                       lambda: testing.make_mla_prefill_case([2, 3], [3000, 2000])),
    ("gqa_paged_prefill", "sm_90a"): (cute_attn.plan_gqa_paged_prefill,
                                      lambda: testing.make_gqa_prefill_case([2, 3], [3000, 2000])),
}


@pytest.mark.parametrize("kind, arch", sorted(FUSED_CASES))
def test_fused_merge_passes_the_merge_table_and_skips_the_combine(kind, arch, monkeypatch):
    """``fused_merge`` on a plan that splits: the kernel's ``call_fused`` entry gets ``merge_indptr,
    merge_counters`` right after ``items`` (one argument per fake compile argument), and no combine follows."""
    import dataclasses

    plan_fn, make_case = FUSED_CASES[(kind, arch)]
    case = make_case()
    device_plan = plan_fn(*case.inputs(), arch=arch, num_sms=8)
    assert device_plan.plan.num_merges
    device_plan = dataclasses.replace(device_plan, config=dataclasses.replace(device_plan.config, fused_merge=True))
    kernel = _PAGED[(kind, arch)]
    entry, fake_args = kernel.build(device_plan.config)
    assert entry.__name__ == "call_fused"
    calls = []
    monkeypatch.setattr(paged_launch, "compile_kernel", lambda config: lambda *args: calls.append(("main", args)))
    monkeypatch.setattr(combine, "compile_kernel", lambda config: lambda *args: calls.append(("combine", args)))
    out, lse = case.new_outputs()
    kernel.launch(device_plan, *case.inputs(), out, lse)
    assert [name for name, _ in calls] == ["main"]
    args = calls[0][1]
    assert len(args) == len(fake_args) - 1
    i = next(i for i, a in enumerate(args) if a is device_plan.items)
    assert args[i + 1] is device_plan.merge_indptr and args[i + 2] is device_plan.merge_counters
