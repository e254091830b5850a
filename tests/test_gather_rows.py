"""The Mosaic GPU row gather (pallas_kernels/gather_rows_mosaic.py), the MoE layer's permute: interpreted on CPU
against NumPy indexing on fresh random rows (the rows past the count must stay unwritten: the interpreter fills fresh
buffers with NaN), lowered for an H200 at the layers' sizes, and natively on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import _platform
from helpers import backend_importable

IMPORTABLE = backend_importable("pallas_kernels.gather_rows_mosaic")
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason="pallas_kernels.gather_rows_mosaic does not import here")
F8 = jnp.float8_e4m3fn


def _case(rng, t, k, r, dtype=F8):
  x = (rng.standard_normal((t, k)) * 50).astype(np.float32)
  return jnp.asarray(x).astype(dtype), rng.integers(0, t, r).astype(np.int32)


def _gather(x, src, count, block_rows, interpret, divisor=1):
  from pallas_kernels import gather_rows_mosaic as g
  return g.gather_rows(x, jnp.asarray(src), jnp.int32(count), config=g.GatherRowsConfig(block_rows),
                       src_divisor=divisor, interpret=interpret)


@pytest.mark.parametrize("block_rows", [1, 8, 5])
def test_live_rows_are_gathered_and_the_rest_left_unwritten(rng, block_rows):
  for _ in range(3):
    t, k, r = int(rng.integers(1, 40)), 128 * int(rng.integers(1, 5)), int(rng.integers(1, 70))
    x, src = _case(rng, t, k, r)
    expected = np.asarray(x).astype(np.float32)[src]
    for count in sorted({-3, 0, 1, int(rng.integers(0, r + 1)), r, r + 7}):
      out = np.asarray(_gather(x, src, count, block_rows, True)).astype(np.float32)
      live = min(max(count, 0), r)
      np.testing.assert_array_equal(out[:live], expected[:live])
      assert np.isnan(out[live:]).all(), "a row past the count was written"


def test_source_rows_divided_in_the_kernel(rng):
  """src_divisor: the MoE layer passes each row's slot and top_k; the kernel reads the slot's token row."""
  t, k, r, top_k = 11, 256, 40, 3
  x, _ = _case(rng, t, k, r)
  slots = rng.integers(0, t * top_k, r).astype(np.int32)
  out = np.asarray(_gather(x, slots, 29, 8, True, divisor=top_k)).astype(np.float32)
  np.testing.assert_array_equal(out[:29], np.asarray(x).astype(np.float32)[slots[:29] // top_k])
  assert np.isnan(out[29:]).all()


def test_other_dtypes_and_one_compile_for_every_count(rng):
  x, src = _case(rng, 9, 256, 20, jnp.bfloat16)
  f = jax.jit(lambda c: _gather(x, src, c, 8, True))
  for count in (3, 20, 11):
    out = np.asarray(f(jnp.int32(count)), np.float32)
    np.testing.assert_array_equal(out[:count], np.asarray(x, np.float32)[src[:count]])
  assert f._cache_size() == 1


def test_problems_name_what_it_cannot_take():
  from pallas_kernels import gather_rows_mosaic as g
  assert not g.problems(7168, F8, g.GatherRowsConfig())
  assert any("multiple of 128" in p for p in g.problems(100, F8, g.GatherRowsConfig()))
  assert any("shared memory" in p for p in g.problems(7168, jnp.float32, g.GatherRowsConfig(16)))
  with pytest.raises(ValueError, match="block_rows"):
    g.GatherRowsConfig(0)


@pytest.mark.parametrize("t, r, k", [(4096, 32768, 7168), (1, 8, 2048), (64, 512, 768)])
def test_lowers_for_an_h200(t, r, k):
  from pallas_kernels import gather_rows_mosaic as g
  with _platform.abstract_h200():
    text = jax.export.export(jax.jit(lambda x, s, c: g.gather_rows(x, s, c, config=g.GatherRowsConfig())),
                             platforms=["cuda"])(jax.ShapeDtypeStruct((t, k), F8), jax.ShapeDtypeStruct((r,), jnp.int32),
                                                 jax.ShapeDtypeStruct((), jnp.int32)).mlir_module()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert "stablehlo.clamp" not in text and "stablehlo.maximum" not in text, "the count is clipped in the kernel"
  assert "stablehlo.gather" not in text, "the rows must be moved by the kernel, not by an XLA gather"


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_gathers_the_live_rows(rng):
  if not _platform.is_hopper():
    pytest.skip("needs a Hopper GPU")
  x, src = _case(rng, 4096, 7168, 32768)
  expected = np.asarray(x).astype(np.float32)[src]
  f = jax.jit(lambda c: _gather(x, src, c, 8, False))
  for count in (0, 1, 3940, 32767, 32768):
    out = np.asarray(f(jnp.int32(count))).astype(np.float32)
    np.testing.assert_array_equal(out[:count], expected[:count])
