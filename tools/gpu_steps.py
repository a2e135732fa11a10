"""Run a device call's steps one after another, each under its own time limit, keeping every step's output.

    python tools/gpu_steps.py --out $OUT --budget 540 \
        --step 120 "python -m pytest -q tests/test_gqa_prefill_gpu.py -k page" \
        --step 60 "python tools/sanitize.py --tools memcheck,racecheck --cases mla --out $OUT/sanitizer.txt" \
        --step 120 "python tools/bench.py --kernel mla --impls cute_attn_planned --png= --json $OUT/bench.json"

Why: a device call that runs past its limit returns only what is under ``$OUT``, and a pipeline's buffered
output is lost with it (session 8 lost a whole call that way). Here each step writes ``$OUT/step<N>.log`` as it
runs (unbuffered), a step that runs past its own limit is stopped and the next one starts, and a step is skipped
when the remaining ``--budget`` cannot hold its limit. The summary (``$OUT/steps.txt``, also printed) gives each
step's exit status, seconds and last lines.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the logs go (default $OUT)")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for all steps (the call's limit, less slack)")
    ap.add_argument("--tail", type=int, default=6, help="last lines of each step in the summary")
    ap.add_argument("--step", nargs=2, action="append", metavar=("SECONDS", "COMMAND"), default=[],
                    help="a shell command and its time limit; repeat, in order")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    summary, failed = [], 0
    for n, (limit, command) in enumerate(args.step, 1):
        limit = float(limit)
        left = args.budget - (time.monotonic() - start)
        log_path = os.path.join(args.out, f"step{n}.log")
        if limit > left:
            summary.append(f"step {n}: skipped ({left:.0f} s left, needs {limit:.0f}): {command}")
            failed += 1
            continue
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {command}\n")
            log.flush()
            proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its own process group: a timeout stops all of it
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        seconds = time.monotonic() - t0
        with open(log_path) as log:
            tail = log.read().splitlines()[-args.tail:]
        failed += rc != 0
        summary.append(f"step {n}: rc={rc} in {seconds:.0f} s: {command}\n" + "\n".join(f"    {t}" for t in tail))
    text = "\n".join(summary) + "\n"
    with open(os.path.join(args.out, "steps.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
