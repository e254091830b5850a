"""What every benchmark runner shares: the run's metadata, the sampled reference check, writing JSON + markdown."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable

import jax
import numpy as np


def run_metadata(command: str | None = None) -> dict:
  """The command, date, device and versions every results JSON records."""
  return dict(command=command or " ".join(sys.argv), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
              device=jax.devices()[0].device_kind, jax_version=jax.__version__, python=platform.python_version())


def sample_rows_and_blocks(m: int, n: int, gn: int) -> tuple[np.ndarray, np.ndarray]:
  """First, middle and last rows and weight row-blocks: what an output is checked on against the float64 reference
  (the full reference at real sizes would take minutes per shape)."""
  n_blocks = -(-n // gn)
  return np.unique(np.array([0, m // 2, m - 1])), np.unique(np.array([0, n_blocks // 2, n_blocks - 1]))


def write_results(result: dict, out_json: str | None, markdown_table: Callable[[dict], str] | None = None) -> None:
  """Writes `out_json` and, given a table function, the markdown table beside it (same name, .md)."""
  if not out_json:
    return
  os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
  with open(out_json, "w") as f:
    json.dump(result, f, indent=1)
  if markdown_table is not None:
    with open(out_json.removesuffix(".json") + ".md", "w") as f:
      f.write(markdown_table(result))


def row_line(row: dict) -> str:
  """One measured row as `key=value` pairs, floats to 4 significant digits: a runner's progress log."""
  return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def cupti_caption(result: dict, note: str) -> str:
  """The line above a CUPTI results table: the command, device and JAX version, then `note`."""
  return (f"Command: `{result['command']}` ({result['device']}, jax {result['jax_version']}). CUPTI kernel times, "
          f"us; {note}")


def run_shapes(command: str, shapes, measure: Callable, out_json: str | None,
               markdown_table: Callable[[dict], str]) -> dict:
  """`measure(shape) -> rows` for each shape, the JSON and its table rewritten after every shape (a run cut short
  keeps what it measured); prints the table and returns the results."""
  result = dict(run_metadata(command), rows=[])
  for shape in shapes:
    result["rows"] += measure(shape)
    write_results(result, out_json, markdown_table)
  print(markdown_table(result))
  return result
