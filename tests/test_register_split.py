"""The setmaxnreg splits of the warp-specialised kernels: the increases are paid for by the decreases."""

import pytest

from cute_attn.kernels.common.registers import launch_registers, register_split_reason


def test_launch_registers_follow_the_register_file():
    assert launch_registers(384) == 168 and launch_registers(256) == 248 and launch_registers(128) == 248


def test_a_split_the_decreases_cannot_pay_for_is_refused():
    """The H200 hang: a row-gathering producer at 32 beside consumers at 240 (384 threads launch at 168)."""
    reason = register_split_reason([(128, 32), (256, 240)])
    assert reason is not None and "18432" in reason and "17408" in reason and "wait forever" in reason
    assert register_split_reason([(128, 24), (256, 240)]) is None  # exactly paid for


def test_the_shipped_splits_fit():
    from cute_attn.kernels.sm100 import gqa_prefill as sm100_prefill
    from cute_attn.kernels.sm100 import mla_prefill as sm100_mla
    from cute_attn.kernels.sm90 import gqa_prefill, mla_prefill

    assert register_split_reason([(128, gqa_prefill.PRODUCER_REGS), (256, gqa_prefill.CONSUMER_REGS)]) is None
    assert register_split_reason([(mla_prefill.PRODUCER_THREADS, mla_prefill.PRODUCER_REGS),
                                  (mla_prefill.MMA_THREADS, mla_prefill.MMA_REGS)]) is None
    for other in (sm100_prefill._REGS_OTHER, sm100_prefill._REGS_OTHER_D256):
        assert register_split_reason([(128, sm100_prefill._REGS_SOFTMAX), (128, sm100_prefill._REGS_CORRECTION),
                                      (128, other)]) is None
    # 512 threads (launched at 128): the load and MMA warpgroups pay for softmax and correction exactly
    assert register_split_reason([(128, sm100_mla._REGS_SOFTMAX), (128, sm100_mla._REGS_CORRECTION),
                                  (256, sm100_mla._REGS_OTHER)]) is None


@pytest.mark.parametrize("page_size", [1, 2, 64])
def test_prefill_configs_check_the_split(page_size, monkeypatch):
    from cute_attn.config import default_paged_config
    from cute_attn.kernels.sm90 import gqa_prefill

    config = default_paged_config("gqa_paged_prefill", arch="sm_90a", num_qo_heads=32, num_kv_heads=4,
                                  head_dim_qk=128, head_dim_v=128, page_size=page_size, causal=True)
    assert gqa_prefill.check_config(config) is None
    monkeypatch.setattr(gqa_prefill, "PRODUCER_REGS", 32)
    assert "wait forever" in gqa_prefill.check_config(config)
