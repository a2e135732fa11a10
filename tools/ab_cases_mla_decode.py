"""``tools/ab_policy.py``'s MLA decode cases: the policies of the swapped one-token decode kernel and its plans, each
an A/B over the bench's MLA decode batches (and the batches whose host plans take the cluster shape) at each page size.
A case is ``(row, make, kind, policy)`` as ``ab_policy.POLICIES`` yields them."""

from __future__ import annotations


#: the bench's MLA decode batches (``bench.py --kernel mla_decode``) and 2 / 12 / 16 x 2048, whose host plans take the
#: cluster shape (label -> kv lengths)
CLUSTER_MERGE_CASES = {"mla_decode_n1_kv4096": [4096], "mla_decode_n16_kv4096": [4096] * 16,
                       "mla_decode_n64_kv8192": [8192] * 64, "mla_decode_n128_kv4096": [4096] * 128,
                       "mla_decode_n2_kv2048": [2048] * 2, "mla_decode_n12_kv2048": [2048] * 12,
                       "mla_decode_n16_kv2048": [2048] * 16}


def _mla_decode_policy_cases(cases: dict, pages, policy):
    """MLA decode A/B cases: ``cases`` label -> kv lengths (or "ragged": the bench's ragged batch of 64, 1..32768) at
    each page size, under ``policy(on)``."""
    import numpy as np

    from cute_attn import testing

    for label, kv_lens in cases.items():
        if kv_lens == "ragged":
            kv_lens = np.random.default_rng(64).integers(1, 32769, 64).tolist()
        for page_size in pages:
            def make(kv_lens=kv_lens, page_size=page_size):
                return testing.make_mla_decode_case(kv_lens, page_size=page_size, device="cuda", seed=9)
            yield dict(batch=label, page_size=page_size, heads=0, kv_heads=0), make, "mla_decode", policy


def _cluster_merge_cases(pages):
    """MLA decode's bench batches and 2 x 2048 (8 pieces of 256 keys a request): host plans of the cluster shape run
    the cluster fold (``ops/mla_decode.cluster_merge_policy``) or the combine launch."""
    from cute_attn.ops.mla_decode import cluster_merge_policy

    return _mla_decode_policy_cases(CLUSTER_MERGE_CASES, pages, cluster_merge_policy)


DEVICE_CLUSTER_MERGE_CASES = {**CLUSTER_MERGE_CASES, "mla_decode_n64_ragged": "ragged"}


def _device_cluster_merge_cases(pages):
    """MLA decode's bench batches (and the cluster cases): device plans launched in clusters of 2 that fold the merges
    a pair holds whole (``ops/mla_decode.device_cluster_merge_policy``), or without clusters."""
    from cute_attn.ops.mla_decode import device_cluster_merge_policy

    return _mla_decode_policy_cases(DEVICE_CLUSTER_MERGE_CASES, pages, device_cluster_merge_policy)


def _mla_line_schedule_cases(pages):
    """The one-token MLA decode default call planner-free (``ops/mla_decode.SM90_LINE_SCHEDULE``, session 38) off /
    on: the bench's MLA decode rows; only the default call moves."""
    from cute_attn.ops import mla_decode

    return _mla_decode_policy_cases(DEVICE_CLUSTER_MERGE_CASES, pages, mla_decode.line_schedule_policy)


def _mla_short_stages_cases(pages):
    """The swapped MLA decode kernel's 32-key K stages (``ops/mla_decode.SM90_SHORT_STAGES``, session 39) off / on."""
    from cute_attn.ops import mla_decode

    return _mla_decode_policy_cases(DEVICE_CLUSTER_MERGE_CASES, pages, mla_decode.short_stages_policy)
