"""SASS of a device planner's source lines, on a machine without a GPU: the planner built with line info, ``ptxas``
to a cubin, ``nvdisasm`` with its line table, and the instructions of the chosen lines printed block by block.

    python tools/planner_sass.py --planner gqa_prefill --file sorted_deal.py --lines 455-463
    python tools/planner_sass.py --planner decode --file planner_lists.py --lines 20-60 --arch sm_100a --summary

Why: the planner is one latency-bound CTA, and what a phase costs a lap or a row is decided by how its loads issue
(session 28: the turned loads' shared-memory loads sit behind a branch each, so the ×4 unroll did not overlap them).
Needs ``ptxas`` (on PATH) and ``nvdisasm`` (PATH, ``$NVDISASM``, or ``pip install nvidia-cuda-nvdisasm``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLANNERS = {"decode": 0, "gqa_prefill": 1, "mla_prefill": 2}  # device_planner.default_configs order
LINE_TAG = re.compile(r'//## File "(?P<file>[^"]+)", line (?P<line>\d+)')
GAP = 40  # instructions without a chosen line that end a stretch


def find_nvdisasm() -> str:
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]
    try:
        import nvidia  # the pip wheel nvidia-cuda-nvdisasm

        for root in nvidia.__path__:
            candidates += glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))
    except ImportError:
        pass
    for path in candidates:
        if path and os.path.exists(path):
            return path
    sys.exit("nvdisasm not found: set $NVDISASM, or pip install nvidia-cuda-nvdisasm")


def build_ptx(planner: str, arch: str, cache_dir: str) -> str:
    """The planner's PTX with line info, built in a fresh cache (a cached build may lack it)."""
    os.environ.update(CUTE_DSL_LINEINFO="1", CUTE_DSL_ARCH=arch, CUTE_ATTN_ARCH=arch, CUTE_ATTN_CACHE_DIR=cache_dir)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cute_attn.compile import compile_to_ptx
    from cute_attn.kernels.common import device_planner

    return compile_to_ptx(device_planner.default_configs(arch)[PLANNERS[planner]])


def sass_lines(ptx: str, arch: str, work: str) -> list[str]:
    ptx_path, cubin = os.path.join(work, "planner.ptx"), os.path.join(work, "planner.cubin")
    Path(ptx_path).write_text(ptx)
    subprocess.run(["ptxas", f"-arch={arch}", "-O3", "-lineinfo", ptx_path, "-o", cubin], check=True)
    out = subprocess.run([find_nvdisasm(), "-c", "-g", cubin], check=True, capture_output=True, text=True).stdout
    return out.splitlines()


def tagged(lines: list[str]) -> list[tuple[str, int, str]]:
    """(source file, line, instruction) of every instruction, by the line tag before it."""
    out, file, line = [], "", 0
    for text in lines:
        tag = LINE_TAG.search(text)
        if tag:
            file, line = tag["file"], int(tag["line"])
            continue
        instruction = re.sub(r"/\*[0-9a-f]+\*/", "", text).strip()
        if instruction and not instruction.startswith((".", "//")):
            out.append((file, line, instruction))
    return out


def blocks_of(code: list[tuple[str, int, str]], file_part: str, first: int, last: int, gap: int = GAP):
    """Stretches of ``code`` around the instructions of ``file_part`` lines ``first..last``: one stretch per inlined
    copy (instructions of other lines between them kept, as they run there), split where ``gap`` instructions pass
    without one of those lines."""
    hits = [i for i, (file, line, _) in enumerate(code) if file_part in file and first <= line <= last]
    stretches = []
    for i in hits:
        if stretches and i - stretches[-1][1] <= gap:
            stretches[-1][1] = i
        else:
            stretches.append([i, i])
    return [code[a:b + 1] for a, b in stretches]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planner", choices=sorted(PLANNERS), default="gqa_prefill")
    ap.add_argument("--arch", default="sm_90a", choices=["sm_90a", "sm_100a"])
    ap.add_argument("--file", required=True, help="a source file name (or part of its path), e.g. sorted_deal.py")
    ap.add_argument("--lines", required=True, help="first-last source lines, e.g. 455-463")
    ap.add_argument("--summary", action="store_true", help="counts of loads, branches and barriers per block only")
    args = ap.parse_args(argv)
    first, last = (int(x) for x in args.lines.split("-"))
    with tempfile.TemporaryDirectory() as work:
        lines = sass_lines(build_ptx(args.planner, args.arch, os.path.join(work, "cache")), args.arch, work)
    blocks = blocks_of(tagged(lines), args.file, first, last)
    print(f"# {args.planner} planner, {args.arch}: {len(blocks)} stretches of {args.file}:{first}-{last} "
          "(one per inlined copy)")
    for n, block in enumerate(blocks):
        ops = [instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]
               for _, _, instruction in block]
        kinds = {k: sum(op.startswith(k) for op in ops) for k in ("LDS", "STS", "LDG", "BRA", "BAR", "BSSY")}
        print(f"## stretch {n}: {len(block)} instructions, " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
        if not args.summary:
            for file, line, instruction in block:
                print(f"  {Path(file).name}:{line:<5d} {instruction}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
