"""Target architecture and SM count, decided on the host without touching a GPU.

Every compile in this project is for an *explicit* arch (``sm_90a`` Hopper or
``sm_100a`` Blackwell).  How CuTe DSL 4.8.1 picks its target, and what we do:

* ``CUTE_DSL_ARCH`` is read **once**, when ``import cutlass`` builds the DSL
  singleton (``EnvironmentVarManager.__init__``).  Changing ``os.environ``
  afterwards has no effect.  If it is unset, the first read of
  ``dsl.envar.arch`` probes the CUDA driver and, with no GPU, silently falls
  back to ``sm_100a``.
* The per-compile option ``--gpu-arch <arch>`` (``cute.GPUArch``) wins over
  the env var, both while tracing (``dsl.get_arch_enum()`` -> arch checks such
  as ``mbarrier_init_fence`` needing >= sm_90) and in codegen (``cubin-chip``).
  ``cute.compile`` installs the options on the DSL *before* tracing, so this is
  the authoritative switch.  We always pass it (see :func:`dsl_arch_options`).
* After codegen the DSL still reads ``dsl.envar.arch`` to decide whether it may
  build a JIT engine for the host code (that read would probe the driver).
  :func:`dsl_target_arch` pins ``dsl.envar.arch`` to the requested arch for the
  duration of a compile so no probe happens and nothing depends on the local
  GPU.  Compiling sm_90a then sm_100a (or the reverse) in one process works.

Nothing here imports torch or initialises CUDA.  :func:`resolve_arch` only asks
the device when the *caller* has already initialised ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

SUPPORTED_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")

#: Environment variable naming the target arch (``sm_90a`` or ``sm_100a``).
ARCH_ENV = "CUTE_ATTN_ARCH"
#: Environment variable overriding the SM count used for grid sizing.
SM_COUNT_ENV = "CUTE_ATTN_SM_COUNT"

#: Documented SM counts used when nothing else is given:
#: H100 SXM / H200 have 132 SMs, B200 has 148.
DEFAULT_SM_COUNT: dict[str, int] = {"sm_90a": 132, "sm_100a": 148}

_CAPABILITY_TO_ARCH: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def normalize_arch(arch: str) -> str:
    """Return the canonical spelling (``sm_90a`` / ``sm_100a``) or raise ValueError.

    Accepts e.g. ``"sm_90a"``, ``"sm90a"``, ``"sm_90"``, ``"90a"``, ``"SM_100A"``.
    The arch-specific ``a`` suffix is implied: these kernels use wgmma / tcgen05
    / TMA features that only exist in the ``a`` targets.
    """
    if not isinstance(arch, str) or not arch.strip():
        raise ValueError(f"arch must be a non-empty string like 'sm_90a', got {arch!r}")
    s = arch.strip().lower().replace("-", "_")
    if s.startswith("sm_"):
        s = s[3:]
    elif s.startswith("sm"):
        s = s[2:]
    if not s.endswith("a"):
        s += "a"
    canon = f"sm_{s}"
    if canon not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported arch {arch!r}: cute_attn supports {', '.join(SUPPORTED_ARCHS)}"
        )
    return canon


def resolve_arch(arch: str | None = None) -> str:
    """Pick the target arch: explicit ``arch``, else ``$CUTE_ATTN_ARCH``, else the GPU.

    The GPU is consulted only when torch is already imported *and* the caller
    has initialised ``torch.cuda``; this function never initialises CUDA.
    Otherwise a ValueError asks the user to pass the arch.
    """
    if arch is not None:
        return normalize_arch(arch)
    env = os.environ.get(ARCH_ENV)
    if env:
        return normalize_arch(env)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            ready = bool(torch.cuda.is_initialized()) and torch.cuda.is_available()
        except Exception:  # pragma: no cover - defensive, odd torch builds
            ready = False
        if ready:
            cap = tuple(torch.cuda.get_device_capability())
            if cap in _CAPABILITY_TO_ARCH:
                return _CAPABILITY_TO_ARCH[cap]
            raise ValueError(
                f"GPU compute capability {cap[0]}.{cap[1]} is not supported; "
                f"cute_attn targets {', '.join(SUPPORTED_ARCHS)}"
            )
    raise ValueError(
        "cannot determine the target arch: pass arch='sm_90a' or arch='sm_100a' "
        f"(or set {ARCH_ENV}); the GPU is only asked when torch.cuda is already "
        "initialised by the caller"
    )


def sm_count(arch_or_count: str | int | None = None) -> int:
    """SM count for grid sizing, never asking a GPU.

    * an ``int`` is taken as the SM count itself (pass the device's
      ``multi_processor_count`` here if you queried it yourself, outside tracing);
    * else ``$CUTE_ATTN_SM_COUNT`` if set;
    * else the documented default for the arch (``None`` -> :func:`resolve_arch`):
      132 for sm_90a (H100 SXM / H200), 148 for sm_100a (B200).
    """
    if isinstance(arch_or_count, bool):
        raise TypeError("sm_count expects an arch string or an int, not a bool")
    if isinstance(arch_or_count, int):
        if arch_or_count <= 0:
            raise ValueError(f"SM count must be positive, got {arch_or_count}")
        return arch_or_count
    env = os.environ.get(SM_COUNT_ENV)
    if env:
        value = int(env)
        if value <= 0:
            raise ValueError(f"{SM_COUNT_ENV} must be positive, got {env!r}")
        return value
    return DEFAULT_SM_COUNT[resolve_arch(arch_or_count)]


def dsl_arch_options(arch: str) -> str:
    """The ``cute.compile(options=...)`` token selecting ``arch``."""
    return f"--gpu-arch {normalize_arch(arch)}"


@contextlib.contextmanager
def dsl_target_arch(arch: str) -> Iterator[str]:
    """Pin the CuTe DSL's notion of the *runtime* arch to ``arch`` while compiling.

    Use together with :func:`dsl_arch_options` (which sets the codegen / tracing
    target).  Restores the previous value afterwards.  Not thread-safe on its
    own: the DSL is process-global state, callers serialise compiles.
    """
    canon = normalize_arch(arch)
    from cutlass.cutlass_dsl import CuTeDSL  # deferred: importing cutlass is slow

    envar = CuTeDSL._get_dsl().envar
    previous = envar._arch  # None means "lazy: env var or driver probe"
    envar.arch = canon
    try:
        yield canon
    finally:
        envar.arch = previous  # type: ignore[assignment]
