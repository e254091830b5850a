"""Runs a notebook's code cells in order, in one namespace, as a plain Python process (for the GPU machine, whose
image has no Jupyter): `python3 scripts/run_notebook.py notebooks/quickstart.ipynb [...]`.

Matplotlib draws off screen (Agg); where IPython is missing, `IPython.display.display` / `Markdown` print the text.
Exits non-zero at the first cell that raises, naming the notebook and the cell.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import types


def _ipython_display_shim() -> None:
  try:
    import IPython.display  # noqa: F401
  except ImportError:
    display_module = types.ModuleType("IPython.display")
    display_module.Markdown = lambda text: text
    display_module.display = lambda *objects: print(*objects)
    ipython = types.ModuleType("IPython")
    # Matplotlib consults a loaded IPython when pyplot makes a figure: no shell running (get_ipython() is None), and a
    # version (8.24) whose backend it leaves alone.
    ipython.get_ipython = lambda: None
    ipython.version_info = (8, 24, 0)
    ipython.display = display_module
    sys.modules["IPython"] = ipython
    sys.modules["IPython.display"] = display_module


def run(path: str) -> int:
  with open(path) as f:
    notebook = json.load(f)
  namespace = {"__name__": "__main__"}
  cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
  for i, cell in enumerate(cells, 1):
    source = "".join(cell["source"])
    print(f"--- {path}: code cell {i}/{len(cells)}", flush=True)
    try:
      exec(compile(source, f"{path}[cell {i}]", "exec"), namespace)
    except Exception:
      traceback.print_exc()
      print(f"FAILED: {path}, code cell {i}", flush=True)
      return 1
  print(f"OK: {path}, {len(cells)} code cells", flush=True)
  return 0


def main(paths: list[str]) -> int:
  os.environ.setdefault("MPLBACKEND", "Agg")
  _ipython_display_shim()
  # Notebooks find the repository from the working directory, as they do under Jupyter in notebooks/.
  return max((run(p) for p in paths), default=0)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
