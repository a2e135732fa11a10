"""cute_attn: paged-attention kernels for LLM serving, written in NVIDIA CuTe DSL.

Entry points follow the FlashInfer-Bench definitions (inputs in definition order, then the optional
destination ``output, lse``); LSE is base 2 unless ``natural_lse=True``. ``cute_attn.reference`` holds the
float32 references of the three definitions (torch only), e.g. to check a kernel's output in an engine.
Importing the package also registers the ``torch.ops.cute_attn`` custom ops for ``torch.compile``
(``torch_ops.py``: ~12 ms, no DSL). ``cute_attn.flashinfer`` holds FlashInfer-compatible wrapper classes and
``cute_attn.tuning`` a knob sweep for notebooks (both imported on demand).
"""

from . import reference
from .api import DevicePlan, clear_plan_cache
from .device_errors import DeviceIndexError, raise_on_device_error
from .ops.gqa_decode import gqa_paged_decode, plan_gqa_paged_decode
from .ops.gqa_multi_token_decode import gqa_paged_multi_token_decode, plan_gqa_paged_multi_token_decode
from .ops.gqa_prefill import gqa_paged_prefill, plan_gqa_paged_prefill
from .ops.mla_decode import mla_paged_decode, plan_mla_paged_decode
from .ops.mla_prefill import mla_paged_prefill, plan_mla_paged_prefill
from .plan import PlanCapacity, PlanConfig, WorkPlan, plan_work
from . import torch_ops  # registers torch.ops.cute_attn.*; after the entry points, which it calls

__all__ = [
    "DeviceIndexError",
    "DevicePlan",
    "PlanCapacity",
    "PlanConfig",
    "WorkPlan",
    "clear_plan_cache",
    "gqa_paged_decode",
    "gqa_paged_multi_token_decode",
    "gqa_paged_prefill",
    "mla_paged_decode",
    "mla_paged_prefill",
    "plan_gqa_paged_decode",
    "plan_gqa_paged_multi_token_decode",
    "plan_gqa_paged_prefill",
    "plan_mla_paged_decode",
    "plan_mla_paged_prefill",
    "plan_work",
    "raise_on_device_error",
    "reference",
    "torch_ops",
]
__version__ = "0.1.0"
