"""A/B of small-page decode's line deal (``ops/gqa_decode.LINE_DEAL_PAGE_SIZES``) in one process, on a GPU.

    python tools/ab_line_deal.py [--json OUT] [--pages 1 16 64]

For each decode batch, page size and head layout: the device plan without and with the line deal (each checked against
the float32 reference), timed as the bench times its rows (cold L2, median of 50 CUPTI spans): the call with the plan
made once (``plan_gqa_paged_decode(on_device=True)``, the bench's ``cute_attn_device_planned``), the default call (plans
on every call: ``cute_attn``), and the host-planned call for reference (``cute_attn_planned``).
Prediction (session 15): page-1 device-planned 64 x 2048 h20/kv4 84.5 -> ~79 us (the host plan's 79.1), the default
call -5 us; page 64 unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = {"n64_kv2048": [2048] * 64, "n128_kv4096": [4096] * 128, "n37_ragged": None}
LAYOUTS = ((20, 4), (24, 8), (32, 16))


def _ragged():
    import numpy as np

    return np.random.default_rng(37).integers(1, 9000, 37).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args(argv)
    import torch

    import cute_attn
    from cute_attn import testing
    from cute_attn.ops import gqa_decode
    from cute_attn.timing import ColdL2Timer

    if not torch.cuda.is_available():
        print("ab_line_deal: needs a CUDA GPU")
        return 0
    timer = ColdL2Timer()
    rows = []
    for label, kv_lens in BATCHES.items():
        kv_lens = kv_lens or _ragged()
        for page_size in args.pages:
            for heads, kv_heads in LAYOUTS:
                case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=heads, num_kv_heads=kv_heads,
                                                    page_size=page_size, device="cuda", seed=len(kv_lens))
                ref_out, ref_lse = case.reference()
                inputs = tuple(case.inputs())
                for policy in ((), (page_size,)):
                    with gqa_decode.line_deal_policy(policy):
                        row = dict(batch=label, page_size=page_size, heads=heads, kv_heads=kv_heads,
                                   line_deal=bool(policy))
                        plans = dict(device_planned=cute_attn.plan_gqa_paged_decode(*inputs, on_device=True),
                                     default=None)
                        if not policy:
                            plans["planned"] = cute_attn.plan_gqa_paged_decode(*inputs)
                        for mode, plan in plans.items():
                            out, lse = case.new_outputs()
                            kw = {} if plan is None else dict(plan=plan)

                            def run(out=out, lse=lse, kw=kw):
                                cute_attn.gqa_paged_decode(*inputs, out, lse, **kw)

                            run()
                            torch.cuda.synchronize()
                            testing.assert_close_benchmark(out, ref_out, f"{label} p{page_size} {mode} output")
                            testing.assert_close_benchmark(lse, ref_lse, f"{label} p{page_size} {mode} lse")
                            timing = timer(run)
                            row[mode] = round(timing.gpu_us if timing.gpu_us is not None else timing.wall_us, 1)
                        cute_attn.raise_on_device_error()
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
