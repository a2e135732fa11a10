"""The register split of warp-specialised kernels (``setmaxnreg``), checked on the host before a build.

A CTA launches with one register count per thread: what ptxas may use under the launch bound, the register
file (64 Ki 32-bit registers on sm_90 / sm_100) over the block's threads, in steps of 8. ``setmaxnreg.inc``
only takes registers that ``setmaxnreg.dec`` released in the same CTA: a split whose increases need more than
the decreases release blocks the increasing warps forever (a hang, not an error: the H200 found one, a
producer kept at 32 instead of 24 beside two consumer warpgroups at 240).
"""

from __future__ import annotations

REGISTER_FILE = 64 * 1024
MAX_REGS_PER_THREAD = 255


def launch_registers(num_threads: int) -> int:
    """Registers per thread a block of ``num_threads`` launches with (one block per SM)."""
    return min(MAX_REGS_PER_THREAD, REGISTER_FILE // num_threads) // 8 * 8


def register_split_reason(roles) -> str | None:
    """Why ``roles`` (``(threads, setmaxnreg count)`` pairs covering the block) cannot all reach their counts, or
    None."""
    num_threads = sum(threads for threads, _ in roles)
    base = launch_registers(num_threads)
    released = sum(threads * (base - regs) for threads, regs in roles if regs < base)
    needed = sum(threads * (regs - base) for threads, regs in roles if regs > base)
    if needed > released:
        split = ", ".join(f"{threads} threads at {regs}" for threads, regs in roles)
        return (f"register split {split}: the increases need {needed} registers beyond the launch's {base} per "
                f"thread, the decreases release {released} (setmaxnreg.inc would wait forever)")
    return None


__all__ = ["launch_registers", "register_split_reason"]
