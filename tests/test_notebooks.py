"""The notebooks run top to bottom (on CPU in CI; unchanged on a GPU) and are committed without outputs."""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "benchmarks.ipynb")


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom(name, monkeypatch):
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend must draw the plots into outputs
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  start = time.perf_counter()
  # The venv's python3 kernel spec (installed by ipykernel into sys.prefix); jupyter_client starts it with
  # this interpreter, so the notebook sees the same jax and jaxfp8 as the tests.
  client = nbclient.NotebookClient(nb, timeout=110, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()
  elapsed = time.perf_counter() - start
  errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert images, "the notebook should draw its plot(s)"
  assert elapsed < 110, f"{name} took {elapsed:.0f} s on this machine"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, "strip outputs (notebooks/make_notebooks.py)"
