"""PTX reading for the MLA load role's row ids (common/mla.py), shared by the sm_90a and sm_100a compile tests."""

import re

# a key's page id checked against [0, num_pages) before it becomes a row id: two compares, two selects of -1 (the
# row arithmetic of page and slot may be scheduled between them)
BOUNDS_CHECK = re.compile(r"setp\.gt\.s32\s+(%p\d+), (%r\d+), -1;\s*setp\.gt\.s32\s+(%p\d+), %r\d+, \2;"
                          r"(?:\s*(?:(?:shl|and|or)\.b32|add\.s32)[^;]*;)*\s*"
                          r"selp\.b32\s+(%r\d+), %r\d+, -1, \3;\s*selp\.b32\s+%r\d+, \4, -1, \1;")


def prefetched_bounds_checks(ptx: str) -> int:
    """How many bounds checks test a page id that was loaded a tile earlier: the checked register is a copy
    (``mov``, the loop's rotation) of a register an ``ld.global`` filled, not that load's own target."""
    loaded = set(re.findall(r"ld\.global\.b32\s+(%r\d+), \[%rd\d+\];", ptx))
    count = 0
    for m in BOUNDS_CHECK.finditer(ptx):
        page = m.group(2)
        if any(re.search(rf"mov\.b32\s+{re.escape(page)}, {re.escape(r)};", ptx) for r in loaded):
            count += 1
    return count
