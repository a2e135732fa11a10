"""Two processes compiling one config into one cold disk cache at the same moment (no GPU needed).

Serving starts several workers on one machine, each compiling on first use into the shared
``$CUTE_ATTN_CACHE_DIR``. The compile path holds a file lock around check-compile-write, so exactly one
of them compiles, the other loads its ``.o``, and the cache ends with one complete entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cute_attn.compile import CACHE_DIR_ENV, disk_key
from cute_attn.config import default_paged_config

REPO = Path(__file__).resolve().parent.parent

CONFIG = dict(kind="gqa_paged_decode", arch="sm_90a", num_qo_heads=20, num_kv_heads=4, head_dim_qk=128,
              head_dim_v=128, page_size=64, causal=False)

# Each worker imports everything first (the DSL import takes seconds), says it is ready, and compiles only
# when the test says go: the two compiles start together instead of one process finishing first.
WORKER = r"""
import json, sys, time
from pathlib import Path
import cute_attn.kernels.sm90.gqa_decode  # registers the decode kernel
from cute_attn.compile import compile_kernel_with_info
from cute_attn.config import default_paged_config

config = default_paged_config(**json.loads(sys.argv[1]))
rendezvous = Path(sys.argv[2]) if len(sys.argv) > 2 else None
if rendezvous is not None:
    (rendezvous / f"ready-{sys.argv[3]}").touch()
    deadline = time.monotonic() + 300
    while not (rendezvous / "go").exists():
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.005)
info = compile_kernel_with_info(config)
print(json.dumps(dict(source=info.source, object=str(info.object_path), ptx=str(info.ptx_path))))
"""


def _worker(cache: Path, *rendezvous: str) -> subprocess.Popen:
    env = dict(os.environ, **{CACHE_DIR_ENV: str(cache)})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(CONFIG), *rendezvous], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_two_processes_compile_one_config_into_a_cold_cache(tmp_path):
    cache, rendezvous = tmp_path / "cache", tmp_path / "rendezvous"
    rendezvous.mkdir()
    workers = [_worker(cache, str(rendezvous), str(n)) for n in range(2)]
    try:
        deadline = time.monotonic() + 300
        while len(list(rendezvous.glob("ready-*"))) < 2:
            assert time.monotonic() < deadline, "workers never got ready"
            assert all(w.poll() is None for w in workers), "a worker died before the compile"
            time.sleep(0.01)
        (rendezvous / "go").touch()
        results = [_result(w) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    # the lock let exactly one compile; the other waited and loaded what it wrote
    assert sorted(r["source"] for r in results) == ["compiled", "disk"], results
    digest = disk_key(default_paged_config(**CONFIG))
    assert {r["object"] for r in results} == {str(next(cache.rglob(f"{digest}.o")))}
    folder = Path(results[0]["object"]).parent
    entries = sorted(p.name for p in folder.iterdir() if p.suffix != ".lock")
    assert entries == [f"{digest}.o", f"{digest}.ptx"], entries  # no second entry, no temp file left behind
    assert ".target sm_90a" in (folder / f"{digest}.ptx").read_text()
    # a third process, later, finds a loadable entry
    assert _result(_worker(cache))["source"] == "disk"
