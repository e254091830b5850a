"""What every command's arguments share: the one parser of weight shapes and row counts, the flags that take them,
and the errors the command line reports in one line.

`--shapes` (and `--models`) take items separated by ';':
  N,K        a weight of N output and K input features, run at the rows of --m (or the command's default)
  M,N,K      the same weight at M rows; several items of one weight collect their M values
  model      every weight of a model of shapes.json (deepseek_v3, qwen3_32b, ...), named model.layer
  model.layer (or model/layer)   one weight of it
  all        every model of shapes.json but the unaligned test shapes
`--m` takes row counts separated by ','.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from absl import flags

from jaxfp8 import shapes as shapes_json

_NUMBERS = re.compile(r"^\s*\d+\s*(?:[,x]\s*\d+\s*){1,2}$")
# shapes.json's test shapes that no model has: left out of "all".
_NOT_A_MODEL = "unaligned"


class CommandError(Exception):
  """An error the command line prints as one line, without a traceback, and exits with `status`: a command that
  cannot run here (no GPU, an optional dependency missing)."""
  status = 1


class UsageError(CommandError, ValueError):
  """A flag value that does not parse or does not fit the command (exit status 2)."""
  status = 2


class Shape(NamedTuple):
  """A weight (N, K) with its name; `ms`: the row counts its --shapes items gave (M,N,K), None when they gave none."""
  name: str
  n: int
  k: int
  ms: tuple[int, ...] | None = None


# ---- parsing ---------------------------------------------------------------------------------------------------------

def parse_ints(text: str | Sequence[str], *, flag: str, count: int | None = None) -> tuple[int, ...]:
  """'1,16,64' (or the list absl's DEFINE_list made of it) -> (1, 16, 64): positive integers, duplicates dropped in
  order; `count`: exactly that many values."""
  tokens = text.split(",") if isinstance(text, str) else list(text)
  if not _joined(text).strip():
    raise UsageError(f"{flag}: no values given")
  values = []
  for token in (t.strip() for t in tokens):
    if not token.isdigit() or int(token) <= 0:
      raise UsageError(f"{flag}: {token!r} is not a positive integer (in {_joined(text)!r})")
    if int(token) not in values or count is not None:
      values.append(int(token))
  if count is not None and len(values) != count:
    raise UsageError(f"{flag}: expected {count} comma-separated values, got {_joined(text)!r}")
  return tuple(values)


def parse_ms(text: str | Sequence[str], *, flag: str = "--m") -> tuple[int, ...]:
  """Row counts M: '1,16,64' -> (1, 16, 64)."""
  return parse_ints(text, flag=flag)


def model_table(path: str | None = None) -> dict[str, dict[str, tuple[int, int]]]:
  """model -> {layer: (N, K)} of the shipped shapes.json, or of the shapes.json at `path`."""
  if path is None:
    data = shapes_json.load()
  else:
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise UsageError(f"--shapes_json: cannot read {path}: {e}") from None
  return {model: {layer: (int(nk[0]), int(nk[1])) for layer, nk in layers.items()}
          for model, layers in data.items() if isinstance(layers, dict)}


def parse_shapes(text: str, *, flag: str = "--shapes", table: Mapping[str, Mapping[str, tuple[int, int]]] | None = None,
                 numbers: bool = True) -> list[Shape]:
  """The weights of a --shapes value (see the module docstring), in order, one entry per name (the M values of items
  of the same N,K collected). `table`: the models (default: the shipped shapes.json); `numbers`: whether N,K and
  M,N,K items are allowed (not for --models)."""
  table = model_table() if table is None else table
  out: dict[str, Shape] = {}
  items = [item.strip() for item in text.split(";") if item.strip()]
  if not items:
    raise UsageError(f"{flag}: no shapes given")
  for item in items:
    if numbers and _NUMBERS.match(item):
      values = [int(v) for v in re.split(r"[,x]", item)]
      if min(values) <= 0:
        raise UsageError(f"{flag}: {item!r}: M, N and K must be positive")
      *m, n, k = values
      name = f"{n}x{k}"
      previous = out.get(name)
      if previous is not None and bool(previous.ms) != bool(m):
        raise UsageError(f"{flag}: {n},{k} is given both with and without M: give M on every item of it or on none")
      ms = tuple(dict.fromkeys((*(previous.ms if previous else ()), *m))) if m else None
      out[name] = Shape(name, n, k, ms)
    else:
      for shape in _model_shapes(item, flag, table, numbers):
        out.setdefault(shape.name, shape)
  return list(out.values())


def _model_shapes(item: str, flag: str, table, numbers: bool) -> list[Shape]:
  models = [m for m in table if not m.startswith(_NOT_A_MODEL)]
  if item == "all":
    return [Shape(f"{m}.{layer}", n, k) for m in models for layer, (n, k) in table[m].items()]
  model, _, layer = item.replace("/", ".").partition(".")
  if model not in table:
    forms = "N,K, M,N,K (positive integers) or " if numbers else ""
    raise UsageError(f"{flag}: {item!r} is not {forms}a shapes.json model ({', '.join(table)}; model.layer for one "
                     "layer; all)")
  if not layer:
    return [Shape(f"{model}.{name}", n, k) for name, (n, k) in table[model].items()]
  if layer not in table[model]:
    raise UsageError(f"{flag}: {item!r}: {model} has no layer {layer!r}; its layers: {', '.join(table[model])}")
  n, k = table[model][layer]
  return [Shape(f"{model}.{layer}", n, k)]


def _joined(text: str | Sequence[str]) -> str:
  return text if isinstance(text, str) else ",".join(text)


# ---- the flags -------------------------------------------------------------------------------------------------------

SHAPES_HELP = ("Weight shapes, ';'-separated: 'N,K' (at the rows of --m), 'M,N,K', a shapes.json model "
               "('deepseek_v3'), 'model.layer' or 'all'.")


def define_shape_flags(flag_values: flags.FlagValues, module_name: str, *, shapes_default: str, m_default: str,
                       shapes_json: bool = True) -> None:
  """--shapes, --models, --m (and --shapes_json) on `flag_values`, listed under `module_name` in its help."""
  kw = dict(flag_values=flag_values, module_name=module_name)
  flags.DEFINE_string("shapes", None, f"{SHAPES_HELP} Default: {shapes_default}.", **kw)
  flags.DEFINE_list("models", None, "shapes.json models or model.layer names, ','-separated: the same as naming "
                    "them in --shapes (both may be given: their shapes are run one after the other).", **kw)
  flags.DEFINE_string("m", None, f"Row counts M, ','-separated, for the shapes given without M. Default: {m_default}.",
                      **kw)
  if shapes_json:
    flags.DEFINE_string("shapes_json", None, "Take the models of --models / --shapes from this shapes.json instead "
                        "of the shipped one (alone: every weight in it).", **kw)


def selected_shapes(flag_values: flags.FlagValues) -> list[Shape] | None:
  """The shapes --models, --shapes (and --shapes_json) select, in that order; None when none of them is given."""
  path = getattr(flag_values, "shapes_json", None)
  table = model_table(path) if path else None
  found: dict[str, Shape] = {}
  if flag_values.models:
    found.update((s.name, s) for s in parse_shapes(";".join(flag_values.models), flag="--models", table=table,
                                                      numbers=False))
  if flag_values.shapes:
    for s in parse_shapes(flag_values.shapes, table=table):
      found.setdefault(s.name, s)
  if path and not found:
    found.update((s.name, s) for s in parse_shapes("all", flag="--shapes_json", table=table))
  return list(found.values()) or None


def shapes_and_ms(shapes: Sequence[Shape], ms: Sequence[int] | None) -> tuple[list[tuple[str, int, int]],
                                                                               dict[str, list[int]] | None]:
  """(name, N, K) of each shape, and the Ms of those given with M (None when none was); refuses --m where every shape
  gives its own M (it would have no effect)."""
  own = {s.name: list(s.ms) for s in shapes if s.ms}
  if ms is not None and shapes and len(own) == len(shapes):
    raise UsageError("--m: every --shapes item gives its own M (M,N,K): --m would have no effect")
  return [(s.name, s.n, s.k) for s in shapes], own or None
