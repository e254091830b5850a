"""The real model shapes jaxfp8 is tested and benchmarked on (a copy of the project's shapes.json, shipped in the package)."""

from __future__ import annotations

import functools
import importlib.resources
import json


@functools.cache
def load() -> dict:
  """The whole shapes table: model -> {layer: [N, K]}, plus m_decode, m_prefill and block_sizes."""
  return json.loads(importlib.resources.files("jaxfp8").joinpath("data/shapes.json").read_text())


def weight_shapes(models: tuple[str, ...] | None = None) -> list[tuple[str, int, int]]:
  """(model/layer, N, K) for every weight of the given models (default: all of them)."""
  table = load()
  names = models or tuple(key for key, value in table.items() if isinstance(value, dict))
  return [(f"{model}/{layer}", n, k) for model in names for layer, (n, k) in table[model].items()]
