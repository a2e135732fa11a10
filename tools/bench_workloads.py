"""Workload lists, stable labels and FLOP/byte counting for tools/bench.py.

Everything here is pure Python/numpy (no torch, no GPU) so the CPU test tier can check
labels and the counting formulas by hand. Cases (tensors) are built lazily through
cute_attn.testing, only when a workload is actually benchmarked.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

# Definition names, exactly as FlashInfer-Bench spells them (the JSON "kernel" field).
PREFILL = "gqa_paged_prefill_causal_h32_kv4_d128_ps64"
DECODE = "gqa_paged_decode_h20_kv4_d128_ps64"
MLA = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
# Multi-token (speculative) decode on the decode definition's shape: no FlashInfer-Bench definition exists for it,
# so the name follows theirs (cute_attn's gqa_paged_multi_token_decode; 1..8 causal draft tokens per request).
MTP_DECODE = "gqa_paged_multi_token_decode_h20_kv4_d128_ps64"

# MLA decode (issue 11): DeepSeek-V3's two page sizes; Kimi-K2's h8 (page 1) runs through its definition name.
MLA_DECODE = "mla_paged_decode_h16_ckv512_kpe64_ps1"
MLA_DECODE_PS64 = "mla_paged_decode_h16_ckv512_kpe64_ps64"
MLA_DECODE_H8 = "mla_paged_decode_h8_ckv512_kpe64_ps1"

# --kernel short names -> definition names.
KERNEL_ALIASES = {"prefill": PREFILL, "decode": DECODE, "mla": MLA, "mtp": MTP_DECODE}
#: --kernel short names of several definitions at once (one workload list, each page size its own rows)
KERNEL_GROUPS = {"mla_decode": (MLA_DECODE, MLA_DECODE_PS64)}
#: the kernels FlashInfer-Bench defines (tools/fib_bench.py): every one here but MTP_DECODE
FIB_KERNELS = (PREFILL, DECODE, MLA)

# Shape constants of each definition: the counting formulas read these, never literals.
GQA_PREFILL_HEADS = dict(num_qo_heads=32, num_kv_heads=4, head_dim=128, page_size=64)
GQA_DECODE_HEADS = dict(num_qo_heads=20, num_kv_heads=4, head_dim=128, page_size=64)
MLA_DIMS = dict(num_heads=16, ckv_dim=512, kpe_dim=64, page_size=1)
# The serving engine's whole MLA pool: every real workload indexes into ~1.1 GB of cache.
MLA_POOL_PAGES = 989_669

BF16 = 2
FP32 = 4
INT32 = 4

# ----------------------------------------------------------------------------- definition names

#: The 43 paged-attention definitions of FlashInfer-Bench (../shared/spec/fib-definitions/*.json), kept here so
#: the GPU machine (which has no shared/) knows them too; a CPU test checks this list against that folder.
FIB_DEFINITIONS = (
    "gqa_paged_decode_h16_kv2_d128_ps1", "gqa_paged_decode_h16_kv2_d128_ps64",
    "gqa_paged_decode_h20_kv4_d128_ps1", "gqa_paged_decode_h20_kv4_d128_ps64",
    "gqa_paged_decode_h24_kv4_d128_ps64",
    "gqa_paged_decode_h24_kv8_d128_ps1", "gqa_paged_decode_h24_kv8_d128_ps64",
    "gqa_paged_decode_h32_kv16_d128_ps1", "gqa_paged_decode_h32_kv16_d128_ps64",
    "gqa_paged_decode_h32_kv4_d128_ps1", "gqa_paged_decode_h32_kv4_d128_ps64",
    "gqa_paged_decode_h32_kv8_d128_ps1", "gqa_paged_decode_h32_kv8_d128_ps64",
    "gqa_paged_decode_h48_kv8_d128_ps1",
    "gqa_paged_decode_h5_kv1_d128_ps1",
    "gqa_paged_decode_h6_kv1_d128_ps1", "gqa_paged_decode_h6_kv1_d128_ps64",
    "gqa_paged_prefill_causal_h16_kv1_d128_ps64",
    "gqa_paged_prefill_causal_h16_kv2_d128_ps1", "gqa_paged_prefill_causal_h16_kv2_d128_ps64",
    "gqa_paged_prefill_causal_h20_kv4_d128_ps1", "gqa_paged_prefill_causal_h20_kv4_d128_ps64",
    "gqa_paged_prefill_causal_h24_kv4_d128_ps1", "gqa_paged_prefill_causal_h24_kv4_d128_ps64",
    "gqa_paged_prefill_causal_h24_kv8_d128_ps1", "gqa_paged_prefill_causal_h24_kv8_d128_ps64",
    "gqa_paged_prefill_causal_h32_kv16_d128_ps1", "gqa_paged_prefill_causal_h32_kv16_d128_ps64",
    "gqa_paged_prefill_causal_h32_kv4_d128_ps1", "gqa_paged_prefill_causal_h32_kv4_d128_ps64",
    "gqa_paged_prefill_causal_h32_kv8_d128_ps1", "gqa_paged_prefill_causal_h32_kv8_d128_ps64",
    "gqa_paged_prefill_causal_h40_kv10_d128_ps1",
    "gqa_paged_prefill_causal_h5_kv1_d128_ps1", "gqa_paged_prefill_causal_h5_kv1_d128_ps64",
    "gqa_paged_prefill_causal_h6_kv1_d128_ps1", "gqa_paged_prefill_causal_h6_kv1_d128_ps64",
    "mla_paged_decode_h16_ckv512_kpe64_ps1", "mla_paged_decode_h16_ckv512_kpe64_ps64",
    "mla_paged_decode_h8_ckv512_kpe64_ps1",
    "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1", "mla_paged_prefill_causal_h16_ckv512_kpe64_ps64",
    "mla_paged_prefill_causal_h8_ckv512_kpe64_ps1",
)

_GQA_NAME = re.compile(r"gqa_paged_(decode|prefill_causal|multi_token_decode)_h(\d+)_kv(\d+)_d(\d+)_ps(\d+)")
_MLA_NAME = re.compile(r"mla_paged_(decode|prefill_causal)_h(\d+)_ckv(\d+)_kpe(\d+)_ps(\d+)")
_GQA_OPS = {"decode": "decode", "prefill_causal": "prefill", "multi_token_decode": "mtp"}
_MLA_OPS = {"decode": "mla_decode", "prefill_causal": "mla"}


@dataclass(frozen=True)
class Definition:
    """What a definition name says: the operation and its head layout / page size.

    ``op``: ``decode`` (one query per request), ``prefill`` (causal, ragged), ``mtp`` (1..8 causal draft tokens),
    ``mla`` (absorbed-MLA causal prefill) or ``mla_decode``. For MLA ``head_dim`` is the ckv width (also V's),
    ``kpe_dim`` the rope part, and there is one latent KV head."""

    name: str
    op: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kpe_dim: int = 0

    @property
    def causal(self) -> bool:
        return self.op not in ("decode", "mla_decode")

    @property
    def is_fib(self) -> bool:
        """A FlashInfer-Bench definition (else a family name of ours, e.g. a page size 16 decode)."""
        return self.name in FIB_DEFINITIONS

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@lru_cache(maxsize=None)
def parse_definition(name: str) -> Definition:
    """``gqa_paged_{decode,prefill_causal,multi_token_decode}_h<H>_kv<KV>_d<D>_ps<P>`` or
    ``mla_paged_{decode,prefill_causal}_h<H>_ckv<C>_kpe<R>_ps<P>``; ValueError for anything else."""
    m = _GQA_NAME.fullmatch(name)
    if m:
        op, h, kv, d, ps = m.group(1), *map(int, m.groups()[1:])
        if not (h >= 1 and kv >= 1 and h % kv == 0 and d >= 1 and ps >= 1):
            raise ValueError(f"{name!r}: need h a multiple of kv, all >= 1")
        return Definition(name, _GQA_OPS[op], h, kv, d, ps)
    m = _MLA_NAME.fullmatch(name)
    if m:
        op, h, ckv, kpe, ps = m.group(1), *map(int, m.groups()[1:])
        if min(h, ckv, kpe, ps) < 1:
            raise ValueError(f"{name!r}: every size must be >= 1")
        return Definition(name, _MLA_OPS[op], h, 1, ckv, ps, kpe_dim=kpe)
    raise ValueError(f"not a definition name: {name!r} (want e.g. gqa_paged_decode_h20_kv4_d128_ps1, "
                     "gqa_paged_prefill_causal_h32_kv8_d128_ps64, mla_paged_prefill_causal_h16_ckv512_kpe64_ps1)")


def gqa_name(op: str, num_qo_heads: int, num_kv_heads: int, page_size: int, head_dim: int = 128) -> str:
    """The definition name of a GQA family member (``op``: decode / prefill / mtp)."""
    spelled = {v: k for k, v in _GQA_OPS.items()}[op]
    return f"gqa_paged_{spelled}_h{num_qo_heads}_kv{num_kv_heads}_d{head_dim}_ps{page_size}"


def op_of(kernel: str) -> str:
    return parse_definition(kernel).op


def short_name(kernel: str) -> str:
    """'decode' / 'prefill' / 'mla' / 'mtp' for the four bench kernels, else 'decode:h20/kv4/ps1' and the like."""
    for short, name in KERNEL_ALIASES.items():
        if name == kernel:
            return short
    try:
        d = parse_definition(kernel)
    except ValueError:
        return kernel
    if d.op.startswith("mla"):
        return f"{d.op}:h{d.num_qo_heads}/ps{d.page_size}"
    return f"{d.op}:h{d.num_qo_heads}/kv{d.num_kv_heads}/ps{d.page_size}"


@dataclass(frozen=True)
class Workload:
    """One benchmark point: a definition plus per-request query/key lengths."""

    kernel: str  # definition name
    label: str  # stable string, unique within the kernel
    q_lens: Tuple[int, ...]  # per request (decode: all 1)
    kv_lens: Tuple[int, ...]  # per request, in tokens
    quick: bool = False  # part of the --quick subset

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def definition(self) -> Definition:
        return parse_definition(self.kernel)

    def build_case(self, device: str, seed: int = 0):
        """Build the case object (inputs on `device`) through cute_attn.testing, with the head layout and page
        size the definition name gives."""
        from cute_attn import testing  # lazy: the CPU tier tests labels without tensors

        d = self.definition
        gqa = dict(num_qo_heads=d.num_qo_heads, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                   page_size=d.page_size, device=device, seed=seed)
        if d.op == "prefill":
            return testing.make_gqa_prefill_case(list(self.q_lens), list(self.kv_lens), **gqa)
        if d.op == "decode":
            return testing.make_gqa_decode_case(list(self.kv_lens), **gqa)
        if d.op == "mtp":
            return testing.make_gqa_multi_token_decode_case(list(self.q_lens), list(self.kv_lens), **gqa)
        if d.op == "mla_decode":
            return testing.make_mla_decode_case(list(self.kv_lens), num_heads=d.num_qo_heads, ckv_dim=d.head_dim,
                                                kpe_dim=d.kpe_dim, page_size=d.page_size, device=device, seed=seed)
        if d.op == "mla":
            return testing.make_mla_prefill_case(
                list(self.q_lens), list(self.kv_lens),
                num_heads=d.num_qo_heads, ckv_dim=d.head_dim, kpe_dim=d.kpe_dim, page_size=d.page_size,
                num_pages=MLA_POOL_PAGES if self.kernel == MLA else None,
                device=device, seed=seed,
            )
        raise ValueError(f"the bench has no case builder for {self.kernel!r} ({d.op})")


# ----------------------------------------------------------------------------- labels


def prefill_label(batch: int, q_len: int, kv_len: int) -> str:
    return f"n{batch}_q{q_len}_kv{kv_len}"  # per-request lengths


def decode_label(batch: int, kv_len: int) -> str:
    return f"n{batch}_kv{kv_len}"  # per-request kv length


def mtp_label(batch: int, q_len: int, kv_len: int) -> str:
    return f"n{batch}_q{q_len}_kv{kv_len}"  # per-request draft tokens and keys


def mla_label(batch: int, total_q: int, total_kv: int) -> str:
    return f"n{batch}_q{total_q}_kv{total_kv}"  # totals: that is how the engine recorded them


def ragged_decode_label(batch: int, max_kv: int) -> str:
    return f"n{batch}_kv1to{max_kv}"  # per-request kv lengths drawn from 1..max_kv


def stable_seed(label: str) -> int:
    """A seed derived from the label (crc32), so splits never change between runs or hosts."""
    return zlib.crc32(label.encode()) & 0x7FFFFFFF


def split_mla_lengths(batch: int, total_q: int, total_kv: int, seed: int) -> Tuple[List[int], List[int]]:
    """Random per-request (q_len, kv_len) with the recorded totals and kv_len >= q_len >= 1.

    The engine recorded only totals; a fixed seed keeps the draw reproducible.
    """
    if not (1 <= batch <= total_q <= total_kv):
        raise ValueError(f"need 1 <= batch <= total_q <= total_kv, got {batch}/{total_q}/{total_kv}")
    rng = np.random.default_rng(seed)
    if batch == 1:
        q = np.array([total_q])
    else:
        cuts = np.sort(rng.choice(np.arange(1, total_q), size=batch - 1, replace=False))
        q = np.diff(np.concatenate([[0], cuts, [total_q]]))
    extra = total_kv - total_q
    share = rng.multinomial(extra, rng.dirichlet(np.ones(batch))) if extra else np.zeros(batch, dtype=int)
    kv = q + share
    return [int(x) for x in q], [int(x) for x in kv]


def ragged_decode_lengths(batch: int, max_kv: int, seed: int) -> List[int]:
    """Per-request kv lengths uniform in 1..max_kv; a fixed seed keeps the draw the same on every host."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, max_kv + 1, size=batch)]


# ----------------------------------------------------------------------------- lists


def _prefill_workloads() -> List[Workload]:
    out = []
    # The 5 real workloads: B requests of 992 query tokens over 16 pages (992 keys) each.
    for b in (1, 4, 8, 16, 32):
        out.append(Workload(PREFILL, prefill_label(b, 992, 992), (992,) * b, (992,) * b,
                            quick=b in (1, 8)))
    # Other splits: long-context append and many short chunks over a longer prefix.
    for b, q, kv in ((4, 512, 4096), (8, 128, 2048)):
        out.append(Workload(PREFILL, prefill_label(b, q, kv), (q,) * b, (kv,) * b))
    return out


def _decode_workloads() -> List[Workload]:
    out = []
    # Seed: batch 1, 51 pages = 50 full + 32 tokens. Then larger batches from the sibling sets.
    for b, kv, quick in ((1, 3232, True), (16, 2048, False), (64, 2048, True), (128, 4096, False)):
        out.append(Workload(DECODE, decode_label(b, kv), (1,) * b, (kv,) * b, quick=quick))
    return out


def _mtp_workloads() -> List[Workload]:
    # q_len 4 beside q_len 1 at 64 x 2048 (the decode point): the cost of 4 draft tokens over one (target <= 1.3x)
    return [Workload(MTP_DECODE, mtp_label(64, q, 2048), (q,) * 64, (2048,) * 64, quick=q == 4) for q in (1, 4)]


# (batch, total_q, total_kv) recorded by the engine; a subset spanning small to 16K-token chunks.
MLA_RECORDED = (
    (1, 43, 46),
    (1, 1028, 1038),
    (28, 1954, 2044),
    (20, 3842, 3916),
    (22, 22, 17759),
    (56, 8987, 14390),
    (1, 16384, 16387),
)
MLA_QUICK = {(1, 1028, 1038), (28, 1954, 2044)}


def _mla_workloads() -> List[Workload]:
    out = []
    for b, tq, tkv in MLA_RECORDED:
        label = mla_label(b, tq, tkv)
        q, kv = split_mla_lengths(b, tq, tkv, stable_seed(label))
        out.append(Workload(MLA, label, tuple(q), tuple(kv), quick=(b, tq, tkv) in MLA_QUICK))
    return out


#: (batch, kv_len per request, in --quick) of the MLA decode lists (issue 11), then one ragged batch
MLA_DECODE_POINTS = ((1, 4096, True), (16, 4096, False), (64, 8192, False), (128, 4096, True))
MLA_DECODE_RAGGED = (64, 32768)  # 64 requests, kv lengths 1..32768


def mla_decode_workloads(kernel: str) -> List[Workload]:
    """Issue 11's MLA decode points for one decode definition (any head count / page size)."""
    if parse_definition(kernel).op != "mla_decode":
        raise ValueError(f"{kernel!r} is no MLA decode definition")
    out = [Workload(kernel, decode_label(b, kv), (1,) * b, (kv,) * b, quick=quick)
           for b, kv, quick in MLA_DECODE_POINTS]
    b, max_kv = MLA_DECODE_RAGGED
    label = ragged_decode_label(b, max_kv)
    out.append(Workload(kernel, label, (1,) * b, tuple(ragged_decode_lengths(b, max_kv, stable_seed(label)))))
    return out


def all_workloads() -> List[Workload]:
    """The bench kernels' lists (``--kernel all``): prefill, decode, MLA prefill, MTP and MLA decode at page 1 and
    64; the family (``--kernel family``) is separate."""
    mla_decode = [w for k in KERNEL_GROUPS["mla_decode"] for w in mla_decode_workloads(k)]
    return _prefill_workloads() + _decode_workloads() + _mla_workloads() + _mtp_workloads() + mla_decode


# ----------------------------------------------------------------------------- the kernel family (issue 10)

#: each definition's representative workload: decode 64 requests x 2048 keys, prefill 8 x 992 queries over 992
FAMILY_DECODE = (64, 2048)
FAMILY_PREFILL = (8, 992, 992)
#: head layouts of the FlashInfer-Bench GQA definitions (any page size), in the folder's order
FIB_DECODE_LAYOUTS = tuple(dict.fromkeys((d.num_qo_heads, d.num_kv_heads) for d in map(parse_definition, FIB_DEFINITIONS)
                                         if d.op == "decode"))
FIB_PREFILL_LAYOUTS = tuple(dict.fromkeys((d.num_qo_heads, d.num_kv_heads) for d in map(parse_definition, FIB_DEFINITIONS)
                                          if d.op == "prefill"))
#: page sizes every FIB head layout is benchmarked at (whether or not FIB publishes that page size)
FAMILY_PAGE_SIZES = (1, 64)


def representative_workloads(kernel: str, quick: bool = False) -> List[Workload]:
    """The representative workload(s) of any GQA definition name (FIB's or a family name such as
    ``gqa_paged_decode_h20_kv4_d128_ps16``): decode 64 x 2048, prefill 8 x 992/992, mtp q_len 1 and 4 at 64 x 2048.
    An MLA decode definition gets issue 11's whole list (its own quick flags)."""
    d = parse_definition(kernel)
    if d.op == "mla_decode":
        return mla_decode_workloads(kernel)
    if d.op == "decode":
        b, kv = FAMILY_DECODE
        return [Workload(kernel, decode_label(b, kv), (1,) * b, (kv,) * b, quick=quick)]
    if d.op == "prefill":
        b, q, kv = FAMILY_PREFILL
        return [Workload(kernel, prefill_label(b, q, kv), (q,) * b, (kv,) * b, quick=quick)]
    if d.op == "mtp":
        b, kv = FAMILY_DECODE
        return [Workload(kernel, mtp_label(b, q, kv), (q,) * b, (kv,) * b, quick=quick) for q in (1, 4)]
    raise ValueError(f"no representative workload for {kernel!r} ({d.op}): the bench's MLA workloads are the "
                     f"engine's recorded ones, --kernel mla")


def _dedupe(workloads: Sequence[Workload]) -> List[Workload]:
    """First occurrence of each (kernel, label) wins (so its quick flag does)."""
    seen, out = set(), []
    for w in workloads:
        if (w.kernel, w.label) not in seen:
            seen.add((w.kernel, w.label))
            out.append(w)
    return out


def family_workloads() -> List[Workload]:
    """Issue 10's points, each recorded under its definition name.

    quick: decode h20/kv4 at page 1 / 16 / 64, 64 x 2048 (the page-size targets) and prefill h32/kv4 page 1 at
    8 x 992. Then decode h20/kv4 page 1 at 128 x 4096, and every FIB GQA head layout at page 1 and 64
    (decode 64 x 2048, prefill 8 x 992/992)."""
    b, kv = FAMILY_DECODE
    out = [Workload(gqa_name("decode", 20, 4, ps), decode_label(b, kv), (1,) * b, (kv,) * b, quick=True)
           for ps in (1, 16, 64)]
    out += representative_workloads(gqa_name("prefill", 32, 4, 1), quick=True)
    out.append(Workload(gqa_name("decode", 20, 4, 1), decode_label(128, 4096), (1,) * 128, (4096,) * 128))
    for op, layouts in (("decode", FIB_DECODE_LAYOUTS), ("prefill", FIB_PREFILL_LAYOUTS)):
        for h, hk in layouts:
            for ps in FAMILY_PAGE_SIZES:
                out += representative_workloads(gqa_name(op, h, hk, ps))
    return _dedupe(out)


def _for_kernel(kernel: str) -> List[Workload]:
    if kernel == "all":
        return all_workloads()
    if kernel == "family":
        return family_workloads()
    if kernel in KERNEL_GROUPS:
        return [w for name in KERNEL_GROUPS[kernel] for w in _for_kernel(name)]
    want = KERNEL_ALIASES.get(kernel, kernel)
    listed = [w for w in _dedupe(all_workloads() + family_workloads()) if w.kernel == want]
    return listed or representative_workloads(want, quick=True)  # ValueError for a name that is no definition


def select_workloads(kernel: Union[str, Sequence[str]] = "all", names: Optional[Sequence[str]] = None,
                     quick: bool = False) -> List[Workload]:
    """Filter by --kernel (one or more of: all, family, a short name or group, any definition name), --workloads (labels
    or substrings), --quick. A definition name without listed workloads gets its representative one."""
    kernels = [kernel] if isinstance(kernel, str) else list(kernel)
    wl = _dedupe([w for k in kernels for w in _for_kernel(k)])
    if names:
        wl = [w for w in wl if any(n == w.label or n in w.label for n in names)]
    if quick:
        wl = [w for w in wl if w.quick]
    return wl


# ----------------------------------------------------------------------------- counting


def visible_pairs(q_len: int, kv_len: int, causal: bool = True) -> int:
    """(query, key) pairs a request computes. Bottom-right causal: row i sees keys
    j <= i + (kv_len - q_len), i.e. min(kv_len, i + 1 + kv_len - q_len) keys, clamped at 0."""
    if not causal:
        return q_len * kv_len
    i = np.arange(q_len, dtype=np.int64)
    return int(np.clip(np.minimum(kv_len, i + 1 + kv_len - q_len), 0, None).sum())


def keys_read(q_len: int, kv_len: int) -> int:
    """Distinct keys a causal request touches: the last query row sees all kv_len keys
    (row q_len-1 sees j <= kv_len-1), so every key is read once unless there is no query."""
    return kv_len if q_len > 0 else 0


def pages_of(kv_len: int, page_size: int) -> int:
    return -(-kv_len // page_size)


def workload_flops(w: Workload) -> int:
    """2 * heads * (qk_dim + v_dim) per visible pair (QK^T and PV are each 2*d FLOPs per pair)."""
    d = w.definition
    if d.op in ("prefill", "decode", "mtp"):
        per_pair = 2 * d.num_qo_heads * (d.head_dim + d.head_dim)  # decode: one query sees every key
    elif d.op in ("mla", "mla_decode"):
        per_pair = 2 * d.num_qo_heads * ((d.head_dim + d.kpe_dim) + d.head_dim)
    else:
        raise ValueError(w.kernel)
    return per_pair * sum(visible_pairs(q, kv, d.causal) for q, kv in zip(w.q_lens, w.kv_lens))


def workload_bytes(w: Workload) -> int:
    """Minimum unique bytes: q + output + lse + each K/V (ckv/kpe) row read once + index arrays."""
    d = w.definition
    b = w.batch
    total_q = sum(w.q_lens)
    rows = sum(keys_read(q, kv) for q, kv in zip(w.q_lens, w.kv_lens))
    if d.op in ("prefill", "decode", "mtp"):
        h, hk, hd, ps = d.num_qo_heads, d.num_kv_heads, d.head_dim, d.page_size
        act = 2 * total_q * h * hd * BF16 + total_q * h * FP32  # q + out, lse
        kv = rows * hk * hd * BF16 * 2  # K and V
        n_pages = sum(pages_of(kv, ps) for kv in w.kv_lens)
        # kv_indptr + kv_indices + kv_last_page_len (+ qo_indptr for prefill)
        idx = ((b + 1) + n_pages + b + ((b + 1) if d.op != "decode" else 0)) * INT32
        return act + kv + idx
    if d.op == "mla":
        h, dc, dp = d.num_qo_heads, d.head_dim, d.kpe_dim
        act = total_q * h * (dc + dp) * BF16 + total_q * h * dc * BF16 + total_q * h * FP32
        kv = rows * (dc + dp) * BF16
        n_pages = sum(pages_of(kv, d.page_size) for kv in w.kv_lens)
        last = b if d.page_size > 1 else 0  # kv_last_page_len only above page size 1
        idx = (2 * (b + 1) + n_pages + last) * INT32  # qo_indptr, kv_indptr, kv_indices
        return act + kv + idx
    if d.op == "mla_decode":
        # the latent cache dominates: every key's ckv + kpe row (1152 B at 512 + 64), once per request
        h, dc, dp = d.num_qo_heads, d.head_dim, d.kpe_dim
        act = total_q * h * (dc + dp) * BF16 + total_q * h * dc * BF16 + total_q * h * FP32  # q, out, lse
        kv = sum(w.kv_lens) * (dc + dp) * BF16
        n_pages = sum(pages_of(kv, d.page_size) for kv in w.kv_lens)
        last = b if d.page_size > 1 else 0  # the ps1 definitions have no kv_last_page_len
        idx = ((b + 1) + n_pages + last) * INT32  # kv_indptr, kv_indices (no qo_indptr: one query per request)
        return act + kv + idx
    raise ValueError(w.kernel)


# The four kernels' constants and their names must agree (the formulas read the names).
for _name, _c in ((PREFILL, GQA_PREFILL_HEADS), (DECODE, GQA_DECODE_HEADS), (MTP_DECODE, GQA_DECODE_HEADS)):
    _d = parse_definition(_name)
    assert (_d.num_qo_heads, _d.num_kv_heads, _d.head_dim, _d.page_size) == \
        (_c["num_qo_heads"], _c["num_kv_heads"], _c["head_dim"], _c["page_size"]), _name
assert (parse_definition(MLA).num_qo_heads, parse_definition(MLA).head_dim, parse_definition(MLA).kpe_dim,
        parse_definition(MLA).page_size) == (MLA_DIMS["num_heads"], MLA_DIMS["ckv_dim"], MLA_DIMS["kpe_dim"],
                                             MLA_DIMS["page_size"])
