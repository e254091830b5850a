"""Test configuration: GPU-marked tests skip where there is no suitable GPU; fresh random seeds per run.

One base seed per run, `JAXFP8_TEST_SEED` (drawn when unset, and set in the environment so that pytest-xdist's
workers share it), seeds every random input: the `rng` fixture (per test, from the base seed and the test's id) and
hypothesis (`--hypothesis-seed`). The seed is printed in the session header, so any failure reproduces with
`JAXFP8_TEST_SEED=<seed> make test`. JAXFP8_SEEDED_ONLY=1 keeps only the tests that draw from the seed.
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np
import pytest

from jaxfp8 import _platform

# CPU computations run inline in the calling thread. With XLA's asynchronous dispatch an interpreted Mosaic GPU
# kernel's computation can still be running when the test's next eager op is dispatched: the kernel's callbacks
# (barrier and copy waits, which run eager jax ops themselves) and that op then wait on each other for XLA's CPU
# thread pool (one thread per CPU) and the process hangs (tests/test_moe.py's router right after an interpreted
# layer, 1 run in 3 on 2 busy CPUs). A CTA of 4 interpreted warpgroups still hangs on 2 CPUs with it: each
# warpgroup's computation waits to run while two others block in barrier waits (tests/test_gemm_mosaic.py skips those).
jax.config.update("jax_cpu_enable_async_dispatch", False)

BASE_SEED = int(os.environ.setdefault("JAXFP8_TEST_SEED", str(np.random.SeedSequence().entropy % (2**32))))


def seeded_rng(name: str) -> np.random.Generator:
  """A generator for `name` (a test id, a cached problem's name) under this run's base seed."""
  return np.random.default_rng((BASE_SEED + zlib.crc32(name.encode())) % (2**32))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  # Hypothesis draws its examples from this seed unless one is given on the command line.
  if hasattr(config.option, "hypothesis_seed") and config.option.hypothesis_seed is None:
    config.option.hypothesis_seed = BASE_SEED


def pytest_report_header(config):
  return f"JAXFP8_TEST_SEED={BASE_SEED} (reproduce a run with JAXFP8_TEST_SEED={BASE_SEED} make test)"


# Source text by which a test module draws from the seed other than through the `rng` fixture.
_SEED_USES = ("seeded_rng", "JAXFP8_TEST_SEED", "hypothesis", '"pytest"')  # the last: a pytest run in a subprocess


def _draws_from_seed(item) -> bool:
  if "rng" in getattr(item, "fixturenames", ()):
    return True
  source = item.path.read_text() if item.path.suffix == ".py" else ""
  return any(use in source for use in _SEED_USES)


def pytest_collection_modifyitems(config, items):
  if os.environ.get("JAXFP8_SEEDED_ONLY"):
    # A seed loop (scripts/seed_loop.sh) re-runs only the tests whose inputs the seed changes; the others give the
    # same result for every seed and run once per suite.
    kept = [item for item in items if _draws_from_seed(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
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
  request.node.user_properties.append(("seed", BASE_SEED))
  print(f"JAXFP8_TEST_SEED={BASE_SEED}")
  return seeded_rng(request.node.nodeid)


def pytest_runtest_logreport(report):
  """With JAXFP8_FAILURE_LOG=path, each failure's report is appended to that file as it happens (pytest prints
  failures only at the end of the session, which a GPU run cut by its time limit never reaches)."""
  path = os.environ.get("JAXFP8_FAILURE_LOG")
  if path and report.failed:
    with open(path, "a") as f:
      f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
