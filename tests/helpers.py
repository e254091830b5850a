"""Helpers shared by the test modules: which implementations run here, stand-in devices for planner tests, and
random problems in the layouts the library takes."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxfp8 import _platform
from jaxfp8 import reference as ref

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


MOSAIC_GEMM_IMPORTABLE = backend_importable("pallas_kernels.gemm_mosaic")
MOSAIC_QUANT_IMPORTABLE = backend_importable("pallas_kernels.quant_mosaic")


# ---- quantizer outputs against the reference (docs/CONTRACT.md §1) ------------------------------------------------

INPUT_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}


def random_activations(rng: np.random.Generator, shape, dtype, *, spread: bool = True) -> np.ndarray:
  """Normal data whose rows span several orders of magnitude (so scales differ per group), never all zeros."""
  x = rng.standard_normal(shape).astype(np.float32)
  if spread:
    x *= np.exp2(rng.integers(-6, 8, size=shape[:-1] + (1,))).astype(np.float32)
  return x.astype(dtype)


def exact_codes(implementation: str | None, *, ue8m0: bool = False) -> bool:
  """Whether `implementation`'s codes are held bit-exact here: always, except the Mosaic quantizer running natively,
  whose hardware f32 division is not correctly rounded (docs/CONTRACT.md §1: one step on at most 1e-4 of the codes;
  a division by a UE8M0 power of two is exact even there)."""
  return ue8m0 or not (implementation == "mosaic" and ON_GPU)


def scales_bits(s) -> np.ndarray:
  s = np.asarray(s)
  return s.view(np.uint32) if s.dtype == np.float32 else s.astype(np.int64)


def assert_matches_reference(q, s, ref_q, ref_s, *, exact_codes: bool = True, scale_ulps: int = 0, context: str = ""):
  """Shapes equal; scales bit-exact (or within `scale_ulps` float32 ulps); codes exact, a zero's sign aside
  (docs/CONTRACT.md §1: the GPU's conversions give +0 where a negative quotient rounds to zero), or with
  exact_codes=False within one fp8 step on at most 1e-4 of the elements; pad rows are part of the comparison."""
  q = np.asarray(q)
  s = np.asarray(s)
  assert q.dtype == ref.FP8, f"{context}: q dtype {q.dtype}"
  assert q.shape == ref_q.shape, f"{context}: q shape {q.shape} != reference {ref_q.shape}"
  assert s.shape == ref_s.shape, f"{context}: s shape {s.shape} != reference {ref_s.shape}"
  assert s.dtype == ref_s.dtype, f"{context}: s dtype {s.dtype} != reference {ref_s.dtype}"
  if scale_ulps == 0 or s.dtype != np.float32:
    bad = scales_bits(s) != scales_bits(ref_s)
    nan_both = np.isnan(s) & np.isnan(ref_s) if s.dtype == np.float32 else np.zeros_like(bad)
    bad &= ~nan_both
    assert not bad.any(), (
        f"{context}: {bad.sum()} of {bad.size} scales differ, first at {np.argwhere(bad)[0]}: "
        f"{s[tuple(np.argwhere(bad)[0])]} vs reference {ref_s[tuple(np.argwhere(bad)[0])]}")
  else:
    ordinal = lambda v: v.view(np.int32).astype(np.int64)
    both_nan = np.isnan(s) & np.isnan(ref_s)
    dist = np.where(both_nan, 0, np.abs(ordinal(s) - ordinal(ref_s)))
    assert (np.isnan(s) == np.isnan(ref_s)).all(), f"{context}: NaN scales differ"
    assert dist.max(initial=0) <= scale_ulps, f"{context}: scales differ by {dist.max()} ulps"
  dist = ref.fp8_code_distance(q, ref_q)
  if exact_codes:
    assert not dist.any(), f"{context}: {np.count_nonzero(dist)} codes differ (max {dist.max()} steps), must be exact"
  else:
    assert dist.max(initial=0) <= 1, f"{context}: codes differ by up to {dist.max()} fp8 steps"
    allowed = math.ceil(1e-4 * dist.size)
    assert np.count_nonzero(dist) <= allowed, f"{context}: {np.count_nonzero(dist)} codes off by one step (> {allowed})"


def mosaic_interpret_config():
  """A Mosaic GEMM config that interprets reliably on CPU: 64x128 tiles, one consumer warpgroup, one CTA per tile.
  The grouped kernel's persistent loop (with valid_rows, its work items mix live, zero and empty tiles) hangs the
  Mosaic GPU interpreter now and then on a 2-CPU machine, one CTA or two (WORKSPACE.md); one CTA per tile did not in
  120 calls."""
  from pallas_kernels.gemm_mosaic import MosaicGemmConfig
  return MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, num_compute_wgs=1, persistent=False)


# ---- lowered programs (jax.export for CUDA under `_platform.abstract_h200()`) --------------------------------------

_STRUCTURE = ("func.func", "call", "return")  # what calls and returns, computing nothing


def kernel_calls(text: str) -> list[str]:
  """The custom-call targets of a lowered StableHLO module, in program order (e.g. 'mosaic_gpu_v2' per Mosaic
  kernel)."""
  import re
  return re.findall(r"stablehlo\.custom_call @\"?([\w$.]+)", text)


def lowered_ops(text: str) -> dict[str, set[str]]:
  """Per element type (f8E4M3FN, bf16, f16, f32), the StableHLO ops of a lowered module that take or give a tensor
  of it: what touches the activations, weights, scales and outputs outside the kernels (calls, returns and function
  signatures left out)."""
  import re
  found: dict[str, set[str]] = {}
  for line in text.splitlines():
    op = re.search(r"\"?stablehlo\.([a-z_]+)", line)
    if not op or line.lstrip().startswith(_STRUCTURE):
      continue
    for element in set(re.findall(r"x(f8E4M3FN|bf16|f16|f32)>", line)):
      found.setdefault(element, set()).add(op.group(1))
  return found


@contextlib.contextmanager
def count_compilations():
  """Records the name of every XLA compilation in the block (jax.monitoring)."""
  names: list[str] = []

  def listener(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(str(kwargs.get("fun_name")))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def rerun_on_cpu_devices(test_file: str, inner_variable: str, devices: int, *extra: str, timeout: int = 900) -> str:
  """Runs `test_file`'s tests again in a pytest subprocess on `devices` CPU devices (JAX_PLATFORMS=cpu, also on a GPU
  machine), with `inner_variable` set so that the re-run skips this step; returns its output after asserting it
  passed. extra: more pytest arguments (e.g. -k)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{inner_variable: "1"})
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
  path = pathlib.Path(test_file).resolve()
  result = subprocess.run(
      [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       "-W", "ignore::DeprecationWarning", *extra],
      cwd=path.parent.parent, env=env, capture_output=True, text=True, timeout=timeout)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-6000:]
  return output
