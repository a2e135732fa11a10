"""Does compute-sanitizer's racecheck follow a named barrier whose id is in a register? A two-warpgroup probe.

    compute-sanitizer --tool racecheck python tools/racecheck_probe.py --variant register|immediate|asymmetric

GPU only. One CTA of 256 threads (two warpgroups), the pattern of the sm90 decode kernel's hand-over:
    1. each warpgroup syncs on its own named barrier, id 1 + warpgroup (``register``: one ``bar.sync`` whose id is
       computed at run time, as ``BAR.SYNC Rn, 0x80``; ``immediate``: a branch per warpgroup with ids 1 and 2;
       ``asymmetric``: only warpgroup 1 syncs on its barrier, as when only it zeroes a V tail in the decode kernel);
    2. warpgroup 1 writes 128 floats to shared memory;
    3. both warpgroups ``bar.sync 3, 256``;
    4. warpgroup 0 reads them and stores them to global memory.
Step 3 orders every write of step 2 before every read of step 4, whatever step 1 does: the two variants are the
same program. A hazard reported for one variant and not the other is the tool's, not the program's: racecheck
reports the ``asymmetric`` one (seen on the H200, docs/perf/h200-sanitizer.txt), because it orders two threads'
accesses by how many barriers each has passed, and warpgroup 1 has passed one more. The output
is checked (warpgroup 0 must read what warpgroup 1 wrote) so the probe also shows the ordering holds on the GPU.
"""

from __future__ import annotations

import argparse
import sys

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.memory import SmemAllocator

THREADS = 256
WG = 128


@cute.kernel
def _probe_kernel(out: cute.Tensor, variant: cutlass.Constexpr[str]):
    tidx, _, _ = cute.arch.thread_idx()
    wg = tidx // WG
    smem = SmemAllocator()
    handover = smem.allocate_tensor(Float32, cute.make_layout((WG,)), byte_alignment=16)
    if cutlass.const_expr(variant == "register"):
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=WG)
    elif cutlass.const_expr(variant == "asymmetric"):
        if wg == 1:
            cute.arch.barrier(barrier_id=2, number_of_threads=WG)
    else:
        if wg == 0:
            cute.arch.barrier(barrier_id=1, number_of_threads=WG)
        else:
            cute.arch.barrier(barrier_id=2, number_of_threads=WG)
    if wg == 1:
        handover[tidx - WG] = Float32(tidx) + Float32(0.5)
    cute.arch.barrier(barrier_id=3, number_of_threads=THREADS)
    if wg == 0:
        out[tidx] = handover[tidx]


@cute.jit
def _probe(out: cute.Tensor, variant: cutlass.Constexpr[str]):
    _probe_kernel(out, variant).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))


def main(argv=None) -> int:
    import torch
    from cutlass.cute.runtime import from_dlpack

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("register", "immediate", "asymmetric"), required=True)
    args = parser.parse_args(argv)
    out = torch.full((WG,), float("nan"), dtype=torch.float32, device="cuda")
    _probe(from_dlpack(out), args.variant)
    torch.cuda.synchronize()
    expected = torch.arange(WG, 2 * WG, dtype=torch.float32, device="cuda") + 0.5
    ok = torch.equal(out, expected)
    print(f"probe {args.variant}: warpgroup 0 read what warpgroup 1 wrote: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
