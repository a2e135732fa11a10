"""CuTe DSL kernels.

Each kernel module defines a frozen ``KernelConfig`` subclass, a
``build(config) -> (jit_fn, fake_args)`` function and calls
``cute_attn.compile.register_kernel`` at import.  Importing this package does not
import the kernel modules (that pulls in the DSL); use
``cute_attn.compile.import_all_kernels()`` or import a module directly.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PagedKernel:
    """One attention kernel family member for one arch (a ``PagedAttentionConfig`` kind).

    ``build(config) -> (jit_fn, fake_args)`` for the compile path; ``launch(device_plan, *inputs, output,
    lse, natural_lse=...)`` runs it (compiling through ``compile.compile_kernel``); ``configs(arch)`` lists
    the configs ``tools/compile_all.py`` builds.
    """

    build: Callable
    launch: Callable
    configs: Callable[[str], Iterable]
    check_config: Callable  # config -> reason | None: the kernel's own rules (after config.shape_reason())


_PAGED: dict[tuple[str, str], PagedKernel] = {}


def _build_paged(config):
    return _PAGED[(config.kind, config.arch)].build(config)


def _paged_configs(arch: str) -> list:
    return [c for (kind, a), k in sorted(_PAGED.items()) if a == arch for c in k.configs(arch)]


def register_paged_kernel(kind: str, arch: str, *, build: Callable, launch: Callable,
                          configs: Callable[[str], Iterable], check_config: Callable) -> None:
    """Called by each attention kernel module at import."""
    from ..compile import register_kernel
    from ..config import PagedAttentionConfig

    _PAGED[(kind, arch)] = PagedKernel(build, launch, configs, check_config)
    register_kernel(PagedAttentionConfig, _build_paged, configs=_paged_configs)


def _paged_kernel(config) -> PagedKernel | None:
    kernel = _PAGED.get((config.kind, config.arch))
    if kernel is None:  # its module is not imported yet (another kernel module may be): the spec names it
        import importlib

        from ..ops import get_spec

        try:
            module = get_spec(config.kind).kernel_modules.get(config.arch)
        except ValueError:
            return None
        if module is not None:
            importlib.import_module(_package_relative(module), package=_ROOT_PACKAGE)
        kernel = _PAGED.get((config.kind, config.arch))
    return kernel


_ROOT_PACKAGE = __package__.rpartition(".")[0]  # "cute_attn", or "<pkg>.cute_attn" when shipped inside another


def _package_relative(module: str) -> str:
    """A spec's kernel module as a name relative to this copy of the package: FlashInfer-Bench's builder ships
    cute_attn inside a package of its own, where an absolute ``cute_attn.kernels...`` would import another copy
    (an installed one, or none) and register its kernels there, not here."""
    return module if module.startswith(".") else "." + module.partition(".")[2]


def find_launcher(config) -> Callable | None:
    """The launcher for a ``PagedAttentionConfig``'s kind and arch, or None when there is none yet."""
    kernel = _paged_kernel(config)
    return None if kernel is None else kernel.launch


def kernel_reason(config) -> str | None:
    """Why no registered kernel builds ``config`` (the kernel's own ``check_config``), or None when one does."""
    kernel = _paged_kernel(config)
    if kernel is None:
        built = sorted(arch for kind, arch in _PAGED if kind == config.kind)
        return f"no {config.arch} kernel is registered for {config.kind} (built for: {', '.join(built) or 'none'})"
    return kernel.check_config(config)
