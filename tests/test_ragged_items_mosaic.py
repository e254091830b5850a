"""The ragged grouped GEMM's work-item table in one Mosaic GPU kernel (pallas_kernels/ragged_items_mosaic.py), what
a decode-sized call given group sizes builds where `jaxfp8.grouped.mosaic.TABLE_KERNEL_BY_DEFAULT` is on: interpreted
on CPU against XLA's table (`grouped_gemm_mosaic.ragged_items`) on fresh random group sizes (negative, past M, all
in one group, one row per group), both zero-row choices, three row tiles; the grouped GEMM on it bit for bit the GEMM
on XLA's; lowered for an H200 as the table kernel and the GEMM only; natively on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import _platform, grouped
from jaxfp8.grouped import mosaic as grouped_mosaic
from jaxfp8.tools import bench_grouped
from helpers import backend_importable, kernel_calls

IMPORTABLE = backend_importable(grouped_mosaic.TABLE_KERNEL_MODULE)
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason=f"{grouped_mosaic.TABLE_KERNEL_MODULE} does not import here")


def _kernels():
  from pallas_kernels import grouped_gemm_mosaic, ragged_items_mosaic
  return ragged_items_mosaic, grouped_gemm_mosaic


def _sizes(rng, m, e):
  kind = rng.integers(4)
  if kind == 0:
    return rng.integers(-2, 3, e)
  if kind == 1:  # every row in one group
    return np.where(np.arange(e) == rng.integers(e), m, 0)
  if kind == 2:  # one row per group where they fit, the rest past M
    return np.where(np.arange(e) < m + 3, 1, 0)
  return rng.multinomial(m, np.ones(e) / e)


def _check(sizes, m, tile_m, zero_unowned_rows, interpret=True) -> bool:
  """The kernel's table against XLA's (its live items in order, every other item all zero); False where the kernel
  does not take the case."""
  rim, ggm = _kernels()
  config = rim.RaggedItemsConfig(tile_m, zero_unowned_rows)
  width = grouped_mosaic.table_columns(m, len(sizes), tile_m)
  if rim.problems(m, len(sizes), config, width):
    return False
  sizes = jnp.asarray(np.asarray(sizes, np.int32))
  got = np.asarray(rim.ragged_items(sizes, m=m, num_items=width, config=config, interpret=interpret))
  want = np.asarray(ggm.ragged_items(sizes, m, tile_m, zero_unowned_rows))
  live = want[4] > want[3]
  case = f"sizes={np.asarray(sizes).tolist()} M={m} tile_m={tile_m} zero_unowned_rows={zero_unowned_rows}"
  assert live[:live.sum()].all(), case  # XLA's live items come first
  np.testing.assert_array_equal(got[:, :live.sum()], want[:, live], err_msg=case)
  assert (got[:, live.sum():] == 0).all(), case
  return True


@pytest.mark.parametrize("tile_m", [64, 128, 4])
@pytest.mark.parametrize("zero_unowned_rows", [True, False])
def test_matches_xlas_table(rng, tile_m, zero_unowned_rows):
  done = 0
  while done < 3:
    m, e = int(rng.choice([1, 7, 8, 24, 64])), int(rng.choice([4, 32, 128, 256]))
    done += _check(_sizes(rng, m, e), m, tile_m, zero_unowned_rows)


def test_the_gemm_on_it_is_the_gemm_on_xlas_bit_for_bit(rng, monkeypatch):
  for e, r, zero in ((32, 8, True), (8, 24, False), (4, 64, True)):
    a_q, b_q, a_s, b_s = bench_grouped.make_problem(jax.random.key(r), e, 256, 256, r, (128, 128))
    sizes = jnp.asarray(bench_grouped.group_sizes(rng, r, e, "balanced"))
    outs = []
    for on in (False, True):
      monkeypatch.setattr(grouped_mosaic, "TABLE_KERNEL_BY_DEFAULT", on)
      outs.append(np.asarray(grouped.ragged_w8a8_block_fp8_matmul(
          a_q, b_q, a_s, b_s, sizes, block_size=(128, 128), a_s_column_major=True, implementation="mosaic",
          interpret=True, zero_unowned_rows=zero)).view(np.uint16))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_what_it_cannot_take_is_named():
  rim, _ = _kernels()
  config = rim.RaggedItemsConfig(64)
  assert any("M=65" in p for p in rim.problems(65, 32, config, 8))
  assert any("E=6" in p for p in rim.problems(8, 6, config, 8))
  assert any("num_items=6" in p for p in rim.problems(8, 32, config, 6))
  assert rim.problems(64, 256, config, 64) == []


@pytest.mark.parametrize("e,n,k,r", [(128, 1536, 2048, 8), (32, 4096, 7168, 64)])
def test_lowers_for_an_h200_as_the_table_kernel_and_the_gemm(monkeypatch, e, n, k, r):
  monkeypatch.setattr(grouped_mosaic, "TABLE_KERNEL_BY_DEFAULT", True)
  s = jax.ShapeDtypeStruct
  f8 = jnp.float8_e4m3fn
  with _platform.abstract_h200():
    plan = grouped.plan(grouped.problem("ragged", e, r, n, k, (128, 128), out_dtype=jnp.bfloat16,
                                        a_s_column_major=True), implementation="mosaic", device=_platform.device())
    text = jax.export.export(jax.jit(lambda *a: grouped.ragged_w8a8_block_fp8_matmul(
        *a, block_size=(128, 128), a_s_column_major=True, implementation="mosaic")), platforms=["cuda"])(
        s((r, k), f8), s((e, n, k), f8), s((k // 128, r), jnp.float32), s((e, n // 128, k // 128), jnp.float32),
        s((e,), jnp.int32)).mlir_module()
  assert kernel_calls(text).count("mosaic_gpu_v2") == 2, kernel_calls(text)
  assert "stablehlo.reduce" not in text, "the table's prefix sums and pick run in the kernel"
  assert "its work-item table from the group sizes in one Mosaic kernel" in str(plan), str(plan)


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_matches_xlas_table(rng):
  if not _platform.is_hopper():
    pytest.skip("needs a Hopper GPU")
  done = 0
  while done < 15:
    m, e = int(rng.choice([1, 8, 24, 64])), int(rng.choice([4, 32, 128, 256]))
    done += _check(_sizes(rng, m, e), m, 64, bool(rng.integers(2)), interpret=False)
