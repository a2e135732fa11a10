"""Compile every registered kernel config for one arch (no GPU needed).

    python tools/compile_all.py --arch sm_90a [--ptx-dir DIR]

Prints one line per config (name, seconds, compiled / disk / memory), writes
``<name>.ptx`` per config into ``--ptx-dir`` if given, exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cute_attn.arch import SUPPORTED_ARCHS, normalize_arch  # noqa: E402
from cute_attn.compile import (  # noqa: E402
    compile_kernel_with_info,
    compile_to_ptx,
    registered_configs,
)


def _file_name(key: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.=-]+", "_", key.replace("'", "")).strip("_")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, help=f"one of {', '.join(SUPPORTED_ARCHS)}")
    parser.add_argument("--ptx-dir", type=Path, default=None, help="write <name>.ptx here")
    args = parser.parse_args(argv)
    try:
        arch = normalize_arch(args.arch)
    except ValueError as exc:
        parser.error(str(exc))

    try:
        configs = registered_configs(arch)
    except Exception:
        traceback.print_exc()
        print("FAILED to import the kernel modules", file=sys.stderr)
        return 1
    if args.ptx_dir is not None:
        args.ptx_dir.mkdir(parents=True, exist_ok=True)

    failures = 0
    for config in configs:
        name = config.cache_key()
        start = time.perf_counter()
        try:
            info = compile_kernel_with_info(config)
            if args.ptx_dir is not None:
                (args.ptx_dir / f"{_file_name(name)}.ptx").write_text(compile_to_ptx(config))
        except Exception as exc:
            failures += 1
            print(f"FAIL     {time.perf_counter() - start:7.2f}s  {name}: {exc}", flush=True)
            traceback.print_exc()
            continue
        print(f"{info.source:<8} {time.perf_counter() - start:7.2f}s  {name}", flush=True)
    print(f"{len(configs) - failures}/{len(configs)} configs OK for {arch}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
