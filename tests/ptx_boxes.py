"""PTX reading shared by the small-page compile tests: where the raw TMA page boxes land (``common/tma_issue.py``)."""

import re


def raw_box_offsets(ptx: str, rank: str = r"\d") -> list[int]:
    """Byte offsets, sorted, of the ``add.s32`` results taken from the first raw page box's stage base, relative to
    that box (one elected lane issues a stage's boxes: addresses are the first box's base plus constants).

    ``rank``: the box's dimension count as a regex (``"3"`` for one-row pages with several KV heads); the raw boxes
    are the ones without the DSL's ``.L2::cache_hint``."""
    first_box = re.search(rf"cp\.async\.bulk\.tensor\.{rank}d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes"
                          r"\s+\[(%r\d+)\]", ptx).group(1)
    base = re.search(rf"add\.s32\s+{first_box}, (%r\d+), (\d+);", ptx)  # the stage base plus a constant, or none
    base_reg, first = (base.group(1), int(base.group(2))) if base else (first_box, 0)
    return sorted(int(m) - first for m in re.findall(rf"add\.s32\s+%r\d+, {base_reg}, (\d+);", ptx))
