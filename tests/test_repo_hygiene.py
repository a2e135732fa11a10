"""The repository stays small enough to travel to the GPU machine (64 MB with a 57 MB bundle)."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def test_notebooks_are_committed_without_outputs():
    for path in ROOT.glob("notebooks/*.ipynb"):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: strip outputs"


def test_no_large_or_binary_build_files_are_tracked():
    for path in tracked_files():
        assert path.suffix not in {".o", ".so", ".cubin", ".whl", ".xz"}, f"build output tracked: {path}"
        limit = 200_000 if path.suffix == ".png" else 1_000_000
        assert path.stat().st_size < limit, f"{path} is {path.stat().st_size} bytes"


def test_source_files_stay_under_800_lines():
    for path in ROOT.glob("cute_attn/**/*.py"):
        n = len(path.read_text().splitlines())
        assert n <= 800, f"{path.relative_to(ROOT)} has {n} lines: split it by role"
