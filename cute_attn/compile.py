"""The one compile path: config -> tvm-ffi function, cached in memory and on disk.

Kernel modules register how to build themselves::

    register_kernel(MyConfig, build, configs=default_configs)

where ``build(config) -> (jit_fn, fake_args)`` returns a ``@cute.jit`` callable
and fake arguments (``cute.runtime.make_fake_tensor`` / ``make_fake_compact_tensor``
with ``cute.sym_int()`` dims, ``make_fake_stream(use_tvm_ffi_env_stream=True)``),
so one config compiles once for every batch size / length / page count.

:func:`compile_kernel` then

1. raises ``ValueError(reason)`` if ``config.can_implement()`` says no;
2. returns the in-memory entry if there is one (same object every time);
3. else loads ``<cache>/<kernel_name>/<digest>.o`` if it exists;
4. else compiles with
   ``cute.compile(jit_fn, *fake_args, options="--enable-tvm-ffi --gpu-arch <arch>
   --keep-ptx --dump-dir <tmp>", no_jit_engine=True)``, exports the host+device
   object with ``compiled.export_to_c(path, function_name=symbol)`` (atomic:
   temp file + ``os.replace`` under a ``filelock.FileLock``) and loads it back.

The function handed out is always the one loaded from the ``.o`` with
``cute.runtime.load_module(path, enable_tvm_ffi=True)`` (a ``tvm_ffi.Function``),
so a fresh compile and a disk hit behave the same.  Loading works without a GPU;
calling needs one.  The PTX of each compile is kept next to the ``.o``
(``<digest>.ptx``) for :func:`compile_to_ptx`.

The digest covers ``config.cache_key()``, the arch, the nvidia-cutlass-dsl and
apache-tvm-ffi versions, the machine, compile-relevant ``CUTE_DSL_*`` env vars
and the sha256 of every ``.py`` file of the ``cute_attn`` package.
Cache dir: ``$CUTE_ATTN_CACHE_DIR``, default ``~/.cache/cute_attn``.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import os
import pkgutil
import platform
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from .arch import dsl_arch_options, dsl_target_arch
from .config import KernelConfig

CACHE_DIR_ENV = "CUTE_ATTN_CACHE_DIR"
_PACKAGE_DIR = Path(__file__).resolve().parent

BuildFn = Callable[[Any], "tuple[Any, tuple[Any, ...]]"]
ConfigsFn = Callable[[str], Iterable[KernelConfig]]

#: Counters: "compiled", "disk_hit", "memory_hit".  Tests read these.
STATS: collections.Counter[str] = collections.Counter()


@dataclass(frozen=True)
class _Registration:
    build: BuildFn
    configs: ConfigsFn | None


@dataclass(frozen=True)
class CompileInfo:
    """What :func:`compile_kernel_with_info` did for one config."""

    fn: Any  # tvm_ffi.Function
    source: str  # "memory" | "disk" | "compiled"
    seconds: float
    object_path: Path
    ptx_path: Path


_REGISTRY: dict[type, _Registration] = {}
_MEMORY: dict[KernelConfig, CompileInfo] = {}
_LOCK = threading.RLock()  # the DSL is process-global state: one compile at a time


# --------------------------------------------------------------------------- registry


def register_kernel(
    config_cls: type, build_fn: BuildFn, *, configs: ConfigsFn | None = None
) -> None:
    """Register ``build_fn(config) -> (jit_fn, fake_args)`` for ``config_cls``.

    ``configs(arch)`` optionally lists the configs ``tools/compile_all.py`` builds.
    Re-registering the same class (module reload) replaces the entry.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, KernelConfig)):
        raise TypeError(f"{config_cls!r} is not a KernelConfig subclass")
    if not config_cls.kernel_name:
        raise ValueError(f"{config_cls.__name__} must set the class attribute kernel_name")

    def same_class(c: type) -> bool:
        return (c.__module__, c.__qualname__) == (config_cls.__module__, config_cls.__qualname__)

    for other in list(_REGISTRY):
        if same_class(other):
            del _REGISTRY[other]  # a module reload made a new class object: replace it
        elif other.kernel_name == config_cls.kernel_name:
            raise ValueError(
                f"kernel_name {config_cls.kernel_name!r} is already used by {other.__qualname__}"
            )
    _REGISTRY[config_cls] = _Registration(build_fn, configs)


def import_all_kernels() -> None:
    """Import every module under ``cute_attn.kernels`` so they register themselves."""
    package = importlib.import_module(f"{__package__}.kernels")
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        importlib.import_module(info.name)


def registered_configs(arch: str) -> list[KernelConfig]:
    """All configs the registered kernels want built for ``arch``."""
    import_all_kernels()
    out: list[KernelConfig] = []
    for reg in _REGISTRY.values():
        if reg.configs is not None:
            out.extend(reg.configs(arch))
    return out


def _registration(config: KernelConfig) -> _Registration:
    reg = _REGISTRY.get(type(config))
    if reg is None:  # its kernel module was never imported: every kernel module registers on import
        import_all_kernels()
        reg = _REGISTRY.get(type(config))
    if reg is None:
        raise KeyError(
            f"no kernel registered for {type(config).__qualname__}; "
            "import its kernel module (it calls register_kernel)"
        )
    return reg


def registered_build(config: KernelConfig) -> "tuple[Any, tuple[Any, ...]]":
    """``(jit object, fake arguments)`` of ``config`` from its kernel's registered build (for composed builds)."""
    return _registration(config).build(config)


# --------------------------------------------------------------------------- keys


def cache_dir() -> Path:
    """``$CUTE_ATTN_CACHE_DIR`` or ``~/.cache/cute_attn`` (read at each call)."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "cute_attn")


@functools.lru_cache(maxsize=None)
def package_source_digest() -> str:
    """sha256 over the path and bytes of every ``.py`` file of ``cute_attn``.

    Computed once per process (the code that is loaded is what gets compiled).
    """
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"


_ENV_IGNORED = re.compile(r"LOG|DUMP|PRINT|KEEP|CACHE|ARCH")


def key_material(config: KernelConfig) -> str:
    """Everything that decides the bytes of the ``.o``, as one readable string."""
    dsl_env = sorted(
        f"{k}={v}"
        for k, v in os.environ.items()
        if k.startswith("CUTE_DSL_") and not _ENV_IGNORED.search(k[len("CUTE_DSL_"):])
    )
    return "\n".join(
        [
            f"config={config.cache_key()}",
            f"arch={config.arch}",
            f"nvidia-cutlass-dsl={_dist_version('nvidia-cutlass-dsl')}",
            f"apache-tvm-ffi={_dist_version('apache-tvm-ffi')}",
            f"machine={platform.system()}-{platform.machine()}",
            f"dsl_env={';'.join(dsl_env)}",
            f"sources={package_source_digest()}",
        ]
    )


def disk_key(config: KernelConfig) -> str:
    """Hex sha256 of :func:`key_material`: the ``.o`` file stem."""
    return hashlib.sha256(key_material(config).encode()).hexdigest()


def _paths(config: KernelConfig) -> tuple[Path, Path, Path, str]:
    digest = disk_key(config)
    folder = cache_dir() / re.sub(r"\W", "_", config.kernel_name)
    symbol = f"cute_attn_{re.sub(r'[^0-9A-Za-z_]', '_', config.kernel_name)}_{digest[:16]}"
    return folder / f"{digest}.o", folder / f"{digest}.ptx", folder / f"{digest}.lock", symbol


# --------------------------------------------------------------------------- compile


def compile_kernel(config: KernelConfig) -> Any:
    """The callable (``tvm_ffi.Function``) for ``config``; see the module docstring."""
    hit = _MEMORY.get(config)
    if hit is not None:  # per-launch callers (the combine): skip building a CompileInfo copy
        STATS["memory_hit"] += 1
        return hit.fn
    return compile_kernel_with_info(config).fn


def compile_kernel_with_info(config: KernelConfig) -> CompileInfo:
    """Like :func:`compile_kernel`, also saying where the function came from."""
    hit = _MEMORY.get(config)  # checked by can_implement when it was compiled: the per-launch fast path
    if hit is not None:
        STATS["memory_hit"] += 1
        return CompileInfo(hit.fn, "memory", 0.0, hit.object_path, hit.ptx_path)
    reason = config.can_implement()
    if reason is not None:
        raise ValueError(f"{config.cache_key()} cannot be implemented: {reason}")
    reg = _registration(config)
    with _LOCK:
        hit = _MEMORY.get(config)
        if hit is not None:
            STATS["memory_hit"] += 1
            return CompileInfo(hit.fn, "memory", 0.0, hit.object_path, hit.ptx_path)
        start = time.perf_counter()
        obj_path, ptx_path, lock_path, symbol = _paths(config)
        obj_path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_path)):
            fn = None
            source = "disk"
            if obj_path.exists():
                try:
                    fn = _load(obj_path, symbol)
                except Exception:  # a corrupt or foreign file: rebuild it
                    obj_path.unlink(missing_ok=True)
                    fn = None
            if fn is None:
                _compile_to_files(config, reg, obj_path, ptx_path, symbol)
                fn = _load(obj_path, symbol)
                source = "compiled"
        STATS["compiled" if source == "compiled" else "disk_hit"] += 1
        info = CompileInfo(fn, source, time.perf_counter() - start, obj_path, ptx_path)
        _MEMORY[config] = info
        return info


def compile_to_ptx(config: KernelConfig) -> str:
    """PTX text of ``config``'s kernel(s), compiling if needed (no GPU required)."""
    info = compile_kernel_with_info(config)
    if not info.ptx_path.exists():
        # The .o came from an older run that lost its .ptx: rebuild both.
        with _LOCK:
            obj_path, ptx_path, lock_path, symbol = _paths(config)
            with FileLock(str(lock_path)):
                if not ptx_path.exists():
                    _compile_to_files(config, _registration(config), obj_path, ptx_path, symbol)
    return info.ptx_path.read_text()


def clear_memory_cache() -> None:
    """Forget in-memory entries (the disk cache is untouched)."""
    with _LOCK:
        _MEMORY.clear()


def _compile_to_files(
    config: KernelConfig, reg: _Registration, obj_path: Path, ptx_path: Path, symbol: str
) -> None:
    import cutlass.cute as cute  # deferred: importing the DSL takes about a second

    jit_fn, fake_args = reg.build(config)
    with tempfile.TemporaryDirectory(prefix="cute_attn_ptx_") as dump_dir:
        # The DSL writes the PTX only if --dump-dir already exists.
        options = (
            f"--enable-tvm-ffi {dsl_arch_options(config.arch)} --keep-ptx --dump-dir {dump_dir}"
        )
        with dsl_target_arch(config.arch):
            compiled = cute.compile(jit_fn, *fake_args, options=options, no_jit_engine=True)
        ptx_files = sorted(Path(dump_dir).glob("*.ptx"))
        ptx = "\n".join(p.read_text() for p in ptx_files)
    if not ptx:
        raise RuntimeError(f"{config.cache_key()}: the DSL produced no PTX")
    # export_to_c picks the object format from the file suffix: keep ".o" last.
    _atomic_write(obj_path, lambda tmp: compiled.export_to_c(str(tmp), function_name=symbol))
    _atomic_write(ptx_path, lambda tmp: tmp.write_text(ptx))


def _atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(obj_path: Path, symbol: str) -> Any:
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=True)
    # The function keeps the JIT-linked module alive (keep_alive_object).
    return getattr(module, symbol)
