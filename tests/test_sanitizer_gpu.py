"""compute-sanitizer on the GPU tier: the decode kernel's warpgroup hand-over is racecheck-clean.

The hand-over case (``edge-decode``: a partial last tile on warpgroup 1) is the one where racecheck used to
report a hazard (``docs/perf/h200-sanitizer.txt``); ``tools/sanitize.py`` runs every kernel under all four tools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer on PATH"),
]


def test_decode_handover_is_racecheck_clean(tmp_path):
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sanitize.py"), "--tools", "racecheck",
         "--cases", "edge-decode,decode-h20kv4-p64", "--out", str(tmp_path / "summary.txt")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    summary = (tmp_path / "summary.txt").read_text() if (tmp_path / "summary.txt").exists() else proc.stdout
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    assert "0 hazards (0 errors, 0 warnings), 2/2 cases ran" in summary, summary
