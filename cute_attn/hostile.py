"""Hostile inputs: a valid case with exactly one field corrupted, and what an entry point must do with it.

Engines hand us index tensors they built themselves; a bug there must end in an error that names the
argument, never in a kernel reading someone else's pages (or faulting, or hanging). Each corruption
changes one element of one field of a valid case from :mod:`cute_attn.testing` and says what must
happen (:class:`Corruption`):

Input errors (``expect_error=True``): the value rules (``validate.py`` with ``check_indices=True``, the
default) raise ``ValueError`` naming ``Corruption.names``, before any plan or launch.

- ``page_id_past_end`` / ``page_id_negative``: a ``kv_indices`` entry ``>= num_pages`` or ``< 0``;
- ``kv_indptr_decreases``: a middle entry above the next (batch 1: the last entry below the first);
- ``kv_indptr_overshoots``: ``kv_indptr[-1] > len(kv_indices)``;
- ``qo_indptr_decreases`` / ``qo_indptr_overshoots``: the same for ``qo_indptr`` (``qo_indptr[-1] !=
  total_q``), prefill and MLA only;
- ``last_page_len_zero`` (a request with pages), ``last_page_len_past_page`` (``> page_size``),
  ``last_page_len_negative``: ``kv_last_page_len``, GQA only.

Not input errors (``expect_error=False``): ``q_nan`` / ``q_inf`` put NaN or +-inf into one element of the
query (``q``; MLA: ``q_nope`` or ``q_pe``). Reading values of q would cost a pass over it per call, and a
non-finite activation is the model's bug, not a malformed batch, so the entries accept it. What they
must guarantee instead, for the poisoned ``(token, head)`` row (``Corruption.poisoned_row``):

- every *other* row's output and lse are unchanged, bit for bit, against the same call (same plan)
  without the poison: rows never mix, not even the other query heads packed into the same tile;
- the poisoned row's lse is not finite (NaN or +-inf), so the poison stays visible downstream. Its
  output is unspecified: the fp32 reference writes 0 there (it treats a row whose logsumexp is not
  finite as one that saw nothing) with lse NaN (NaN in q) or +-inf (inf in q: +inf once one key's
  product with the inf element is +inf, else -inf); a kernel may write NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .ops import gqa_decode, gqa_prefill, mla_prefill
from .testing import GqaDecodeCase, GqaPrefillCase, MlaDecodeCase, MlaPrefillCase

__all__ = [
    "Corruption",
    "Entry",
    "INPUT_ERROR_KINDS",
    "NON_FINITE_Q_KINDS",
    "applicable_kinds",
    "corrupt",
    "corruptions",
    "each_corruption",
    "entry_for",
    "first_named_argument",
    "query_choice",
    "unpoisoned_rows",
]

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)

PAGE_ID_PAST_END = "page_id_past_end"
PAGE_ID_NEGATIVE = "page_id_negative"
KV_INDPTR_DECREASES = "kv_indptr_decreases"
KV_INDPTR_OVERSHOOTS = "kv_indptr_overshoots"
QO_INDPTR_DECREASES = "qo_indptr_decreases"
QO_INDPTR_OVERSHOOTS = "qo_indptr_overshoots"
LAST_PAGE_LEN_ZERO = "last_page_len_zero"
LAST_PAGE_LEN_PAST_PAGE = "last_page_len_past_page"
LAST_PAGE_LEN_NEGATIVE = "last_page_len_negative"
Q_NAN = "q_nan"
Q_INF = "q_inf"

INPUT_ERROR_KINDS = (
    PAGE_ID_PAST_END, PAGE_ID_NEGATIVE, KV_INDPTR_DECREASES, KV_INDPTR_OVERSHOOTS, QO_INDPTR_DECREASES,
    QO_INDPTR_OVERSHOOTS, LAST_PAGE_LEN_ZERO, LAST_PAGE_LEN_PAST_PAGE, LAST_PAGE_LEN_NEGATIVE,
)
NON_FINITE_Q_KINDS = (Q_NAN, Q_INF)

Case = GqaDecodeCase | GqaPrefillCase | MlaPrefillCase

#: every argument name of the three entries
ARGUMENT_NAMES = ("q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "sm_scale",
                  "q_nope", "q_pe", "ckv_cache", "kpe_cache", "output", "lse")


@dataclass(frozen=True)
class Corruption:
    """One corrupted field and the outcome an entry point owes it (see the module docstring)."""

    kind: str
    field: str  # the case field (an entry argument) whose values were changed
    description: str  # what was done, for failure messages
    expect_error: bool  # True: a ValueError naming `names`, raised before any plan or launch
    names: str  # the argument the error must name ("" when no error is expected)
    poisoned_row: tuple[int, int] | None = None  # (token, query head) that non-finite q may reach


@dataclass(frozen=True)
class Entry:
    """The public entry, the plan entry and the validation rules of one definition."""

    run: Callable
    plan: Callable
    check: Callable


def entry_for(case: Case) -> Entry:
    if isinstance(case, GqaDecodeCase):
        return Entry(gqa_decode.gqa_paged_decode, gqa_decode.plan_gqa_paged_decode, gqa_decode.check)
    if isinstance(case, GqaPrefillCase):
        return Entry(gqa_prefill.gqa_paged_prefill, gqa_prefill.plan_gqa_paged_prefill, gqa_prefill.check)
    if isinstance(case, MlaDecodeCase):  # a subclass of the prefill case with the decode argument order
        raise TypeError("an MlaDecodeCase's inputs() are the decode argument order: call cute_attn.mla_paged_decode "
                        "(hostile entries serve the GQA kinds and MLA prefill)")
    if isinstance(case, MlaPrefillCase):
        return Entry(mla_prefill.mla_paged_prefill, mla_prefill.plan_mla_paged_prefill, mla_prefill.check)
    raise TypeError(f"not a case from cute_attn.testing: {type(case).__name__}")


def first_named_argument(message: str) -> str | None:
    """The argument an error message names first (as a whole word: ``total_q`` does not name ``q``).

    "Names the argument" is read strictly: the corrupted argument must be the first one the message
    mentions, so an error about ``kv_indptr`` that leads with ``kv_indices`` does not count.
    """
    best = None
    for name in ARGUMENT_NAMES:
        found = re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", message)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), name)
    return None if best is None else best[1]


def unpoisoned_rows(case: Case, corruption: Corruption) -> torch.Tensor:
    """Bool ``[total_q, heads]`` on the case's device: the rows a non-finite query element must not reach."""
    q = _query_tensors(case)[0]
    keep = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
    if corruption.poisoned_row is not None:
        keep[corruption.poisoned_row] = False
    return keep


def applicable_kinds(case: Case) -> tuple[str, ...]:
    """The corruptions this case can take (an empty request has no page to corrupt, decode (GQA or MLA) no
    qo_indptr, an MLA case in the ps1 order no ``kv_last_page_len``)."""
    kinds = []
    if case.kv_indices.numel():
        kinds += [PAGE_ID_PAST_END, PAGE_ID_NEGATIVE]
    if case.kv_lens:
        kinds += [KV_INDPTR_DECREASES, KV_INDPTR_OVERSHOOTS]
        if not isinstance(case, (GqaDecodeCase, MlaDecodeCase)):  # the decode entries take no qo_indptr
            kinds += [QO_INDPTR_DECREASES, QO_INDPTR_OVERSHOOTS]
        if case.kv_last_page_len is not None:  # MLA at page size 1 in the ps1 order has none
            if any(case.kv_lens):
                kinds.append(LAST_PAGE_LEN_ZERO)
            kinds += [LAST_PAGE_LEN_PAST_PAGE, LAST_PAGE_LEN_NEGATIVE]
    if _query_tensors(case)[0].shape[0]:
        kinds += [Q_NAN, Q_INF]
    return tuple(kinds)


def corrupt(case: Case, kind: str, *, choice: int = 0, size: int = 1) -> tuple[Case, Corruption]:
    """``case`` with one element of one field corrupted; ``case`` itself is left as it was.

    ``choice`` (any int >= 0, taken modulo the candidates) picks the element: which page id, request or
    query element. ``size >= 1`` says how far past the valid range the value lands: 1 is the first invalid
    value (``num_pages``, ``-1``, ``page_size + 1``, ...), larger ones go further, clipped to int32. For
    ``q_inf`` its parity picks the sign (odd: +inf). The corrupted field is a new tensor (a clone), every
    other field the same object, so the corrupted values can also be copied into the case in place.
    """
    if kind not in applicable_kinds(case):
        raise ValueError(f"{kind!r} does not apply to this case (it can take {applicable_kinds(case)})")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if kind in NON_FINITE_Q_KINDS:
        return _poison_query(case, kind, choice, size)
    build = {
        PAGE_ID_PAST_END: _page_id_past_end, PAGE_ID_NEGATIVE: _page_id_negative,
        KV_INDPTR_DECREASES: functools.partial(_indptr_decreases, "kv_indptr"),
        KV_INDPTR_OVERSHOOTS: functools.partial(_indptr_overshoots, "kv_indptr"),
        QO_INDPTR_DECREASES: functools.partial(_indptr_decreases, "qo_indptr"),
        QO_INDPTR_OVERSHOOTS: functools.partial(_indptr_overshoots, "qo_indptr"),
        LAST_PAGE_LEN_ZERO: _last_page_len_zero, LAST_PAGE_LEN_PAST_PAGE: _last_page_len_past_page,
        LAST_PAGE_LEN_NEGATIVE: _last_page_len_negative,
    }[kind]
    field, position, value, why = build(case, choice, size)
    old = getattr(case, field)
    new = old.clone()
    new[position] = value
    description = f"{field}[{position}] = {value} (was {int(old[position])}): {why}"
    corruption = Corruption(kind, field, description, expect_error=True, names=field)
    return dataclasses.replace(case, **{field: new}), corruption


def each_corruption(case: Case, kinds: Sequence[str] | None = None) -> list[tuple[Case, Corruption]]:
    """Every applicable kind twice: at the first element, just past the edge; and at another element,
    as far out as int32 goes (the two ends where off-by-one and overflow bugs live)."""
    kinds = applicable_kinds(case) if kinds is None else kinds
    return [corrupt(case, kind, choice=choice, size=size)
            for kind in kinds for choice, size in ((0, 1), (INT32_MAX, 2**31))]


def corruptions(case: Case, kinds: Sequence[str] | None = None):
    """Hypothesis strategy of ``(corrupted case, Corruption)``: one kind, element and distance at a time."""
    from hypothesis import strategies as st

    kinds = tuple(applicable_kinds(case) if kinds is None else kinds)
    if not kinds:
        raise ValueError("no corruption applies to this case")
    # near the edge (where off-by-one bugs live) as often as anywhere in int32
    sizes = st.one_of(st.integers(1, 4), st.integers(1, 2**31))
    return st.builds(functools.partial(corrupt, case), st.sampled_from(kinds), choice=st.integers(0, 2**31),
                     size=sizes)


# ---------------------------------------------------------------------------------------------
# One builder per kind: (field, position, new value, why it is invalid)
# ---------------------------------------------------------------------------------------------
def _clip32(value: int) -> int:
    return max(INT32_MIN, min(INT32_MAX, int(value)))


def _num_pages(case: Case) -> int:
    return (case.ckv_cache if isinstance(case, MlaPrefillCase) else case.k_cache).shape[0]


def _page_id_past_end(case, choice, size):
    num_pages = _num_pages(case)
    return ("kv_indices", choice % case.kv_indices.numel(), _clip32(num_pages - 1 + size),
            f"a page id past the pool's end (num_pages {num_pages})")


def _page_id_negative(case, choice, size):
    return "kv_indices", choice % case.kv_indices.numel(), _clip32(-size), "a negative page id"


def _indptr_decreases(field, case, choice, size):
    ptr = getattr(case, field).tolist()
    batch = len(ptr) - 1
    if batch == 1:  # no middle entry: the end falls below the start
        return field, 1, _clip32(-size), "the last entry below the first"
    b = 1 + choice % (batch - 1)
    return field, b, _clip32(ptr[b + 1] + size), f"entry {b} above entry {b + 1} ({ptr[b + 1]})"


def _indptr_overshoots(field, case, choice, size):
    ptr = getattr(case, field).tolist()
    end = "len(kv_indices)" if field == "kv_indptr" else "total_q"
    return field, len(ptr) - 1, _clip32(ptr[-1] + size), f"the last entry past {end} ({ptr[-1]})"


def _last_page_len_zero(case, choice, size):
    with_pages = [b for b, n in enumerate(case.kv_lens) if n]
    b = with_pages[choice % len(with_pages)]
    return "kv_last_page_len", b, 0, f"0 for request {b}, which has {case.kv_lens[b]} keys"


def _last_page_len_past_page(case, choice, size):
    b = choice % len(case.kv_lens)
    return ("kv_last_page_len", b, _clip32(case.page_size + size),
            f"more than page_size ({case.page_size}) tokens in a page")


def _last_page_len_negative(case, choice, size):
    return "kv_last_page_len", choice % len(case.kv_lens), _clip32(-size), "a negative token count"


def query_choice(case: Case, token: int, head: int, dim: int) -> int:
    """The ``choice`` that makes ``q_nan``/``q_inf`` poison ``q[token, head, dim]`` (MLA: dims of q_nope, then
    q_pe)."""
    tensors = _query_tensors(case)
    heads, width = tensors[0].shape[1], sum(t.shape[2] for t in tensors)
    return (token * heads + head) * width + dim


def _query_tensors(case: Case) -> tuple[torch.Tensor, ...]:
    return (case.q_nope, case.q_pe) if isinstance(case, MlaPrefillCase) else (case.q,)


def _poison_query(case: Case, kind: str, choice: int, size: int) -> tuple[Case, Corruption]:
    """One element of the query, counted over [token, head, dims of q (MLA: q_nope then q_pe)]."""
    names = ("q_nope", "q_pe") if isinstance(case, MlaPrefillCase) else ("q",)
    tensors = _query_tensors(case)
    total_q, heads = tensors[0].shape[:2]
    dims = [t.shape[2] for t in tensors]
    token, rest = divmod(choice % (total_q * heads * sum(dims)), heads * sum(dims))
    head, dim = divmod(rest, sum(dims))
    which = 0 if dim < dims[0] else 1
    dim -= which * dims[0]
    value = float("nan") if kind == Q_NAN else float("inf") if size % 2 else -float("inf")
    field = names[which]
    new = tensors[which].clone()
    new[token, head, dim] = value
    description = (f"{field}[{token}, {head}, {dim}] = {value}: not an input error; only row (token {token}, "
                   f"head {head}) may change, its lse must not be finite")
    corruption = Corruption(kind, field, description, expect_error=False, names="", poisoned_row=(token, head))
    return dataclasses.replace(case, **{field: new}), corruption
