"""Compile-only tests of the GQA row gathers dealt by 128-byte segments (``PagedAttentionConfig.row_segments``: None,
the default, and True build them; False keeps one 16-byte chunk column a lane)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cute_attn.compile import compile_to_ptx
from cute_attn.config import default_paged_config

pytestmark = pytest.mark.usefixtures("isolated_compile_cache")

ROW_COPY = re.compile(r"cp\.async\.cg\.shared\.global \[%r\d+(\+\d+)?\], \[g\], 16, %r\d+;")


def _config(kind: str, head_dim: int, page_size: int = 1):
    heads = dict(gqa_paged_decode=(20, 4), gqa_paged_prefill=(32, 4), gqa_paged_multi_token_decode=(20, 4))[kind]
    return default_paged_config(kind, arch="sm_90a", num_qo_heads=heads[0], num_kv_heads=heads[1],
                                head_dim_qk=head_dim, head_dim_v=head_dim, page_size=page_size,
                                causal=kind != "gqa_paged_decode")


@pytest.mark.parametrize("kind, head_dim", [("gqa_paged_decode", 128), ("gqa_paged_decode", 256),
                                            ("gqa_paged_prefill", 128), ("gqa_paged_multi_token_decode", 128)])
def test_segments_keep_the_copies_and_cut_the_id_shuffles(kind, head_dim):
    """Same cp.async rows a lane (a tile's bytes are the same), fewer page-id shuffles: a lane resolves one id per
    row it copies, and copies head_dim / 64 segments of it (K and V), instead of one id per 16-byte chunk column."""
    base = _config(kind, head_dim)
    assert base.row_segments is None and base.can_implement() is None
    segments = compile_to_ptx(base)  # the policy: segments
    columns = compile_to_ptx(dataclasses.replace(base, row_segments=False))
    assert "_RowSeg" in segments and "_RowSeg" not in columns
    assert compile_to_ptx(dataclasses.replace(base, row_segments=True)) == segments
    assert len(ROW_COPY.findall(segments)) == len(ROW_COPY.findall(columns)) > 0
    shuffles = [len(re.findall(r"shfl\.sync\.idx\.b32", ptx)) for ptx in (columns, segments)]
    assert shuffles[1] < shuffles[0] and shuffles[1] * (head_dim // 64) <= shuffles[0] + 16, shuffles


def test_segments_change_nothing_where_a_row_is_one_segment_or_pages_are_boxes():
    """head_dim 64 rows are one 128-byte segment (the two deals coincide), and page 64 has no row gather."""
    d64 = _config("gqa_paged_decode", 64)
    box = _config("gqa_paged_decode", 128, page_size=64)
    for config in (d64, box):
        plain = compile_to_ptx(dataclasses.replace(config, row_segments=False))
        seg = compile_to_ptx(config)
        assert re.sub(r"_RowSeg", "", seg) == plain or len(ROW_COPY.findall(seg)) == len(ROW_COPY.findall(plain))
