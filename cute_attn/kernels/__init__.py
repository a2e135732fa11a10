"""CuTe DSL kernels.

Each kernel module defines a frozen ``KernelConfig`` subclass, a
``build(config) -> (jit_fn, fake_args)`` function and calls
``cute_attn.compile.register_kernel`` at import.  Importing this package does not
import the kernel modules (that pulls in the DSL); use
``cute_attn.compile.import_all_kernels()`` or import a module directly.
"""

from collections.abc import Callable

# (kind, arch) -> launcher(device_plan, *inputs, output, lse, natural_lse=...); attention kernel modules
# register themselves here. Empty until the first attention kernel lands.
_LAUNCHERS: dict[tuple[str, str], Callable] = {}


def register_launcher(kind: str, arch: str, launcher: Callable) -> None:
    _LAUNCHERS[(kind, arch)] = launcher


def find_launcher(config) -> Callable | None:
    """The launcher for a ``PagedAttentionConfig``'s kind and arch, or None when there is none yet."""
    return _LAUNCHERS.get((config.kind, config.arch))
