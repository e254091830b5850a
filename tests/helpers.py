"""Helpers shared by the test modules: which implementations run here, stand-in devices for planner tests, and
random problems in the layouts the library takes."""

from __future__ import annotations

import pytest

from jaxfp8 import _platform

ON_GPU = _platform.gpu_compute_capability() is not None

_KINDS = {(9, 0): "NVIDIA H200", (8, 9): "NVIDIA L40S", (8, 0): "NVIDIA A100-SXM4-80GB"}


def runnable(implementation: str) -> None:
  """Skips the test where `implementation`'s kernels cannot run natively (on CPU they run interpreted)."""
  if ON_GPU and implementation == "mosaic" and not _platform.is_hopper():
    pytest.skip("the Mosaic GPU kernels need Hopper")
  if ON_GPU and implementation == "triton" and not _platform.has_fp8_gpu():
    pytest.skip("the Triton kernels need sm >= 8.9")


def fake_device(capability: tuple[int, int] | None) -> _platform.Device:
  """A device for planner tests: an NVIDIA GPU of this compute capability (None: a CPU), 132 SMs."""
  if capability is None:
    return _platform.Device("cpu", None, _platform.H200_NUM_SMS)
  return _platform.Device(_KINDS.get(tuple(capability), f"sm_{capability[0]}{capability[1]}"), tuple(capability),
                          _platform.H200_NUM_SMS)


def backend_importable(module: str) -> bool:
  return _platform.import_error(module) is None


MOSAIC_GEMM_IMPORTABLE = backend_importable("jaxfp8.kernels.gemm_mosaic")
MOSAIC_QUANT_IMPORTABLE = backend_importable("jaxfp8.kernels.quant_mosaic")
