"""The notebooks run top to bottom (on CPU in CI; unchanged on a GPU) and are committed without outputs."""

import json
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "benchmarks.ipynb", "moe.ipynb")


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


def test_plain_python_runner_runs_cells_in_order_and_names_a_failing_one(tmp_path, capsys):
  """scripts/run_notebook.py: how the GPU round runs the notebooks unchanged where there is no Jupyter."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("run_notebook", NOTEBOOKS.parent / "scripts" / "run_notebook.py")
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)

  def notebook(*sources):
    path = tmp_path / f"nb{len(sources)}.ipynb"
    cells = [{"cell_type": "markdown", "source": ["# title"]}]
    cells += [{"cell_type": "code", "source": [src], "outputs": [], "execution_count": None} for src in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return str(path)

  assert runner.run(notebook("x = 41", "x += 1\nprint('x is', x)", "assert x == 42")) == 0
  assert "x is 42" in capsys.readouterr().out
  assert runner.run(notebook("y = 1", "raise RuntimeError('boom')")) == 1
  out = capsys.readouterr().out
  assert "FAILED" in out and "code cell 2" in out
