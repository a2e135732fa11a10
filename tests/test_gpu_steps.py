"""tools/gpu_steps.py: each step under its own limit, its output kept, later steps still run (CPU only)."""

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_steps.py"


def test_a_step_past_its_limit_is_stopped_and_the_next_one_runs(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--budget", "30",
                          "--step", "2", "echo started; sleep 20; echo never",
                          "--step", "5", "echo second",
                          "--step", "60", "echo too long for the budget"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1  # one step timed out, one was skipped
    assert (tmp_path / "step1.log").read_text().splitlines()[-1] == "started"  # kept although it was killed
    assert "never" not in (tmp_path / "step1.log").read_text().splitlines()[1:]  # the echo after the sleep
    assert (tmp_path / "step2.log").read_text().splitlines()[-1] == "second"
    summary = (tmp_path / "steps.txt").read_text()
    assert "step 1: rc=timeout" in summary and "step 2: rc=0" in summary and "step 3: skipped" in summary
    assert summary == res.stdout


def test_all_steps_passing_exits_zero(tmp_path):
    res = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--step", "10", "true"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "step 1: rc=0" in res.stdout
