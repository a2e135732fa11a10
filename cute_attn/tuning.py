"""Sweep the tuning knobs of ``PagedAttentionConfig`` on one batch: the notebooks' API (``cute_attn.tuning``).

    wl = tuning.Workload.for_kind("gqa_paged_decode", kv_lens=[3232])
    rows = tuning.sweep("gqa_paged_decode", wl, {"min_chunk_keys": [0, 256, 512], "ctas_per_sm": [1, 2]},
                        arch="sm_90a")
    rows.print_config_line()  # the entry to paste into default_paged_config

Each variant is ``dataclasses.replace(api_config(kind, workload, arch), **knobs)`` (the config the API builds). A
variant that ``can_implement`` or its kernel's ``check_config`` refuses becomes a row with the reason; one that
passes is compiled through ``cute_attn.compile`` and planned with ``plan_work``. On a GPU it is then
launched on a NaN-poisoned case (``cute_attn.testing``), checked against the float32 reference by the
benchmark's rule, and timed by ``timer`` (default: ``timing.ColdL2Timer``, the bench's timer: flushed
L2, median of >= 50 CUPTI spans). Without a GPU (smoke mode) rows carry compile seconds and the plan's
balance, and no time.

Launches go straight to the kernel (``find_launcher(config)(DevicePlan, ...)``): the public entries
always pick the default config, which is what is being tuned.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from . import kernels, testing
from .api import DevicePlan
from .arch import resolve_arch, sm_count
from .compile import compile_kernel_with_info
from .config import PAGED_KINDS, PagedAttentionConfig
from .plan import WorkPlan, plan_work
from .timing import ColdL2Timer, Timing

__all__ = ["TUNING_KNOBS", "Workload", "VariantResult", "Sweep", "sweep", "config_line"]

#: Fields that say *which problem* a config solves; every other field is a knob a sweep may set.
PROBLEM_FIELDS = ("arch", "kind", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_v", "page_size",
                  "causal")
TUNING_KNOBS = tuple(f.name for f in dataclasses.fields(PagedAttentionConfig) if f.name not in PROBLEM_FIELDS)

#: The FlashInfer-Bench definitions' layouts (README), the default head layout of each kind.
DEFINITION_LAYOUTS = {
    "gqa_paged_decode": dict(num_qo_heads=20, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64),
    "gqa_paged_prefill": dict(num_qo_heads=32, num_kv_heads=4, head_dim_qk=128, head_dim_v=128, page_size=64),
    "mla_paged_prefill": dict(num_qo_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512, page_size=1),
    # no definition of its own: the decode definition's layout (it runs on the decode kernel)
    "gqa_paged_multi_token_decode": dict(num_qo_heads=20, num_kv_heads=4, head_dim_qk=128, head_dim_v=128,
                                         page_size=64),
}

def _check_kind(kind: str) -> None:
    if kind not in PAGED_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(PAGED_KINDS)}")


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One batch: per-request query and key lengths plus the head layout (the definition's by default)."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    page_size: int
    label: str = ""

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens) or not self.kv_lens:
            raise ValueError(f"need one q_len per kv_len and at least one request, got {len(self.q_lens)} "
                             f"and {len(self.kv_lens)}")
        if min(self.q_lens) < 0 or min(self.kv_lens) < 0:
            raise ValueError("lengths must be >= 0")

    @staticmethod
    def for_kind(kind: str, kv_lens: Sequence[int], q_lens: Sequence[int] | None = None, *, label: str = "",
                 **layout) -> "Workload":
        """A batch of ``kind`` with the definition's head layout, any of whose fields ``layout`` overrides.

        Decode takes no ``q_lens`` (one query per request).
        """
        _check_kind(kind)
        unknown = set(layout) - set(DEFINITION_LAYOUTS[kind])
        if unknown:
            raise ValueError(f"unknown layout fields {sorted(unknown)}; known: {sorted(DEFINITION_LAYOUTS[kind])}")
        kv = tuple(int(n) for n in kv_lens)
        if kind == "gqa_paged_decode":
            if q_lens is not None and any(int(n) != 1 for n in q_lens):
                raise ValueError("decode has one query per request: leave q_lens out")
            q = (1,) * len(kv)
        elif q_lens is None:
            raise ValueError(f"{kind} needs q_lens")
        else:
            q = tuple(int(n) for n in q_lens)
        return Workload(q, kv, label=label or _default_label(kind, q, kv), **{**DEFINITION_LAYOUTS[kind], **layout})

    @staticmethod
    def from_bench(bench_workload) -> "Workload":
        """From a ``tools/bench_workloads.Workload`` (its definition name names the kind; definition layout)."""
        # mla_paged_decode has no kind of its own: its entry runs the MLA prefill kind (one query per request)
        name = bench_workload.kernel.replace("mla_paged_decode", "mla_paged_prefill", 1)
        kind = next((k for k in PAGED_KINDS if name.startswith(k)), None)
        if kind is None:
            raise ValueError(f"{bench_workload.kernel!r} is not a definition of {', '.join(PAGED_KINDS)}")
        q_lens = None if kind == "gqa_paged_decode" else bench_workload.q_lens
        return Workload.for_kind(kind, bench_workload.kv_lens, q_lens, label=bench_workload.label)

    def build_case(self, kind: str, device, seed: int = 0):
        """The NaN-poisoned test case (``cute_attn.testing``) of this batch.

        The MLA pool holds twice the batch's keys (the bench indexes the engine's whole 1.1 GB pool).
        """

        if kind == "gqa_paged_decode":
            return testing.make_gqa_decode_case(
                list(self.kv_lens), num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim_qk, page_size=self.page_size, device=device, seed=seed)
        if kind == "gqa_paged_multi_token_decode":
            return testing.make_gqa_multi_token_decode_case(
                list(self.q_lens), list(self.kv_lens), num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim_qk, page_size=self.page_size,
                device=device, seed=seed)
        if kind == "gqa_paged_prefill":
            return testing.make_gqa_prefill_case(
                list(self.q_lens), list(self.kv_lens), num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim_qk, page_size=self.page_size,
                device=device, seed=seed)
        if kind == "mla_paged_prefill":
            return testing.make_mla_prefill_case(
                list(self.q_lens), list(self.kv_lens), num_heads=self.num_qo_heads, ckv_dim=self.head_dim_v,
                kpe_dim=self.head_dim_qk - self.head_dim_v, page_size=self.page_size, device=device,
                seed=seed)
        _check_kind(kind)
        raise AssertionError(kind)  # pragma: no cover - every kind is handled above

    def layout_note(self) -> str:
        return (f"h{self.num_qo_heads}/kv{self.num_kv_heads} d{self.head_dim_qk}"
                f"{'' if self.head_dim_v == self.head_dim_qk else f'/{self.head_dim_v}'} ps{self.page_size}")


def _default_label(kind: str, q: tuple[int, ...], kv: tuple[int, ...]) -> str:
    # the bench's spellings: per-request lengths when they are uniform, else totals
    uniform = len(set(q)) == 1 and len(set(kv)) == 1
    if kind == "gqa_paged_decode":
        return f"n{len(kv)}_kv{kv[0]}" if uniform else f"n{len(kv)}_kv{sum(kv)}"
    return f"n{len(kv)}_q{q[0]}_kv{kv[0]}" if uniform else f"n{len(kv)}_q{sum(q)}_kv{sum(kv)}"


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------
@dataclass
class VariantResult:
    """One variant of a sweep. ``status``: ok | refused | compile_error | wrong | error."""

    knobs: dict
    config: PagedAttentionConfig
    is_default: bool = False  # the config default_paged_config picks today
    status: str = "ok"
    reason: str = ""
    compile_s: float | None = None
    compile_source: str | None = None  # "compiled" | "disk" | "memory" (compile.CompileInfo.source)
    items: int | None = None
    splits: int | None = None  # tiles cut into KV chunks (the plan's merges)
    partials: int | None = None
    busy_ctas: int | None = None
    cta_cost_max: int | None = None  # modelled cost (key-equivalents) of the busiest CTA
    cta_cost_mean: float | None = None  # over every launched CTA, idle ones included
    passed: bool | None = None  # None: not checked (smoke mode, check=False)
    time_us: float | None = None  # the GPU span, or the wall time where CUPTI gave none (timing_status says)
    wall_us: float | None = None
    n_kernels: int | None = None
    timing_status: str | None = None

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.knobs.items()) or "default knobs"

    @property
    def balance(self) -> float | None:
        """max / mean modelled CTA cost (1.0 is a perfectly even plan)."""
        if self.cta_cost_max is None or not self.cta_cost_mean:
            return None
        return self.cta_cost_max / self.cta_cost_mean

    def summary(self) -> str:
        """One line: the variant, its status and what it got (the notebooks' progress line)."""
        if self.status in ("refused", "compile_error"):
            return f"{self.label}: {self.status}: {self.reason}"
        got = (f"compile {self.compile_s:.1f} s ({self.compile_source}), {self.items} items, {self.splits} split, "
               f"balance {_fmt(self.balance, '.3f')}")
        if self.time_us is not None:
            got += f", {self.time_us:.1f} us"
        return f"{self.label}: {self.status}: {got}" + (f": {self.reason}" if self.reason else "")

    def as_dict(self) -> dict:
        """Flat plain values: knobs as their own columns, the config as its cache key."""
        row = {"variant": self.label, **self.knobs}
        for f in dataclasses.fields(self):
            if f.name not in ("knobs", "config"):
                row[f.name] = getattr(self, f.name)
        row["balance"] = self.balance
        row["config"] = self.config.cache_key()
        return row


class Sweep(list):
    """The rows of :func:`sweep` (a list of :class:`VariantResult`) and what the sweep was run on."""

    def __init__(self, rows=(), *, kind: str, workload: Workload, arch: str, num_sms: int, smoke: bool):
        super().__init__(rows)
        self.kind, self.workload, self.arch, self.num_sms, self.smoke = kind, workload, arch, num_sms, smoke

    def to_dicts(self) -> list[dict]:
        return [r.as_dict() for r in self]

    def to_frame(self):
        import pandas as pd  # optional: the notebooks extra has it, the package does not need it

        return pd.DataFrame(self.to_dicts())

    def table(self) -> str:
        """A fixed-width text table of the rows (no pandas needed)."""
        lines = [f"{self.kind} {self.workload.label} on {self.arch} ({self.num_sms} SMs"
                 f"{', smoke: compile + plan only' if self.smoke else ''})",
                 f"{'variant':<44} {'status':<13} {'compile_s':>9} {'items':>6} {'splits':>6} {'balance':>7} "
                 f"{'time_us':>8}  reason"]
        for r in self:
            name = r.label[:42] + (" *" if r.is_default else "")  # * marks today's default
            lines.append(f"{name:<44} {r.status:<13} {_fmt(r.compile_s, '.1f'):>9} {_fmt(r.items):>6} "
                         f"{_fmt(r.splits):>6} {_fmt(r.balance, '.3f'):>7} {_fmt(r.time_us, '.1f'):>8}  "
                         f"{r.reason[:120]}")
        return "\n".join(lines)

    def best(self) -> VariantResult | None:
        """The fastest variant that ran and passed its check (None without a timed one, e.g. in smoke mode)."""
        timed = [r for r in self if r.status == "ok" and r.time_us is not None and r.passed is not False]
        return min(timed, key=lambda r: r.time_us, default=None)

    def config_line(self) -> str | None:
        """The ``default_paged_config`` entry for the best variant, or None when none was timed."""
        best = self.best()
        if best is None:
            return None
        note = f"{self.arch} {self.workload.layout_note()}, {self.workload.label}: {best.time_us:.1f} us"
        default = next((r for r in self if r.is_default), None)
        if default is not None and default.time_us is not None and default is not best:
            note += f" (default knobs {default.time_us:.1f})"
        return config_line(best.config, note=note + " (tuning.sweep)")

    def print_config_line(self) -> str | None:
        """Print :meth:`config_line`, or why there is none; returns the line."""
        line = self.config_line()
        if line is None:
            why = "smoke mode (no GPU): nothing was timed" if self.smoke else "no variant ran and passed"
            print(f"no config line: {why}")
        else:
            print(line)
        return line


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def config_line(config: PagedAttentionConfig, *, note: str = "") -> str:
    """``"<kind>": dict(<every knob>=<value>, ...),`` as in ``default_paged_config``'s table.

    Every knob is written, not just those that differ from today's default, so the line alone fixes the
    kernel: ``dataclasses.replace(default_paged_config(...), **eval("{" + line + "\\n}")[kind])`` is
    ``config`` again.
    """
    knobs = ", ".join(f"{name}={getattr(config, name)!r}" for name in TUNING_KNOBS)
    return f'"{config.kind}": dict({knobs}),' + (f"  # {note}" if note else "")


# ---------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------
def _variants(space: Mapping[str, Sequence]) -> list[dict]:
    """Every combination of the space's values, in the order given (last knob fastest)."""
    unknown = [k for k in space if k not in TUNING_KNOBS]
    if unknown:
        raise ValueError(f"{unknown} are not tuning knobs of PagedAttentionConfig; knobs: {', '.join(TUNING_KNOBS)}")
    names = list(space)
    values = []
    for name in names:
        options = space[name]
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise ValueError(f"space[{name!r}] must be a non-empty list of values, got {options!r}")
        values.append(list(options))
    return [dict(zip(names, combo)) for combo in itertools.product(*values)]


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------
def sweep(kind: str, workload: Workload, space: Mapping[str, Sequence], *, arch: str | None = None,
          num_sms: int | None = None, check: bool = True, smoke: bool | None = None,
          timer: Callable[[Callable[[], object]], Timing | float] | None = None, seed: int = 0,
          progress: Callable[[VariantResult], None] | None = None) -> Sweep:
    """Compile, plan and (on a GPU) check and time every variant of ``space`` on ``workload``.

    ``space``: knob -> list of values (fields of ``PagedAttentionConfig`` in :data:`TUNING_KNOBS`); ``{}``
    is the default config alone. ``smoke``: compile and plan only; None means "when there is no CUDA GPU".
    ``arch``: required in smoke mode (or ``$CUTE_ATTN_ARCH``); on a GPU, the device's by default.
    ``num_sms``: for the plan's grid; the device's on a GPU, else ``arch.sm_count``'s default.
    ``timer(run)``: a ``Timing`` or microseconds; default ``ColdL2Timer()`` (flushed L2, median of 50).
    ``progress(row)`` is called after each variant (the notebooks print it).
    """
    _check_kind(kind)
    variants = _variants(space)  # before any compile: a misspelt knob must not cost a sweep
    has_gpu = torch.cuda.is_available()
    if smoke is None:
        smoke = not has_gpu
    if not smoke and not has_gpu:
        raise RuntimeError("timing needs a CUDA GPU and none is available: pass smoke=True to compile and plan")
    if not smoke:
        torch.cuda.init()  # resolve_arch asks the device only once torch.cuda is initialised
    arch = resolve_arch(arch)
    if num_sms is None and not smoke:
        num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    num_sms = sm_count(num_sms if num_sms is not None else arch)
    base = api_config(kind, workload, arch)
    result = Sweep(kind=kind, workload=workload, arch=arch, num_sms=num_sms, smoke=smoke)
    gpu = None if smoke else _GpuBench(kind, workload, check, timer or ColdL2Timer(), seed)
    for knobs in variants:
        config = dataclasses.replace(base, **knobs)
        row = _run_variant(config, knobs, workload, num_sms, gpu, is_default=config == base)
        result.append(row)
        if progress is not None:
            progress(row)
    return result


def api_config(kind: str, workload: Workload, arch: str) -> PagedAttentionConfig:
    """The config the API builds for ``workload`` (the sweep's default row, which every knob is applied over): the
    kind's tiles, its batch-driven knobs (``OpSpec.workload_tiles``) and, for an MLA batch of one query a request,
    the decode entry's one-token tiles (``ops/mla_decode.py``)."""
    from . import api
    from .ops import get_spec
    from .ops.mla_decode import ONE_TOKEN_SPEC
    from .validate import PagedProblem

    spec = get_spec(kind)
    if kind == "mla_paged_prefill" and all(q == 1 for q in workload.q_lens):
        spec = ONE_TOKEN_SPEC
    problem = PagedProblem.for_lengths(
        workload.q_lens, workload.kv_lens, num_qo_heads=workload.num_qo_heads, num_kv_heads=workload.num_kv_heads,
        head_dim_qk=workload.head_dim_qk, head_dim_v=workload.head_dim_v, page_size=workload.page_size)
    return api._make_config(spec, problem, arch)


def _run_variant(config: PagedAttentionConfig, knobs: dict, workload: Workload, num_sms: int,
                 gpu: "_GpuBench | None", *, is_default: bool) -> VariantResult:
    row = VariantResult(knobs=dict(knobs), config=config, is_default=is_default)
    reason = config.can_implement()  # the kind's shape rules, then the registered kernel's
    if reason is not None:
        row.status, row.reason = "refused", reason
        return row
    try:
        info = compile_kernel_with_info(config)
    except Exception as exc:  # a DSL error in one variant must not end the sweep
        row.status, row.reason = "compile_error", _why(exc)
        return row
    row.compile_s, row.compile_source = round(info.seconds, 2), info.source
    plan = plan_work(config.plan_config(num_sms * config.ctas_per_sm), workload.q_lens, workload.kv_lens)
    _record_plan(row, plan)
    if gpu is not None:
        gpu.run(row, plan)
    return row


def _record_plan(row: VariantResult, plan: WorkPlan) -> None:
    row.items, row.splits, row.partials, row.busy_ctas = plan.num_items, plan.num_merges, plan.num_partials, \
        plan.num_ctas
    row.cta_cost_max, row.cta_cost_mean = int(plan.cta_cost.max()), float(plan.cta_cost.mean())


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


@dataclass
class _GpuBench:
    """The GPU half of a sweep: one case and its reference for every variant, then launch, check, time."""

    kind: str
    workload: Workload
    check: bool
    timer: Callable
    seed: int = 0
    device: str = "cuda"
    _case: object = field(default=None, init=False, repr=False)
    _reference: tuple | None = field(default=None, init=False, repr=False)

    def _ensure_case(self):
        if self._case is None:
            self._case = self.workload.build_case(self.kind, self.device, seed=self.seed)
            if self.check:
                self._reference = self._case.reference()
        return self._case

    def run(self, row: VariantResult, plan: WorkPlan) -> None:
        try:
            case = self._ensure_case()
            device_plan = DevicePlan.upload(row.config, plan, self.device)
            launcher = kernels.find_launcher(row.config)
            inputs = case.inputs()
            out, lse = case.new_outputs()

            def launch():
                launcher(device_plan, *inputs, out, lse)

            launch()
            _synchronize(self.device)
        except Exception as exc:
            row.status, row.reason = "error", _why(exc)
            return
        if self.check:
            try:
                testing.assert_close_benchmark(out, self._reference[0], "output")
                testing.assert_close_benchmark(lse, self._reference[1], "lse")
                # the fused decode merge must leave its arrival counters at zero for the next launch
                if int(device_plan.merge_counters.abs().sum()):
                    raise AssertionError("merge counters are not zero after the launch")
            except AssertionError as exc:
                row.status, row.reason, row.passed = "wrong", str(exc).splitlines()[0][:500], False
                return  # a wrong kernel is not timed: it must never be the best
            row.passed = True
        try:
            timing = self.timer(launch)
        except Exception as exc:
            row.status, row.reason = "error", f"timing: {_why(exc)}"
            return
        if isinstance(timing, Timing):
            row.time_us = timing.gpu_us if timing.gpu_us is not None else timing.wall_us
            row.wall_us, row.n_kernels, row.timing_status = timing.wall_us, timing.n_kernels, timing.status
        else:
            row.time_us, row.timing_status = float(timing), "custom timer"


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
