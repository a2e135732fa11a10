"""Probes for the rows at parity with a peer (issues 10 and 11), each a planned-call A/B in one process.

    python tools/parity_probes.py --out OUT.json [--probes mla-head-split gqa-cta-count] [--iters 100]

- ``mla-head-split``: MLA decode h16 as h8 over twice the requests, each request's page list given twice (the two
  halves of its heads read the same latent rows, at once, on two SMs). A batch that splits every request in two
  (64 x 8192: 128 pieces and the combine launch) runs whole instead, with no merges and no combine; the second
  read of a row should come from L2. Prediction: 64 x 8192 page 64 155.4 -> ~151 us (128 x 4096's time, the same
  bytes with no merges) if one SM streams 9.4 MB as fast as two stream 4.7 MB each; else slower. H200, session 26:
  157.9 -> 210.9 us, so one SM's stream is the limit (refuted).
- ``late-cta``: the default call at 132 CTAs against 131, beside a device plan reused at each. The planning CTA holds
  an SM (~190 KB of shared memory) until the planner ends, so one attention CTA of the dependent launch finds no SM
  until then and starts after its wait is over, behind the others by its dispatch and prologue. Prediction: if that
  is what the default call pays after the planner (~3 us at prefill 8 x 992 and decode 64 x 2048 in
  ``tools/cold_timeline.py``), the default call at 131 CTAs is ~2 us faster than at 132 (the late CTA's ~3 us gone,
  1/132 of the throughput lost) while the device-planned call is ~1 us slower. H200, session 26 (200 runs, two
  rounds): refuted, the default call is 0.3-2.3 us slower at 131 CTAs (prefill 166.3 / 165.3 -> 166.6 / 167.6,
  decode 84.2 / 84.1 -> 85.0 / 84.7).
- ``gqa-cta-count``: GQA decode h32/kv16 64 x 2048 on 128 CTAs (8 whole units each) against 132 (100 CTAs with 8,
  32 with 7). Prediction: equal if 100 CTAs still saturate HBM in the last lap; 128 faster if they do not. H200,
  session 26 (200 runs): page 64 257.7 -> 257.0 us, page 1 263.5 -> 261.6.

Every arm is checked against the float32 reference (the benchmark's rule) before it is timed (cold L2, median).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import cute_attn  # noqa: E402
from cute_attn import testing, timing  # noqa: E402


def _check(name, out, lse, ref_out, ref_lse):
    testing.assert_close_benchmark(out, ref_out, f"{name} output")
    testing.assert_close_benchmark(lse, ref_lse, f"{name} lse")


def _head_split_indices(case):
    """kv_indptr / kv_indices / kv_last_page_len for 2B requests: request 2b and 2b+1 both read request b's pages."""
    ptr = case.kv_indptr.tolist()
    pieces, new_ptr = [], [0]
    for b in range(len(ptr) - 1):
        pages = case.kv_indices[ptr[b]:ptr[b + 1]]
        for _ in range(2):
            pieces.append(pages)
            new_ptr.append(new_ptr[-1] + pages.numel())
    indices = torch.cat(pieces).contiguous()
    indptr = torch.tensor(new_ptr, dtype=torch.int32, device=indices.device)
    last = None if case.kv_last_page_len is None else case.kv_last_page_len.repeat_interleave(2).contiguous()
    return indptr, indices, last


def mla_head_split(batch, kv_len, page_size, timer, rows):
    case = testing.make_mla_decode_case([kv_len] * batch, num_heads=16, page_size=page_size, device="cuda", seed=1)
    ref_out, ref_lse = case.reference()
    label = f"mla_decode h16 ps{page_size} {batch}x{kv_len}"
    args = case.inputs()
    plan16 = cute_attn.plan_mla_paged_decode(*args)
    out16, lse16 = case.new_outputs()

    def run16():
        cute_attn.mla_paged_decode(*args, out16, lse16, plan=plan16)  # positional: both argument orders

    indptr, indices, last = _head_split_indices(case)
    q_nope8 = case.q_nope.view(2 * batch, 8, -1)
    q_pe8 = case.q_pe.view(2 * batch, 8, -1)
    head = (q_nope8, q_pe8, case.ckv_cache, case.kpe_cache, indptr, indices)
    args8 = (*head, case.sm_scale) if last is None else (*head, last, case.sm_scale)
    plan8 = cute_attn.plan_mla_paged_decode(*args8)
    out8, lse8 = case.new_outputs()

    def run8():
        cute_attn.mla_paged_decode(*args8, out8.view(2 * batch, 8, -1), lse8.view(2 * batch, 8), plan=plan8)

    for name, run, out, lse in (("h16", run16, out16, lse16), ("h8 x2 (head split)", run8, out8, lse8)):
        run()
        torch.cuda.synchronize()
        _check(f"{label} {name}", out, lse, ref_out, ref_lse)
    for name, run in (("h16", run16), ("h8 x2 (head split)", run8), ("h16 again", run16)):
        t = timer(run)
        rows.append(dict(probe="mla-head-split", case=label, arm=name, gpu_us=t.gpu_us, wall_us=t.wall_us,
                         n_kernels=t.n_kernels, status=t.status))
        print(f"{label:34s} {name:22s} {t.gpu_us:9.2f} us  ({t.n_kernels} kernels)", flush=True)


def gqa_cta_count(num_qo_heads, num_kv_heads, batch, kv_len, page_size, timer, rows, ctas=(132, 128, 132)):
    case = testing.make_gqa_decode_case([kv_len] * batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                        head_dim=128, page_size=page_size, device="cuda", seed=1)
    ref_out, ref_lse = case.reference()
    label = f"decode h{num_qo_heads}/kv{num_kv_heads} ps{page_size} {batch}x{kv_len}"
    args = case.inputs()
    for n in ctas:
        plan = cute_attn.plan_gqa_paged_decode(*args, num_sms=n)
        out, lse = case.new_outputs()

        def run(plan=plan, out=out, lse=lse, n=n):
            cute_attn.gqa_paged_decode(*args, output=out, lse=lse, plan=plan, num_sms=n)

        run()
        torch.cuda.synchronize()
        _check(f"{label} {n} CTAs", out, lse, ref_out, ref_lse)
        t = timer(run)
        rows.append(dict(probe="gqa-cta-count", case=label, arm=f"{n} CTAs", gpu_us=t.gpu_us, wall_us=t.wall_us,
                         n_kernels=t.n_kernels, status=t.status))
        print(f"{label:34s} {n:4d} CTAs {t.gpu_us:9.2f} us", flush=True)


def late_cta(timer, rows, ctas=(132, 131, 132, 131)):
    """The default call (planned on the device every call) and a device plan reused, at 132 and 131 CTAs."""
    cases = (
        ("prefill h32/kv4 8x992", testing.make_gqa_prefill_case([992] * 8, [992] * 8, num_qo_heads=32, num_kv_heads=4,
                                                                 head_dim=128, page_size=64, device="cuda", seed=1),
         cute_attn.gqa_paged_prefill, cute_attn.plan_gqa_paged_prefill),
        ("decode h20/kv4 64x2048", testing.make_gqa_decode_case([2048] * 64, num_qo_heads=20, num_kv_heads=4,
                                                                 head_dim=128, page_size=64, device="cuda", seed=1),
         cute_attn.gqa_paged_decode, cute_attn.plan_gqa_paged_decode),
    )
    for label, case, entry, plan_entry in cases:
        ref_out, ref_lse = case.reference()
        args = case.inputs()
        for n in ctas:
            device_plan = plan_entry(*args, num_sms=n, on_device=True)
            out, lse = case.new_outputs()
            arms = (("default", lambda n=n: entry(*args, output=out, lse=lse, num_sms=n)),
                    ("device-planned", lambda n=n, p=device_plan: entry(*args, output=out, lse=lse, plan=p, num_sms=n)))
            for arm, run in arms:
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                _check(f"{label} {arm} {n}", out, lse, ref_out, ref_lse)
                t = timer(run)
                rows.append(dict(probe="late-cta", case=label, arm=f"{arm} {n} CTAs", gpu_us=t.gpu_us,
                                 wall_us=t.wall_us, n_kernels=t.n_kernels, status=t.status))
                print(f"{label:26s} {arm:15s} {n:4d} CTAs {t.gpu_us:9.2f} us ({t.n_kernels} kernels)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--probes", nargs="+", default=["mla-head-split", "gqa-cta-count"],
                    choices=["mla-head-split", "gqa-cta-count", "late-cta"])
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("parity_probes.py times planned calls: it needs a CUDA GPU")
    timer = timing.ColdL2Timer(iters=args.iters)
    rows = []
    if "mla-head-split" in args.probes:
        for batch, kv_len in ((64, 8192), (16, 4096), (128, 4096)):
            for page_size in (64, 1):
                mla_head_split(batch, kv_len, page_size, timer, rows)
    if "gqa-cta-count" in args.probes:
        for page_size in (64, 1):
            gqa_cta_count(32, 16, 64, 2048, page_size, timer, rows)
    if "late-cta" in args.probes:
        late_cta(timer, rows)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
