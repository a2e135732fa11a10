"""What the family shapes cost next to the definitions' own (GPU, one call, ours only; no peer in the process).

    python tools/family_study.py --json docs/perf/h200-family-study.json

- decode, 64 requests x 2048 keys, h20/kv4, d128, at page sizes 16 / 32 / 64 / 128 (one page per ring stage):
  GPU span after the bench's dirty flush and after a clean (read-only) flush, and the K/V bandwidth;
- prefill, 4 requests x 992 queries over 992 keys: group 8 (h32/kv4, the definition) against group 5 (h20/kv4:
  the Q box fills 125 of 128 rows), as TFLOP/s of the causal work.
Every shape is checked against the float32 reference first. Cold L2, median of 50 (cute_attn.timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _decode_rows(timer_dirty, timer_clean):
    import torch

    import cute_attn
    from cute_attn import testing

    rows = []
    for page in (16, 32, 64, 128):
        case = testing.make_gqa_decode_case([2048] * 64, page_size=page, device="cuda", seed=page)
        out, lse = case.new_outputs()
        cute_attn.gqa_paged_decode(*case.inputs(), out, lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")

        def run():
            cute_attn.gqa_paged_decode(*case.inputs(), out, lse)

        kv_bytes = 2 * 64 * 2048 * case.k_cache.shape[2] * case.k_cache.shape[3] * 2
        dirty, clean = timer_dirty(run), timer_clean(run)
        rows.append(dict(kind="decode", page_size=page, batch=64, kv=2048, gpu_us_dirty=dirty.gpu_us,
                         gpu_us_clean=clean.gpu_us, wall_us=dirty.wall_us,
                         tb_per_s_dirty=kv_bytes / dirty.gpu_us / 1e6 if dirty.gpu_us else None))
        print(rows[-1], flush=True)
    return rows


def _prefill_rows(timer_dirty):
    import torch

    import cute_attn
    from cute_attn import testing

    rows = []
    for hq, hkv in ((32, 4), (20, 4)):
        case = testing.make_gqa_prefill_case([992] * 4, [992] * 4, num_qo_heads=hq, num_kv_heads=hkv, device="cuda",
                                             seed=hq)
        out, lse = case.new_outputs()
        cute_attn.gqa_paged_prefill(*case.inputs(), out, lse)
        torch.cuda.synchronize()
        ref_out, ref_lse = case.reference()
        testing.assert_close_benchmark(out, ref_out, "output")
        testing.assert_close_benchmark(lse, ref_lse, "lse")

        def run():
            cute_attn.gqa_paged_prefill(*case.inputs(), out, lse)

        t = timer_dirty(run)
        flops = 4 * 4 * hq * 128 * (992 * 993 / 2)  # causal: QK^T and PV, 2 flops per MAC
        rows.append(dict(kind="prefill", num_qo_heads=hq, num_kv_heads=hkv, group=hq // hkv, gpu_us_dirty=t.gpu_us,
                         tflops=flops / t.gpu_us / 1e6 if t.gpu_us else None))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from cute_attn.timing import ColdL2Timer

    if not torch.cuda.is_available():
        print("tools/family_study.py needs a CUDA GPU; none here, nothing written")
        return 2
    torch.cuda.init()
    dirty, clean = ColdL2Timer(flush_mode="dirty"), ColdL2Timer(flush_mode="clean")
    rows = _decode_rows(dirty, clean) + _prefill_rows(dirty)
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), iters=50,
                note="ours only, cold L2 (dirty = the bench's zeroing flush, clean = a read-only flush)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
