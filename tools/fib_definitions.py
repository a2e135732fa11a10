"""FlashInfer-Bench's own definitions (and the float32 reference code they judge by) as an extra oracle.

    python tools/fib_definitions.py            # which definitions cute_attn serves, per arch, and why not

The 43 gqa/mla paged definitions are read where the project keeps them, never copied into the repository:
``$CUTE_ATTN_FIB_DEFINITIONS``, else ``../shared/spec/fib-definitions`` beside the checkout, else ``.fibdefs/``
in it (an ignored folder a GPU run carries). :func:`case_for` builds one of our test cases (shuffled,
NaN-poisoned pool) with a definition's constants and maps it onto the definition's inputs;
:func:`reference_of` executes the definition's ``reference`` (its ``run``); :func:`entry_for` says which of our
entries serves it (MLA decode is MLA prefill with one query per request) and :func:`config_for` with which config.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
ENV = "CUTE_ATTN_FIB_DEFINITIONS"


def definitions_dir() -> Path | None:
    for candidate in (os.environ.get(ENV), ROOT.parent / "shared" / "spec" / "fib-definitions", ROOT / ".fibdefs"):
        if candidate and Path(candidate).is_dir() and any(Path(candidate).glob("*.json")):
            return Path(candidate)
    return None


def load_all() -> list[dict]:
    folder = definitions_dir()
    return [] if folder is None else [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def constants(definition: dict) -> dict:
    return {k: v["value"] for k, v in definition["axes"].items() if v["type"] == "const"}


def reference_of(definition: dict):
    """The definition's own ``run`` (its ``reference`` code, executed in a fresh namespace)."""
    namespace: dict = {}
    exec(compile(definition["reference"], f"<{definition['name']}.reference>", "exec"), namespace)  # noqa: S102
    return namespace["run"]


@dataclass(frozen=True)
class Served:
    """How one definition maps onto cute_attn: our entry kind, and whether inputs need a translation."""

    kind: str | None  # None: no entry of ours has these semantics yet
    why_not: str = ""


def entry_for(definition: dict) -> Served:
    name = definition["name"]
    if name.startswith("gqa_paged_decode"):
        return Served("gqa_paged_decode")
    if name.startswith("gqa_paged_prefill_causal"):
        return Served("gqa_paged_prefill")
    if name.startswith(("mla_paged_prefill_causal", "mla_paged_decode")):
        return Served("mla_paged_prefill")  # decode = one causal query per request, which sees every key
    return Served(None, f"{definition['op_type']} is not a paged attention kind of cute_attn")


def config_for(definition: dict, arch: str):
    """Our default config for the definition's constants (``can_implement()`` says whether a kernel builds it)."""
    from cute_attn.config import default_paged_config

    served = entry_for(definition)
    if served.kind is None:
        return None
    c = constants(definition)
    if served.kind == "mla_paged_prefill":
        dims = dict(num_qo_heads=c["num_qo_heads"], num_kv_heads=1, head_dim_qk=c["head_dim_ckv"] + c["head_dim_kpe"],
                    head_dim_v=c["head_dim_ckv"], page_size=c["page_size"])
    else:
        dims = dict(num_qo_heads=c["num_qo_heads"], num_kv_heads=c["num_kv_heads"], head_dim_qk=c["head_dim"],
                    head_dim_v=c["head_dim"], page_size=c["page_size"])
    return default_paged_config(served.kind, arch=arch, causal=served.kind != "gqa_paged_decode", **dims)


def case_for(definition: dict, q_lens, kv_lens, *, device="cpu", seed: int = 0):
    """(our case, the definition's inputs as a dict in its order) for one batch with the definition's constants.

    Decode definitions take one query per request (``q_lens`` is ignored there)."""
    from cute_attn import testing

    name = definition["name"]
    c = constants(definition)
    if name.startswith("gqa_paged_decode"):
        case = testing.make_gqa_decode_case(kv_lens, num_qo_heads=c["num_qo_heads"], num_kv_heads=c["num_kv_heads"],
                                            head_dim=c["head_dim"], page_size=c["page_size"], device=device, seed=seed)
    elif name.startswith("gqa_paged_prefill_causal"):
        case = testing.make_gqa_prefill_case(q_lens, kv_lens, num_qo_heads=c["num_qo_heads"],
                                             num_kv_heads=c["num_kv_heads"], head_dim=c["head_dim"],
                                             page_size=c["page_size"], device=device, seed=seed)
    elif name.startswith(("mla_paged_prefill_causal", "mla_paged_decode")):
        decode = name.startswith("mla_paged_decode")
        case = testing.make_mla_prefill_case([1] * len(kv_lens) if decode else q_lens, kv_lens,
                                             num_heads=c["num_qo_heads"], ckv_dim=c["head_dim_ckv"],
                                             kpe_dim=c["head_dim_kpe"], page_size=c["page_size"], device=device,
                                             seed=seed)
    else:
        raise ValueError(f"{name}: no case builder (see entry_for)")
    inputs = {n: getattr(case, n) for n in definition["inputs"]}
    return case, inputs


def main() -> int:
    definitions = load_all()
    if not definitions:
        print(f"no definitions found (set ${ENV}, keep ../shared/spec/fib-definitions beside the checkout, or carry "
              "a copy as .fibdefs/)")
        return 1
    for arch in ("sm_90a", "sm_100a"):
        served = 0
        print(f"--- {arch}")
        for d in definitions:
            config = config_for(d, arch)
            reason = entry_for(d).why_not if config is None else config.can_implement()
            served += reason is None
            print(f"{'ok  ' if reason is None else 'no  '} {d['name']:<50} {reason or ''}")
        print(f"{served}/{len(definitions)} definitions served on {arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
