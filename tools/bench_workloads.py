"""Workload lists, stable labels and FLOP/byte counting for tools/bench.py.

Everything here is pure Python/numpy (no torch, no GPU) so the CPU test tier can check
labels and the counting formulas by hand. Cases (tensors) are built lazily through
cute_attn.testing, only when a workload is actually benchmarked.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

# Definition names, exactly as FlashInfer-Bench spells them (the JSON "kernel" field).
PREFILL = "gqa_paged_prefill_causal_h32_kv4_d128_ps64"
DECODE = "gqa_paged_decode_h20_kv4_d128_ps64"
MLA = "mla_paged_prefill_causal_h16_ckv512_kpe64_ps1"
# Multi-token (speculative) decode on the decode definition's shape: no FlashInfer-Bench definition exists for it,
# so the name follows theirs (cute_attn's gqa_paged_multi_token_decode; 1..8 causal draft tokens per request).
MTP_DECODE = "gqa_paged_multi_token_decode_h20_kv4_d128_ps64"

# --kernel short names -> definition names.
KERNEL_ALIASES = {"prefill": PREFILL, "decode": DECODE, "mla": MLA, "mtp": MTP_DECODE}
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

    def build_case(self, device: str, seed: int = 0):
        """Build the case object (inputs on `device`) through cute_attn.testing."""
        from cute_attn import testing  # lazy: the CPU tier tests labels without tensors

        if self.kernel == PREFILL:
            return testing.make_gqa_prefill_case(
                list(self.q_lens), list(self.kv_lens),
                num_qo_heads=GQA_PREFILL_HEADS["num_qo_heads"],
                num_kv_heads=GQA_PREFILL_HEADS["num_kv_heads"],
                head_dim=GQA_PREFILL_HEADS["head_dim"],
                page_size=GQA_PREFILL_HEADS["page_size"],
                device=device, seed=seed,
            )
        if self.kernel == DECODE:
            return testing.make_gqa_decode_case(
                list(self.kv_lens),
                num_qo_heads=GQA_DECODE_HEADS["num_qo_heads"],
                num_kv_heads=GQA_DECODE_HEADS["num_kv_heads"],
                head_dim=GQA_DECODE_HEADS["head_dim"],
                page_size=GQA_DECODE_HEADS["page_size"],
                device=device, seed=seed,
            )
        if self.kernel == MTP_DECODE:
            return testing.make_gqa_multi_token_decode_case(
                list(self.q_lens), list(self.kv_lens),
                num_qo_heads=GQA_DECODE_HEADS["num_qo_heads"],
                num_kv_heads=GQA_DECODE_HEADS["num_kv_heads"],
                head_dim=GQA_DECODE_HEADS["head_dim"],
                page_size=GQA_DECODE_HEADS["page_size"],
                device=device, seed=seed,
            )
        if self.kernel == MLA:
            return testing.make_mla_prefill_case(
                list(self.q_lens), list(self.kv_lens),
                num_heads=MLA_DIMS["num_heads"], ckv_dim=MLA_DIMS["ckv_dim"],
                kpe_dim=MLA_DIMS["kpe_dim"], num_pages=MLA_POOL_PAGES,
                device=device, seed=seed,
            )
        raise ValueError(f"unknown kernel {self.kernel!r}")


# ----------------------------------------------------------------------------- labels


def prefill_label(batch: int, q_len: int, kv_len: int) -> str:
    return f"n{batch}_q{q_len}_kv{kv_len}"  # per-request lengths


def decode_label(batch: int, kv_len: int) -> str:
    return f"n{batch}_kv{kv_len}"  # per-request kv length


def mtp_label(batch: int, q_len: int, kv_len: int) -> str:
    return f"n{batch}_q{q_len}_kv{kv_len}"  # per-request draft tokens and keys


def mla_label(batch: int, total_q: int, total_kv: int) -> str:
    return f"n{batch}_q{total_q}_kv{total_kv}"  # totals: that is how the engine recorded them


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


def all_workloads() -> List[Workload]:
    return _prefill_workloads() + _decode_workloads() + _mla_workloads() + _mtp_workloads()


def select_workloads(kernel: str = "all", names: Optional[Sequence[str]] = None,
                     quick: bool = False) -> List[Workload]:
    """Filter by --kernel (short or definition name), --workloads (labels or substrings), --quick."""
    wl = all_workloads()
    if kernel != "all":
        want = KERNEL_ALIASES.get(kernel, kernel)
        wl = [w for w in wl if w.kernel == want]
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
    if w.kernel == PREFILL:
        h, d = GQA_PREFILL_HEADS["num_qo_heads"], GQA_PREFILL_HEADS["head_dim"]
        per_pair, causal = 2 * h * (d + d), True
    elif w.kernel == DECODE:
        h, d = GQA_DECODE_HEADS["num_qo_heads"], GQA_DECODE_HEADS["head_dim"]
        per_pair, causal = 2 * h * (d + d), False  # one query sees every key
    elif w.kernel == MTP_DECODE:
        h, d = GQA_DECODE_HEADS["num_qo_heads"], GQA_DECODE_HEADS["head_dim"]
        per_pair, causal = 2 * h * (d + d), True  # draft tokens: bottom-right causal
    elif w.kernel == MLA:
        h = MLA_DIMS["num_heads"]
        qk = MLA_DIMS["ckv_dim"] + MLA_DIMS["kpe_dim"]
        per_pair, causal = 2 * h * (qk + MLA_DIMS["ckv_dim"]), True
    else:
        raise ValueError(w.kernel)
    return per_pair * sum(visible_pairs(q, kv, causal) for q, kv in zip(w.q_lens, w.kv_lens))


def workload_bytes(w: Workload) -> int:
    """Minimum unique bytes: q + output + lse + each K/V (ckv/kpe) row read once + index arrays."""
    b = w.batch
    total_q = sum(w.q_lens)
    rows = sum(keys_read(q, kv) for q, kv in zip(w.q_lens, w.kv_lens))
    if w.kernel in (PREFILL, DECODE, MTP_DECODE):
        c = GQA_PREFILL_HEADS if w.kernel == PREFILL else GQA_DECODE_HEADS
        h, hk, d, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim"], c["page_size"]
        act = 2 * total_q * h * d * BF16 + total_q * h * FP32  # q + out, lse
        kv = rows * hk * d * BF16 * 2  # K and V
        n_pages = sum(pages_of(kv, ps) for kv in w.kv_lens)
        # kv_indptr + kv_indices + kv_last_page_len (+ qo_indptr for prefill)
        idx = ((b + 1) + n_pages + b + ((b + 1) if w.kernel != DECODE else 0)) * INT32
        return act + kv + idx
    if w.kernel == MLA:
        h, dc, dp = MLA_DIMS["num_heads"], MLA_DIMS["ckv_dim"], MLA_DIMS["kpe_dim"]
        act = total_q * h * (dc + dp) * BF16 + total_q * h * dc * BF16 + total_q * h * FP32
        kv = rows * (dc + dp) * BF16
        idx = (2 * (b + 1) + sum(w.kv_lens)) * INT32  # qo_indptr, kv_indptr, kv_indices
        return act + kv + idx
    raise ValueError(w.kernel)
