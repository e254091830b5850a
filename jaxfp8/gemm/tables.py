"""The GEMM backends' shipped per-device tables (jaxfp8/gemm/configs/*.json): reading one, and whether it is for the
device a call runs on."""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Mapping
from typing import Any


@functools.cache
def load(name: str) -> dict[str, Any] | None:
  """The table jaxfp8/gemm/configs/<name> as a dict, or None if the file is missing."""
  try:
    text = importlib.resources.files("jaxfp8.gemm").joinpath("configs", name).read_text()
  except (FileNotFoundError, ModuleNotFoundError):
    return None
  return json.loads(text)


def applies(device_kind: str | None, table: Mapping[str, Any]) -> bool:
  """Whether `table` (its "device", a device name such as "NVIDIA H200") is for a device of kind `device_kind`."""
  table_device = table.get("device")
  return bool(device_kind and table_device and table_device.lower() in device_kind.lower())
