"""FlashInfer-Bench's own definitions judge our float32 reference (CPU tier).

For every gqa/mla paged definition that one of our entries serves, the definition's ``reference`` (the code
FlashInfer-Bench scores with) and ours agree on ragged batches over shuffled NaN-poisoned pools with the
definition's constants: ours is then a faithful oracle for the kernels. The definitions live in
``../shared/spec/fib-definitions`` (never copied in); without them this module skips, unless
``CUTE_ATTN_REQUIRE_FIB_DEFINITIONS=1`` (CI sets it: shared/ is beside CI's clone).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fib_definitions as fib  # noqa: E402

from cute_attn import testing  # noqa: E402

DEFINITIONS = fib.load_all()
if not DEFINITIONS:
    if os.environ.get("CUTE_ATTN_REQUIRE_FIB_DEFINITIONS") == "1":
        raise RuntimeError("FlashInfer-Bench definitions not found (../shared/spec/fib-definitions)")
    pytest.skip("FlashInfer-Bench definitions not found beside the checkout", allow_module_level=True)

SERVED = [d for d in DEFINITIONS if fib.entry_for(d).kind is not None]
BATCH = ([3, 1, 0, 17], [40, 1, 5, 17])  # q_lens, kv_lens: kv > q, a single key, an empty request, kv == q


def test_all_43_paged_definitions_are_there():
    names = {d["name"] for d in DEFINITIONS}
    assert len(names) == 43 and sum(n.startswith("gqa_paged") for n in names) == 37


@pytest.mark.parametrize("definition", SERVED, ids=lambda d: d["name"])
def test_our_reference_agrees_with_the_definitions(definition):
    from cute_attn.ops import get_spec

    case, inputs = fib.case_for(definition, *BATCH, seed=len(definition["name"]))
    theirs_out, theirs_lse = fib.reference_of(definition)(**inputs)
    ours_out, ours_lse = get_spec(fib.entry_for(definition).kind).reference(*case.inputs())
    testing.assert_close_benchmark(ours_out, theirs_out, "output")
    # rows that see no key: ours says lse -inf, theirs may leave -inf or 0 untouched; compare where both see keys
    seen = torch.isfinite(theirs_lse) & torch.isfinite(ours_lse)
    testing.assert_close_benchmark(ours_lse[seen], theirs_lse[seen], "lse")
    assert seen.sum() >= ours_lse.numel() // 2  # most rows see keys in this batch: the comparison is not empty
