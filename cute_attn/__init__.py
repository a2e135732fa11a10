"""cute_attn: paged-attention kernels for LLM serving, written in NVIDIA CuTe DSL.

Entry points follow the FlashInfer-Bench definitions (inputs in definition order, then the optional
destination ``output, lse``); LSE is base 2 unless ``natural_lse=True``. ``cute_attn.reference`` holds the
float32 references of the three definitions (torch only), e.g. to check a kernel's output in an engine.
"""

from . import reference
from .api import (
    DevicePlan,
    clear_plan_cache,
    gqa_paged_decode,
    gqa_paged_prefill,
    mla_paged_prefill,
    plan_gqa_paged_decode,
    plan_gqa_paged_prefill,
    plan_mla_paged_prefill,
)
from .plan import PlanCapacity, PlanConfig, WorkPlan, plan_work

__all__ = [
    "DevicePlan",
    "PlanCapacity",
    "PlanConfig",
    "WorkPlan",
    "clear_plan_cache",
    "gqa_paged_decode",
    "gqa_paged_prefill",
    "mla_paged_prefill",
    "plan_gqa_paged_decode",
    "plan_gqa_paged_prefill",
    "plan_mla_paged_prefill",
    "plan_work",
    "reference",
]
__version__ = "0.1.0"
