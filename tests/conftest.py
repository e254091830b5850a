"""Test configuration: GPU-marked tests skip where there is no suitable GPU; fresh random seeds per test."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from jaxfp8 import _platform


def pytest_collection_modifyitems(config, items):
  capability = _platform.gpu_compute_capability()
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU with FP8 (sm >= 8.9)")
  skip_hopper = pytest.mark.skip(reason="needs a Hopper GPU (sm_90)")
  for item in items:
    if "gpu" in item.keywords and (capability is None or capability < (8, 9)):
      item.add_marker(skip_gpu)
    if "hopper" in item.keywords and (capability is None or capability[0] != 9):
      item.add_marker(skip_hopper)


@pytest.fixture
def rng(request):
  """A generator seeded per test and per run: fresh inputs every run, reproducible with JAXFP8_TEST_SEED=<printed seed>."""
  base = int(os.environ.get("JAXFP8_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
  seed = (base + zlib.crc32(request.node.nodeid.encode())) % (2**32)
  request.node.user_properties.append(("seed", base))
  print(f"JAXFP8_TEST_SEED={base}")
  return np.random.default_rng(seed)


def pytest_runtest_logreport(report):
  """With JAXFP8_FAILURE_LOG=path, each failure's report is appended to that file as it happens (pytest prints
  failures only at the end of the session, which a GPU run cut by its time limit never reaches)."""
  path = os.environ.get("JAXFP8_FAILURE_LOG")
  if path and report.failed:
    with open(path, "a") as f:
      f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
