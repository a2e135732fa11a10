"""The device planner's build policies: inside each block every planner is built (and launched) another way, for
A/Bs, GPU tests and sanitizer cases. Each sets :mod:`device_planner`'s module globals, which
``DevicePlannerConfig.for_plan`` and the launch rule read, and clears the config and plan caches on the way in and out
(``ops.policy``)."""

from __future__ import annotations

import contextlib


def _planner():
    from . import device_planner

    return device_planner


@contextlib.contextmanager
def q_tile_pass_policy(per_pass: int):
    """Inside the block every device planner is built with ``q_tiles_per_pass=per_pass`` (GPU tests, A/Bs)."""
    from ...ops import policy  # the spec policies' save / clear caches / restore

    with policy(vars(_planner()), Q_TILES_PER_PASS=int(per_pass)):
        yield


@contextlib.contextmanager
def deal_one_site_policy(enabled: bool = True):
    """Inside the block every deal-first planner is built with the deal's code at one call site (GPU tests, A/Bs)."""
    from ...ops import policy

    with policy(vars(_planner()), DEAL_ONE_SITE=bool(enabled)):
        yield


@contextlib.contextmanager
def lap_lists_policy(enabled: bool = True):
    """Inside the block every planner builds a dealt plan's rows by (lap, CTA) slots in one pass (GPU tests, A/Bs)."""
    from ...ops import policy

    with policy(vars(_planner()), LAP_LISTS=bool(enabled)):
        yield


@contextlib.contextmanager
def row_writers_policy(writers: int, rows_per_writer: int | None = None):
    """Inside the block every planner has ``row_writers=writers``, a launch one writer a ``rows_per_writer`` rows."""
    from ...ops import policy

    rows = _planner().ROWS_PER_WRITER if rows_per_writer is None else int(rows_per_writer)
    with policy(vars(_planner()), ROW_WRITERS=int(writers), ROWS_PER_WRITER=rows):
        yield


@contextlib.contextmanager
def late_scan_policy(scan_last: bool = False):
    """Inside the block every device planner takes the late way (``planner_scan.py``: the last CTA to arrive empties
    the faulted requests' items), as when the page scan outlasts the plan (GPU tests, the sanitizer); ``scan_last``:
    the scan CTAs also wait 50 us before they arrive, so the one that empties the items is a scan CTA."""
    from ...ops import policy

    with policy(vars(_planner()), LATE_SCAN=True, SCAN_DELAY_NS=50_000 if scan_last else 0):
        yield


@contextlib.contextmanager
def count_sort_policy(enabled: bool = True):
    """Inside the block every sorting planner ranks few-valued keys by counting (``count_sort.py``) instead of the
    bitonic sort (GPU tests, A/Bs)."""
    from ...ops import policy

    with policy(vars(_planner()), COUNT_SORT=bool(enabled)):
        yield
