"""The tuning notebooks run end to end in smoke mode (CPU: compile and plan a few variants, no times).

Executed with nbclient on the ``python3`` kernel that ipykernel installs, with ``smoke = True`` injected
after the cell tagged ``parameters`` (papermill's convention), this checkout first on the kernel's
``PYTHONPATH`` and the module's fresh compile cache, so every notebook compile is a real one.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("tune_decode", "tune_prefill")
CELL_TIMEOUT_S = 900  # generous: a compile takes ~5 s here, a loaded CI machine can be many times slower


def inject_parameters(nb, values: dict) -> None:
    """Insert a cell assigning ``values`` right after the ``parameters`` cell, as papermill does."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "a tuning notebook needs exactly one cell tagged 'parameters' (papermill)"
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, cell)


def run_notebook(name: str, values: dict, cache_dir: Path):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    inject_parameters(nb, values)
    env = dict(os.environ, CUTE_ATTN_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("CUTE_ATTN_ARCH", None)  # the notebook's arch parameter must be what decides
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute(env=env)
    return nb


def outputs(nb) -> tuple[str, list[str]]:
    """(all stream text, the mime types of every displayed output) of the executed notebook."""
    text, kinds = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("display_data", "execute_result"):
                kinds.extend(out.data)
            elif out.output_type == "error":
                raise AssertionError(f"{out.ename}: {out.evalue}")
    return "".join(text), kinds


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_smoke_mode(name, module_compile_cache):
    objects_before = len(list(module_compile_cache.rglob("*.o")))
    nb = run_notebook(name, {"smoke": True}, module_compile_cache)
    text, kinds = outputs(nb)
    table = text[text.index("variant "):]  # the rows.table() header onwards
    rows = [line for line in table.splitlines()[1:] if " ok " in line or " refused " in line]
    # each smoke space is 2 x 2: two variants the rules refuse (with the reason), two compiled and planned
    assert sum(" refused " in r for r in rows) == 2 and sum(" ok " in r for r in rows) == 2, table
    for r in rows:
        if " refused " in r:
            assert "kv_tile=512" in r or "tile_q_rows=128" in r, r  # the rule's own words
        else:
            compile_s, items = r.split(" ok ")[1].split()[:2]
            assert float(compile_s) > 0 and int(items) > 0, r  # a real compile (fresh cache) and a plan
    assert "smoke: compile + plan only" in text
    assert "no config line: smoke mode" in text  # nothing was timed, so nothing is chosen
    assert "image/png" in kinds  # the plot cell drew something
    # the kernel process compiled into the module's cache: one object per compiled variant
    assert len(list(module_compile_cache.rglob("*.o"))) - objects_before == 2
