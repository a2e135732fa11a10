"""Per-CTA times of the sm_90a GQA prefill attention kernel in one call (a ``cta_stamps`` build), on a GPU.

    python tools/cta_timeline.py [--batch 8 1] [--q 992] [--kv 992] [--iters 30] [--json OUT]

Each CTA of the kernel built with ``probe="cta_stamps"`` (``ops/gqa_prefill.probe_policy``) writes the time it
entered, the time its ``griddepcontrol.wait`` returned, its consumers' end (``globaltimer``, ns) and its item count
to scratch (the last rows of ``partial_lse``). For the default call (the device planner launched before it every
call) and for a device plan reused, each call after a cold-L2 flush, it prints medians over calls, in us from the
call's earliest release: the CTAs' entries (first, last), the releases' spread, the ends (first, median, last), and
the last CTA's entry and item count. Every call's output is checked against the float32 reference first.

The question (docs/perf-notes.md, session 26): at 8 x 992 the default call's attention kernel ends 154.3 us after the
planner where a reused plan's kernel spans 150.8 us; is the difference before the release (the grid's end and its
flush), in the releases' spread, or in the CTAs' work after it?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def relative_ns(words: np.ndarray, reference: int) -> np.ndarray:
    """int32 globaltimer_lo stamps as signed ns from ``reference`` (the low words wrap every ~4.3 s)."""
    return ((words.astype(np.int64) - reference + 2**31) % 2**32) - 2**31


def summarize(stamps: np.ndarray) -> dict:
    """One call's ``[ctas, 4]`` stamps (entry, release, end, items) -> times in us from its earliest release."""
    release0 = int(stamps[:, 1][np.argmin(relative_ns(stamps[:, 1], int(stamps[0, 1])))])
    entry, release, end = (relative_ns(stamps[:, k], release0) / 1000.0 for k in range(3))
    last = int(np.argmax(end))
    return dict(entry_first=float(entry.min()), entry_last=float(entry.max()), release_last=float(release.max()),
                end_first=float(end.min()), end_median=float(np.median(end)), end_last=float(end.max()),
                last_cta=last, last_cta_entry=float(entry[last]), last_cta_items=int(stamps[last, 3]))


def _stamps(device_plan, num_ctas: int) -> np.ndarray:
    import torch

    from cute_attn.kernels.sm90.gqa_prefill import CTA_STAMPS

    words = device_plan.scratch()[1].view(torch.int32).cpu().numpy()
    return words[words.shape[0] - 1 - np.arange(num_ctas), :CTA_STAMPS]


def _default_plan(batch: int):
    """The DevicePlan the default call's route used (``api._DEVICE_ROUTES``: the one built with the probe)."""
    from cute_attn import api

    for hit in api._DEVICE_ROUTES.values():
        route = hit.route
        if route is not None and hit.config.probe == "cta_stamps" and route.batch == batch and route.slots:
            return next(iter(route.slots.values()))
    raise RuntimeError("no default-call route with a cta_stamps build: did the call take the device path?")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 1])
    p.add_argument("--q", type=int, default=992)
    p.add_argument("--kv", type=int, default=992)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cta_timeline.py reads stamps the kernel writes: it needs a CUDA GPU")
    import cute_attn
    from cute_attn import testing, timing
    from cute_attn.ops.gqa_prefill import probe_policy

    flush = timing.make_l2_flusher()
    report = {}
    with probe_policy("cta_stamps"):
        for batch in args.batch:
            case = testing.make_gqa_prefill_case([args.q] * batch, [args.kv] * batch, num_qo_heads=32,
                                                 num_kv_heads=4, head_dim=128, page_size=64, device="cuda",
                                                 seed=batch)
            ref_out, ref_lse = case.reference()
            inputs = case.inputs()
            out, lse = case.new_outputs()
            device_plan = cute_attn.plan_gqa_paged_prefill(*inputs, on_device=True)
            arms = (("default", lambda: cute_attn.gqa_paged_prefill(*inputs, out, lse),
                     lambda: _default_plan(batch)),
                    ("device plan reused", lambda: cute_attn.gqa_paged_prefill(*inputs, out, lse, plan=device_plan),
                     lambda: device_plan))
            for arm, call, plan_of in arms:
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                for name, got, want in (("output", out, ref_out), ("lse", lse, ref_lse)):
                    # a failure here may be a plan whose partial slots reach the stamp rows
                    testing.assert_close_benchmark(got, want, f"{batch} x {args.q} {arm} {name}")
                plan = plan_of()
                num_ctas = plan.work_indptr.shape[0] - 1
                calls = []
                for _ in range(args.iters):
                    flush()
                    call()
                    torch.cuda.synchronize()
                    calls.append(summarize(_stamps(plan, num_ctas)))
                med = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
                label = f"prefill {batch} x {args.q} / {args.kv}, {arm}"
                report[label] = med
                print(f"{label}: entry {med['entry_first']:.2f} .. {med['entry_last']:.2f}, releases to "
                      f"{med['release_last']:.2f}, ends {med['end_first']:.2f} / {med['end_median']:.2f} / "
                      f"{med['end_last']:.2f} us; last CTA entered {med['last_cta_entry']:.2f}, "
                      f"{med['last_cta_items']:.0f} items", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
