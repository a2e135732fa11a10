"""Every FlashInfer-Bench paged definition our kernels build, judged on the GPU by the definition's own reference.

The definitions come from ``../shared/spec/fib-definitions`` (a GPU run carries a copy as ``.fibdefs/``); those no
kernel builds skip with the kernel's reason (``python tools/fib_definitions.py`` lists them per arch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fib_definitions as fib  # noqa: E402

from cute_attn import testing  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEFINITIONS = [d for d in fib.load_all() if fib.entry_for(d).kind is not None]
BATCHES = [([300, 1, 0, 64], [1500, 1, 9, 64]), ([1] * 5, [3232, 1, 0, 700, 64])]


@pytest.mark.parametrize("batch", BATCHES, ids=["prefill-like", "one-token"])
@pytest.mark.parametrize("definition", DEFINITIONS, ids=lambda d: d["name"])
def test_kernel_passes_the_definitions_reference(definition, batch):
    import cute_attn
    from cute_attn.arch import resolve_arch

    torch.cuda.init()
    config = fib.config_for(definition, resolve_arch(None))
    reason = config.can_implement()
    if reason is not None:
        pytest.skip(f"not built: {reason}")
    case, inputs = fib.case_for(definition, *batch, device="cuda", seed=len(definition["name"]))
    out, lse = case.new_outputs()
    if definition["name"].startswith("mla_paged_decode"):  # the decode entry, in the definition's own order
        cute_attn.mla_paged_decode(*inputs.values(), out, lse)
    else:
        getattr(cute_attn, config.kind)(*case.inputs(), out, lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = fib.reference_of(definition)(**inputs)
    testing.assert_close_benchmark(out, ref_out, "output")
    seen = torch.isfinite(ref_lse)  # the definition's harness has no row that sees no key; ours gives -inf there
    testing.assert_close_benchmark(lse[seen], ref_lse[seen], "lse")
    assert bool(torch.isneginf(lse[~seen]).all())
