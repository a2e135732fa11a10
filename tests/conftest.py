"""Shared test setup: the hypothesis profile (ci or fuzz) and the `gpu` marker's skip rule."""

import pytest

from cute_attn.testing import load_hypothesis_profile

load_hypothesis_profile()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install must skip the tier, not crash collection
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
