"""``cute_attn.testing.refill_page_table``: the capacity index tensors a captured step is replayed with."""

from __future__ import annotations

import numpy as np
import torch

from cute_attn import testing


def test_refill_page_table_describes_the_batch():
    lens, page_size, pool = [0, 65, 128, 1], 64, 10
    kv_indptr = torch.full((5,), -7, dtype=torch.int32)
    kv_indices = torch.full((pool,), -7, dtype=torch.int32)
    last = torch.full((4,), -7, dtype=torch.int32)
    testing.refill_page_table(lens, page_size, kv_indptr, kv_indices, last, np.random.default_rng(3))
    assert kv_indptr.tolist() == [0, 0, 2, 4, 5]
    assert last.tolist() == [0, 1, 64, 1]
    used = kv_indices[:5].tolist()
    assert used == np.random.default_rng(3).permutation(pool)[:5].tolist()  # the same draw as the rng's own
    assert len(set(used)) == 5 and all(0 <= i < pool for i in used)
    assert kv_indices[5:].tolist() == [0] * 5
    from cute_attn.reference import _paged_kv_lens

    assert _paged_kv_lens(kv_indptr, last, page_size) == lens
    testing.refill_page_table([0, 3], 1, kv_indptr[:3], kv_indices, last[:2], np.random.default_rng(0), empty_last=1)
    assert last[:2].tolist() == [1, 1] and kv_indptr[:3].tolist() == [0, 0, 3]
