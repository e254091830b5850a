"""The grouped (mixture-of-experts) block-FP8 GEMM, docs/CONTRACT.md §7: both layouts on every implementation.

On CPU: the XLA path against the float64 reference (odd shapes, every block size, empty experts, experts of one row,
rows no expert owns holding NaN, clipped and negative counts, exactness), the Mosaic kernel interpreted (every
structure it has; interpret mode poisons fresh buffers with NaN, so an unwritten row fails), its work-item table, its
CUDA lowering at the real expert shapes, the API's errors and transforms. On an H200 (marked gpu + hopper): the
kernel at the expert shapes of DeepSeek-V3 and Qwen3-MoE, each expert checked against the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfp8
from jaxfp8 import _platform, grouped
from jaxfp8 import _transforms as transforms
from jaxfp8 import reference as ref
from jaxfp8.grouped import mosaic as grouped_mosaic
from pallas_kernels import grouped_gemm_mosaic as ggm
from pallas_kernels.gemm_mosaic import Dim, MosaicGemmConfig, tma_rows_ok

import helpers
from helpers import MOSAIC_GEMM_IMPORTABLE

F8 = jnp.float8_e4m3fn
TOL = {jnp.dtype(jnp.float32): 2e-4, jnp.dtype(jnp.bfloat16): 5e-3, jnp.dtype(jnp.float16): 5e-3}


def _weights(rng, e, n, k, block_size=(128, 128)):
  """E expert weights quantized per block; each expert at its own magnitude so that a wrong expert cannot hide."""
  qs, ss = [], []
  for i in range(e):
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-2, 2))
    q, s = ref.quantize_weight_blockwise(w, block_size)
    qs.append(q)
    ss.append(s)
  return np.stack(qs), np.stack(ss)


def _activations(rng, shape, gk, *, column_major=False, masked_m=None):
  """Quantized activations; a K that is no multiple of gk is quantized with zero columns up to a whole group, then
  cut (the last group's scale covers the K % gk columns left)."""
  k = shape[-1]
  x = np.zeros(shape[:-1] + (-(-k // gk) * gk,), np.float32)
  x[..., :k] = rng.standard_normal(shape)
  x *= np.float32(10.0) ** rng.uniform(-2, 2, shape[:-1] + (1,)).astype(np.float32)
  q, s = ref.per_token_group_quant_fp8(x, gk, column_major_scales=column_major, scale_tma_aligned=column_major,
                                       masked_m=masked_m)
  return np.ascontiguousarray(q[..., :k]), s


def _poison_unowned_rows(a_q, a_s, owned, column_major):
  """NaN codes and scales in the rows no expert owns: they must not reach the output."""
  a_q = a_q.copy()
  a_s = a_s.copy()
  a_q[~owned] = np.float32(np.nan)
  if column_major:
    np.moveaxis(a_s, -1, -2)[..., :owned.shape[-1], :][~owned] = np.nan
  else:
    a_s[~owned] = np.nan
  return a_q, a_s


def _check(out, expect, out_dtype):
  out = np.asarray(out)
  assert out.shape == expect.shape and out.dtype == jnp.dtype(out_dtype)
  out32 = out.astype(np.float32)
  assert np.isfinite(out32).all(), "NaN/inf in the output: an unwritten row or a poisoned row that leaked"
  assert ref.relative_error(out32, ref.cast_output(expect, out_dtype).astype(np.float32)) <= TOL[jnp.dtype(out_dtype)]
  # Rows no expert owns are exactly zero (the reference's are).
  zero_rows = (expect == 0).all(axis=-1)
  assert (out32[zero_rows] == 0).all()


def _ragged_case(rng, sizes, m, n, k, block_size=(128, 128), *, column_major=False):
  sizes = np.asarray(sizes, np.int32)
  b_q, b_s = _weights(rng, len(sizes), n, k, block_size)
  a_q, a_s = _activations(rng, (m, k), block_size[1], column_major=column_major)
  bounds = ref.ragged_group_bounds(sizes, m)
  owned = np.arange(m) < bounds[-1, 1] if len(sizes) else np.zeros(m, bool)
  a_q, a_s = _poison_unowned_rows(a_q, a_s, owned, column_major)
  expect = ref.ragged_block_fp8_matmul(a_q, b_q, a_s, b_s, sizes, block_size, a_s_column_major=column_major)
  return (a_q, b_q, a_s, b_s, sizes), expect


def _masked_case(rng, masked_m, t, n, k, block_size=(128, 128), *, column_major=False):
  masked_m = np.asarray(masked_m, np.int32)
  b_q, b_s = _weights(rng, len(masked_m), n, k, block_size)
  a_q, a_s = _activations(rng, (len(masked_m), t, k), block_size[1], column_major=column_major, masked_m=masked_m)
  live = np.arange(t)[None, :] < np.clip(masked_m, 0, t)[:, None]
  a_q, a_s = _poison_unowned_rows(a_q, a_s, live, column_major)
  expect = ref.masked_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, block_size, a_s_column_major=column_major)
  return (a_q, b_q, a_s, b_s, masked_m), expect


# ------------------------------------------------------------------------------------------------------ the XLA path

RAGGED_CASES = {
    # sizes, M, N, K, block_size
    "empty_and_single_rows": ([5, 0, 1, 0, 40, 1], 60, 256, 384, (128, 128)),   # 13 rows no expert owns
    "all_in_one_expert": ([0, 0, 33], 33, 128, 128, (128, 128)),
    "sum_past_m_is_cut": ([10, 30, 20], 35, 128, 256, (128, 128)),
    "negative_sizes_are_zero": ([-4, 7, -1, 9], 20, 200, 300, (64, 64)),     # odd N and K: partial blocks
    "one_expert_no_rows": ([0], 9, 128, 256, (128, 64)),
    "single_row": ([0, 1], 1, 64, 96, (32, 32)),
}


@pytest.mark.parametrize("case", list(RAGGED_CASES))
@pytest.mark.parametrize("column_major", [False, True])
def test_ragged_xla_matches_reference(rng, case, column_major):
  sizes, m, n, k, block_size = RAGGED_CASES[case]
  args, expect = _ragged_case(rng, sizes, m, n, k, block_size, column_major=column_major)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    out = jaxfp8.ragged_w8a8_block_fp8_matmul(*args, block_size, a_s_column_major=column_major, out_dtype=out_dtype,
                                              implementation="xla")
    _check(out, expect, out_dtype)


MASKED_CASES = {
    # masked_m, T, N, K, block_size
    "mixed": ([3, 0, 24, 17], 24, 256, 384, (128, 128)),
    "clipped_counts": ([-2, 99, 5], 13, 200, 300, (64, 64)),
    "all_empty": ([0, 0], 8, 128, 128, (128, 128)),
}


@pytest.mark.parametrize("case", list(MASKED_CASES))
@pytest.mark.parametrize("column_major", [False, True])
def test_masked_xla_matches_reference(rng, case, column_major):
  masked_m, t, n, k, block_size = MASKED_CASES[case]
  args, expect = _masked_case(rng, masked_m, t, n, k, block_size, column_major=column_major)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    out = jaxfp8.masked_w8a8_block_fp8_matmul(*args, block_size, a_s_column_major=column_major, out_dtype=out_dtype,
                                              implementation="xla")
    _check(out, expect, out_dtype)


def _exact_inputs(rng, shape_a, e, n, k, rows_axis_scales):
  a_q = rng.integers(-4, 5, shape_a).astype(np.float32).astype(ml_f8())
  b_q = rng.integers(-4, 5, (e, n, k)).astype(np.float32).astype(ml_f8())
  a_s = (2.0 ** rng.integers(-2, 3, rows_axis_scales)).astype(np.float32)
  b_s = (2.0 ** rng.integers(-2, 3, (e, n // 128, k // 128))).astype(np.float32)
  return a_q, b_q, a_s, b_s


def ml_f8():
  return jnp.dtype(F8).type


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
def test_exact_small_integers_bit_for_bit(rng, implementation):
  """docs/CONTRACT.md §2's exactness inputs: every implementation returns the float32 reference bit for bit."""
  if implementation == "mosaic" and not MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("the Mosaic GPU kernel does not import here")
  # One CTA per tile: the interpreter hung here now and then on a two-CTA persistent grid (WORKSPACE.md); the
  # persistent loop is interpreted by test_mosaic_ragged_interpreted and test_mosaic_masked_interpreted.
  config = MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, num_compute_wgs=1, persistent=False)
  config = config if implementation == "mosaic" else None
  sizes = np.array([7, 0, 64, 1], np.int32)
  a_q, b_q, a_s, b_s = _exact_inputs(rng, (80, 256), 4, 128, 256, (80, 2))
  out = jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, sizes, (128, 128), out_dtype=jnp.float32,
                                            implementation=implementation, config=config)
  expect = ref.ragged_block_fp8_matmul(a_q, b_q, a_s, b_s, sizes, (128, 128)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out), expect)
  masked_m = np.array([5, 16, 0, 9], np.int32)
  a_q, _, a_s, _ = _exact_inputs(rng, (4, 16, 256), 4, 128, 256, (4, 16, 2))
  out = jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, (128, 128), out_dtype=jnp.float32,
                                            implementation=implementation, config=config)
  expect = ref.masked_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, (128, 128)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(out), expect)


def test_masked_takes_the_quantizers_masked_output(rng):
  """The quantizer's output with masked_m (codes (E, T_pad, K), column-major scales (E, K/G, T')) goes in as it is."""
  e, t, n, k = 3, 20, 256, 256
  masked_m = jnp.array([20, 0, 7], jnp.int32)
  x = jnp.asarray(rng.standard_normal((e, t, k)).astype(np.float32)).astype(jnp.bfloat16)
  a_q, a_s = jaxfp8.per_token_group_quant_fp8(x, 128, column_major_scales=True, scale_tma_aligned=True,
                                              masked_m=masked_m, implementation="xla")
  b_q, b_s = _weights(rng, e, n, k)
  out = jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, (128, 128), a_s_column_major=True,
                                            implementation="xla")
  expect = ref.masked_block_fp8_matmul(np.asarray(a_q), b_q, np.asarray(a_s), b_s, np.asarray(masked_m),
                                       (128, 128), a_s_column_major=True)
  _check(out, expect, jnp.bfloat16)


def test_routing_changes_never_recompile(rng):
  args, _ = _ragged_case(rng, [4, 4, 4], 12, 128, 128)
  a_q, b_q, a_s, b_s, _ = args
  traces = []

  @jax.jit
  def f(group_sizes):
    traces.append(1)
    return jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, group_sizes, (128, 128), out_dtype=jnp.float32,
                                               implementation="xla")

  for sizes in ([4, 4, 4], [0, 12, 0], [1, 2, 3], [12, 0, 0]):
    out = f(jnp.array(sizes, jnp.int32))
    expect = ref.ragged_block_fp8_matmul(a_q, b_q, a_s, b_s, np.array(sizes), (128, 128))
    _check(out, expect, jnp.float32)
  assert len(traces) == 1


# ---------------------------------------------------------------------------------------- the Mosaic kernel, interpreted

# Every structure of the grouped kernel, small enough to interpret: one consumer warpgroup on a persistent grid or one
# CTA per (item, column tile), two warpgroups split in M or N (the idle one skipping its wgmmas, or not), two K blocks per
# step, weight scales ahead.
KINDS = {
    "ws1_64x128_persistent": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, num_compute_wgs=1,
                                              grid_size=3),
    "ws1_64x128_k2_ahead": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, k_blocks_per_step=2,
                                            num_compute_wgs=1, persistent=False, weight_scales_ahead=True),
    "ws2_m_128x128_k2": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=2, k_blocks_per_step=2,
                                         grid_size=2, grid_minor_dim=Dim.M, grid_tile_width=2),
    "ws2_n_64x256": MosaicGemmConfig(tile_m=64, tile_n=256, max_concurrent_steps=2, wg_split=Dim.N, grid_size=2),
    # Both consumers compute every work item's tile, the one holding none of its rows included.
    "ws2_m_128x128_no_skip": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=2, grid_size=2,
                                              skip_idle_consumers=False),
    # The masked layout's decode schedule: a persistent grid looping over the table's live items only.
    "ws1_64x128_live_grid": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, k_blocks_per_step=2,
                                             num_compute_wgs=1, weight_scales_ahead=True, grid_size=3,
                                             live_grid=True),
}

needs_mosaic = pytest.mark.skipif(not MOSAIC_GEMM_IMPORTABLE, reason="the Mosaic GPU kernel does not import here")


@needs_mosaic
@pytest.mark.parametrize("kind", list(KINDS))
def test_mosaic_ragged_interpreted(rng, kind):
  # 150 rows, not a multiple of 8 (the padded TMA view): experts crossing row-tile boundaries, empty ones, one of a
  # single row, and 9 trailing rows no expert owns.
  sizes = [70, 0, 1, 60, 0, 10]
  args, expect = _ragged_case(rng, sizes, 150, 256, 384, column_major=kind.endswith("persistent"))
  out = jaxfp8.ragged_w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=kind.endswith("persistent"),
                                            out_dtype=jnp.float32, implementation="mosaic", config=KINDS[kind])
  _check(out, expect, jnp.float32)


@needs_mosaic
@pytest.mark.parametrize("layout", ["ragged", "masked"])
def test_mosaic_leaves_unowned_rows_unwritten_when_asked(rng, layout):
  """zero_unowned_rows=False (the MoE layer's internal plan): the owned rows are the same, the others are never
  stored, so the interpreter's NaN fill of fresh buffers stays there."""
  from jaxfp8 import grouped
  config = KINDS["ws1_64x128_k2_ahead"]
  if layout == "ragged":
    sizes, rows = [70, 0, 1, 60, 0, 10], 150
    args, expect = _ragged_case(rng, sizes, rows, 256, 384, column_major=True)
    owned = np.arange(rows) < sum(sizes)
    counts = args[4]
  else:
    rows, counts_list = 70, [5, 0, 70, 33]
    args, expect = _masked_case(rng, counts_list, rows, 256, 256, column_major=True)
    owned = np.arange(rows)[None, :] < np.asarray(counts_list)[:, None]
    counts = args[4]
  a_q, b_q, a_s, b_s = args[:4]
  e = b_q.shape[0]
  outs = []
  for zero in (True, False):
    p = grouped.problem(layout, e, rows, b_q.shape[1], b_q.shape[2], (128, 128), out_dtype=jnp.float32,
                        a_s_column_major=True, zero_unowned_rows=zero)
    plan = grouped.plan(p, implementation="mosaic", config=config, interpret=True)
    assert zero or "left unwritten" in str(plan)
    outs.append(np.asarray(grouped.planner.run(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s),
                                               jnp.asarray(b_s), jnp.asarray(counts), plan=plan)))
  zeroed, unwritten = outs
  np.testing.assert_array_equal(unwritten[owned], zeroed[owned])
  assert (zeroed[~owned] == 0).all() and np.isnan(unwritten[~owned]).all()


@pytest.mark.parametrize("layout", ["ragged", "masked"])
@pytest.mark.parametrize("implementation", ["xla", pytest.param("mosaic", marks=needs_mosaic)])
def test_a_prepared_routing_table_gives_the_same_result(rng, implementation, layout):
  """`grouped.planner.prepare` once, `run(..., prepared=True)` with it: bit for bit the call on the counts (the MoE
  layer builds one table for its two GEMMs)."""
  from jaxfp8 import grouped
  if layout == "ragged":
    rows, counts = 150, [70, 0, 1, 60, 0, 10]
    args, _ = _ragged_case(rng, counts, rows, 256, 256, column_major=True)
  else:
    rows, counts = 70, [5, 0, 70, 33]
    args, _ = _masked_case(rng, counts, rows, 256, 256, column_major=True)
  a_q, b_q, a_s, b_s, sizes = map(jnp.asarray, args[:5])
  p = grouped.problem(layout, b_q.shape[0], rows, b_q.shape[1], b_q.shape[2], (128, 128), out_dtype=jnp.float32,
                      a_s_column_major=True)
  config = KINDS["ws1_64x128_k2_ahead"] if implementation == "mosaic" else None
  plan = grouped.plan(p, implementation=implementation, config=config, interpret=True)
  table = grouped.planner.prepare(sizes, plan)
  direct = grouped.planner.run(a_q, b_q, a_s, b_s, sizes, plan=plan)
  prepared = grouped.planner.run(a_q, b_q, a_s, b_s, table, plan=plan, prepared=True)
  np.testing.assert_array_equal(np.asarray(prepared), np.asarray(direct))
  assert np.isfinite(np.asarray(direct)).all() and np.asarray(direct).any()


@needs_mosaic
@pytest.mark.parametrize("kind", ["ws2_n_64x256", "ws1_64x128_persistent"])
def test_rows_at_given_starts(rng, kind):
  """`prepare_from_starts`: each group's rows from a multiple of the row tile (the MoE layer's prefill buffer), the
  rows between them poisoned: every group's rows come out as the packed call computes them, the gaps unwritten."""
  from jaxfp8 import grouped
  sizes = np.array([70, 0, 1, 60, 0, 10], np.int32)
  (a_q, b_q, a_s, b_s, _), expect = _ragged_case(rng, sizes, 141, 256, 384, column_major=False)
  starts = np.concatenate([[0], np.cumsum(-(-sizes // 64) * 64)[:-1]]).astype(np.int32)
  rows = int(starts[-1] + 64)
  dest = np.concatenate([starts[e] + np.arange(sizes[e]) for e in range(len(sizes))])
  a_gap = np.full((rows, a_q.shape[1]), np.nan, np.float32).astype(a_q.dtype)
  a_gap[dest] = a_q[:dest.size]
  s_gap = np.full((rows, a_s.shape[1]), np.nan, np.float32)
  s_gap[dest] = a_s[:dest.size]
  p = grouped.problem("ragged", len(sizes), rows, 384, 256, (128, 128), out_dtype=jnp.float32,
                      zero_unowned_rows=False)
  plan = grouped.plan(p, implementation="mosaic", config=KINDS[kind], interpret=True)
  table = grouped.planner.prepare_from_starts(jnp.asarray(starts), jnp.asarray(sizes), plan)
  out = np.asarray(grouped.planner.run(jnp.asarray(a_gap), jnp.asarray(b_q), jnp.asarray(s_gap), jnp.asarray(b_s),
                                       table, plan=plan, prepared=True))
  _check(out[dest], expect[:dest.size], jnp.float32)
  gaps = np.setdiff1d(np.arange(rows), dest)
  assert np.isnan(out[gaps]).all(), "a row between the groups was written"
  xla_plan = grouped.plan(p, implementation="xla")
  with pytest.raises(ValueError, match="Mosaic ragged"):
    grouped.planner.prepare_from_starts(jnp.asarray(starts), jnp.asarray(sizes), xla_plan)


# ------------------------------------------------------- gate_up with the SiLU-and-mul quantizer in its epilogue

FUSED_CONFIG = MosaicGemmConfig(tile_m=64, tile_n=256, max_concurrent_steps=2, wg_split=Dim.N, grid_size=2)


def _fused_expected(a_q, a_s_col, b_q, b_s, rows_of, h_dtype):
  """Per group: codes and column-major scales of SiLU(gate) * up of its rows' h rounded to h_dtype (§1, §8)."""
  out = {}
  for e, rows in rows_of.items():
    h = ref.block_fp8_matmul(a_q[rows], b_q[e], a_s_col[:, rows], b_s[e], (128, 128), a_s_column_major=True)
    out[e] = ref.per_token_group_quant_fp8(ref.cast_output(h, h_dtype), 128, fuse_silu_and_mul=True,
                                           column_major_scales=True)
  return out


def _check_fused(q, s, expected, rows_of, unowned):
  """Every owned row's codes and scales as the reference's (an h whose exp rounds one ulp apart may move a scale by
  ulps and a code by one step, §1), and the codes of rows no group owns unwritten (the interpreter's NaN fill)."""
  for e, rows in rows_of.items():
    want_q, want_s = expected[e]
    assert np.isfinite(s[:, rows]).all() and np.isfinite(q[rows].astype(np.float32)).all(), f"group {e} unwritten"
    np.testing.assert_allclose(s[:, rows], want_s, rtol=2 ** -7)
    assert np.mean(s[:, rows] == want_s) >= 0.95
    distance = ref.fp8_code_distance(q[rows], want_q)
    assert distance.max() <= 1 and np.mean(distance == 0) >= 0.99
  assert np.isnan(q[unowned].astype(np.float32)).all(), "a row of no group got codes"


@needs_mosaic
@pytest.mark.parametrize("h_dtype", [jnp.bfloat16, jnp.float16])
def test_gate_up_with_the_silu_quantizer_in_its_epilogue(rng, h_dtype):
  """`gate_up_silu_quant` interpreted on the MoE layer's aligned rows (each group from a multiple of 64, gaps of no
  group's rows poisoned): groups across row tiles, an empty one, one of a single row, two 128-column blocks, three K
  blocks on a two-stage pipeline, a persistent grid of two CTAs that loops over tiles (the gate and up consumers'
  hand-over runs many times), against §1 of the reference's h."""
  sizes = np.array([70, 0, 1, 50], np.int32)
  e, i, k = len(sizes), 256, 384
  starts = np.concatenate([[0], np.cumsum(-(-sizes // 64) * 64)[:-1]]).astype(np.int32)
  m = int(starts[-1] + 64 + 5)  # rows past the last group's tile too
  b_q, b_s = _weights(rng, e, 2 * i, k)
  a_q, a_s = _activations(rng, (m, k), 128, column_major=True)
  rows_of = {g: starts[g] + np.arange(sizes[g]) for g in range(e) if sizes[g]}
  owned = np.zeros(m, bool)
  owned[np.concatenate(list(rows_of.values()))] = True
  a_q, a_s = _poison_unowned_rows(a_q, a_s, owned, True)
  a_q[~owned] = 0  # the layer's gap rows hold some token's codes: finite (a NaN row's scales are no one's)
  a_s[:, :m][:, ~owned] = 1.0
  if h_dtype == jnp.float16:
    # Each row's scales times a power of two that brings its h near 64: SiLU(gate) * up within float16's range.
    for g, rows in rows_of.items():
      h = ref.block_fp8_matmul(a_q[rows], b_q[g], a_s[:, rows], b_s[g], (128, 128), a_s_column_major=True)
      a_s[:, rows] *= np.exp2(np.floor(np.log2(64.0 / np.abs(h).max(axis=1)))).astype(np.float32)
  items = ggm.ragged_items_from_starts(jnp.asarray(starts), jnp.asarray(sizes), m, 64)
  q, s = ggm.gate_up_silu_quant(jnp.asarray(a_q)[None], jnp.asarray(b_q), jnp.asarray(a_s)[None], jnp.asarray(b_s),
                                items, out_rows=m, h_dtype=h_dtype, eps=1e-10, config=FUSED_CONFIG, num_sms=132,
                                interpret=True)
  q, s = np.asarray(q)[0], np.asarray(s)[0]
  assert q.shape == (m, i) and q.dtype == F8 and s.shape == (i // 128, -(-m // 64) * 64) and s.dtype == np.float32
  _check_fused(q, s, _fused_expected(a_q, a_s, b_q, b_s, rows_of, h_dtype), rows_of, ~owned)


@needs_mosaic
@pytest.mark.parametrize("live_grid", [False, True])
def test_gate_up_with_the_silu_quantizer_on_the_masked_layout(rng, live_grid):
  """The same kernel on a masked table (each expert its own buffer, so no tile holds two experts' rows); with the
  live grid, on five CTAs for its four live items of eight (one CTA runs no iteration)."""
  masked_m = np.array([5, 0, 70, 64], np.int32)
  e, t, i, k = len(masked_m), 70, 128, 256
  b_q, b_s = _weights(rng, e, 2 * i, k)
  a_q, a_s = _activations(rng, (e, t, k), 128, column_major=True, masked_m=masked_m)
  items = ggm.masked_items(jnp.asarray(masked_m), t, 64, zero_unowned_rows=False)
  config = dataclasses.replace(FUSED_CONFIG, live_grid=live_grid, grid_size=5 if live_grid else FUSED_CONFIG.grid_size)
  q, s = ggm.gate_up_silu_quant(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s), jnp.asarray(b_s), items,
                                out_rows=t, h_dtype=jnp.bfloat16, eps=1e-10, config=config, num_sms=132,
                                interpret=True)
  q, s = np.asarray(q), np.asarray(s)
  for g in range(e):
    rows = {g: np.arange(masked_m[g])} if masked_m[g] else {}
    expected = _fused_expected(a_q[g], a_s[g], b_q, b_s, rows, jnp.bfloat16)
    _check_fused(q[g], s[g], expected, rows, np.arange(t) >= masked_m[g])


def test_the_fused_epilogue_refuses_what_it_cannot_pair():
  ok = FUSED_CONFIG
  assert ggm.silu_quant_problems(ok, 512, jnp.bfloat16) == []
  for config, n, dtype, match in [
      (dataclasses.replace(ok, tile_m=128, wg_split=Dim.M), 512, jnp.bfloat16, "two consumers split along N"),
      (dataclasses.replace(ok, tile_m=128), 512, jnp.bfloat16, "tile_m=64"),
      (ok, 384, jnp.bfloat16, "N=384 must hold a gate and an up half"),
      (ok, 512, jnp.float32, "16-bit float"),
  ]:
    problems = ggm.silu_quant_problems(config, n, dtype)
    assert any(match in p for p in problems), problems
  if MOSAIC_GEMM_IMPORTABLE:
    with pytest.raises(ValueError, match="N=384"):
      ggm.gate_up_silu_quant(jnp.zeros((1, 64, 128), F8), jnp.zeros((2, 384, 128), F8), jnp.ones((1, 1, 64)),
                             jnp.ones((2, 3, 1)), jnp.zeros((5, 2), jnp.int32), out_rows=64, h_dtype=jnp.bfloat16,
                             eps=1e-10, config=ok, num_sms=132, interpret=True)


@needs_mosaic
@pytest.mark.parametrize("e,i,k,rows", [(32, 2048, 7168, 4096 + 32 * 63), (128, 768, 2048, 32768 + 128 * 63)])
def test_gate_up_with_the_silu_quantizer_lowers_for_cuda(e, i, k, rows):
  """DeepSeek-V3 EP8 and Qwen3-30B-A3B gate_up at prefill: one kernel, whose outputs are the codes and scales (no
  h of 2I columns anywhere)."""
  structs = [jax.ShapeDtypeStruct((rows, k), F8), jax.ShapeDtypeStruct((e, 2 * i, k), F8),
             jax.ShapeDtypeStruct((k // 128, -(-rows // 4) * 4), jnp.float32),
             jax.ShapeDtypeStruct((e, 2 * i // 128, k // 128), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32)]
  with _platform.abstract_h200():
    p = grouped.problem("ragged", e, rows, 2 * i, k, (128, 128), out_dtype=jnp.bfloat16, a_s_column_major=True,
                        zero_unowned_rows=False)
    plan = grouped.plan(p, implementation="mosaic")
    assert grouped.planner.silu_quant_unsupported(plan, jnp.bfloat16) is None, str(plan)

    def call(a_q, b_q, a_s, b_s, sizes):
      starts = jnp.cumsum((sizes + 63) // 64 * 64) - (sizes + 63) // 64 * 64
      table = grouped.planner.prepare_from_starts(starts, sizes, plan)
      return grouped.planner.run_gate_up_silu_quant(a_q, b_q, a_s, b_s, table, plan=plan, h_dtype=jnp.bfloat16,
                                                    eps=1e-10)

    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*structs)
  assert [a.shape for a in exported.out_avals] == [(rows, i), (i // 128, -(-rows // 64) * 64)]
  text = exported.mlir_module()
  assert helpers.kernel_calls(text) == ["mosaic_gpu_v2"]
  assert f"x{2 * i}xbf16>" not in text and f"x{2 * i}xf32>" not in text


@needs_mosaic
@pytest.mark.parametrize("kind", ["ws1_64x128_k2_ahead", "ws2_m_128x128_k2", "ws1_64x128_live_grid"])
def test_mosaic_masked_interpreted(rng, kind):
  # T = 70 rows per expert (partial row tiles, T % 8 != 0), one expert empty, one full, counts past T clipped.
  args, expect = _masked_case(rng, [5, 0, 70, 99, 64], 70, 256, 256, column_major=True)
  out = jaxfp8.masked_w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=True, out_dtype=jnp.bfloat16,
                                            implementation="mosaic", config=KINDS[kind])
  _check(out, expect, jnp.bfloat16)


@needs_mosaic
@pytest.mark.parametrize("kind", ["ws1_64x128_k2_ahead", "ws2_n_64x256", "ws1_64x128_persistent"])
@pytest.mark.parametrize("layout,n", [("ragged", 200), ("ragged", 576), ("masked", 200)])
def test_mosaic_column_tails(rng, kind, layout, n):
  """N not a multiple of 128 (a partial last column tile: 72 columns of 200, 64 of 576), bfloat16 out: every owned
  column written (the interpreter's NaN fill shows any that is not), the last block at its own scale."""
  column_major = layout == "masked" or kind.endswith("persistent")
  if layout == "ragged":
    args, expect = _ragged_case(rng, [70, 0, 1, 60, 0, 10], 150, n, 256, column_major=column_major)
    call = jaxfp8.ragged_w8a8_block_fp8_matmul
  else:
    args, expect = _masked_case(rng, [5, 0, 70, 33], 70, n, 256, column_major=column_major)
    call = jaxfp8.masked_w8a8_block_fp8_matmul
  out = call(*args, (128, 128), a_s_column_major=column_major, out_dtype=jnp.bfloat16, implementation="mosaic",
             config=KINDS[kind])
  _check(out, expect, jnp.bfloat16)


# (gn, gk) the kernel takes besides DeepSeek-V3's (128, 128) (docs/CONTRACT.md §2)
OTHER_BLOCK_SIZES = [(64, 64), (128, 64), (64, 128)]


def _block_spread(rng, args, layout, block_size, column_major):
  """args with every activation and weight scale multiplied by its own power of two in [2^-6, 2^6], and the
  reference for them: a scale taken from a neighbouring block (64 columns or 64 K over) cannot hide."""
  a_q, b_q, a_s, b_s, counts = args
  a_s = (a_s * 2.0 ** rng.integers(-6, 7, a_s.shape)).astype(np.float32)
  b_s = (b_s * 2.0 ** rng.integers(-6, 7, b_s.shape)).astype(np.float32)
  f = ref.ragged_block_fp8_matmul if layout == "ragged" else ref.masked_block_fp8_matmul
  return (a_q, b_q, a_s, b_s, counts), f(a_q, b_q, a_s, b_s, counts, block_size, a_s_column_major=column_major)


BLOCK_SIZE_KINDS = ["ws1_64x128_k2_ahead", "ws2_n_64x256", "ws2_m_128x128_k2", "ws1_64x128_live_grid"]


@needs_mosaic
@pytest.mark.parametrize("block_index", range(len(OTHER_BLOCK_SIZES)), ids=[f"{a}x{b}" for a, b in OTHER_BLOCK_SIZES])
@pytest.mark.parametrize("kind_index", range(len(BLOCK_SIZE_KINDS)), ids=BLOCK_SIZE_KINDS)
def test_mosaic_block_sizes_interpreted(rng, block_index, kind_index):
  """Block sizes of 64: a weight scale per 64 columns (a 128-column sub-tile promoted as two of 64), activation and
  weight scales per 64 K (64-byte swizzled K blocks), K not a multiple of 128 where gk = 64, a partial last column
  tile (N = 200), every structure; the scales spread over 12 binades. The layouts alternate over the grid of
  (structure, block size), so that each structure and each block size meets both."""
  block_size, kind = OTHER_BLOCK_SIZES[block_index], BLOCK_SIZE_KINDS[kind_index]
  k = 320 if block_size[1] == 64 else 384
  layout = ("ragged", "masked")[(block_index + kind_index) % 2]
  if layout == "ragged":
    case = _ragged_case(rng, [70, 0, 1, 60, 0, 10], 150, 200, k, block_size, column_major=True)
    call = jaxfp8.ragged_w8a8_block_fp8_matmul
  else:
    case = _masked_case(rng, [5, 0, 70, 33], 70, 200, k, block_size, column_major=True)
    call = jaxfp8.masked_w8a8_block_fp8_matmul
  args, expect = _block_spread(rng, case[0], layout, block_size, True)
  out = call(*args, block_size, a_s_column_major=True, out_dtype=jnp.float32, implementation="mosaic",
             config=KINDS[kind])
  _check(out, expect, jnp.float32)


# masked_m of T = 70 rows (a partial last row tile) and the live tiles (items x 2 column tiles) each leaves for a grid
# of LIVE_GRID_CTAS, with the rows no expert owns zeroed or not
LIVE_GRID_CASES = {
    "every_expert_empty": ([0, 0, 0], {True: 6 * 2, False: 0}),
    "one_expert_with_rows": ([0, 33, 0], {True: 7 * 2, False: 1 * 2}),
    "every_expert_full": ([70, 99, 70], {True: 6 * 2, False: 6 * 2}),
}
LIVE_GRID_CTAS = 4


@needs_mosaic
@pytest.mark.parametrize("zero_unowned_rows", [True, False])
@pytest.mark.parametrize("case", list(LIVE_GRID_CASES))
def test_mosaic_masked_live_grid(rng, case, zero_unowned_rows):
  """The live grid's loop bound read at run time: no live tile (every CTA runs no iteration), fewer live tiles than
  CTAs (some run none), every expert full (no dead item: the static bound). Rows no expert owns are zeros, or with
  zero_unowned_rows=False never stored (the interpreter's NaN fill stays)."""
  masked_m, live_tiles = LIVE_GRID_CASES[case]
  t = 70
  args, expect = _masked_case(rng, masked_m, t, 256, 256, column_major=True)
  items = ggm.masked_items(jnp.asarray(masked_m, jnp.int32), t, 64, zero_unowned_rows)
  assert int(ggm.live_item_count(items)[0]) * 2 == live_tiles[zero_unowned_rows]
  config = dataclasses.replace(KINDS["ws1_64x128_live_grid"], grid_size=LIVE_GRID_CTAS)
  out = jaxfp8.masked_w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=True, out_dtype=jnp.float32,
                                            implementation="mosaic", config=config,
                                            zero_unowned_rows=zero_unowned_rows)
  if zero_unowned_rows:
    _check(out, expect, jnp.float32)
    return
  out = np.asarray(out)
  owned = np.arange(t)[None, :] < np.clip(masked_m, 0, t)[:, None]
  assert np.isnan(out[~owned]).all(), "a row no expert owns was stored"
  if owned.any():
    assert ref.relative_error(out[owned], expect[owned].astype(np.float32)) <= TOL[jnp.dtype(jnp.float32)]


def _items_cover(items, segments, tile_m):
  """Host check of the work-item table: every segment row in exactly one item of its segment, items in one row tile."""
  items = np.asarray(items)
  batch, group, lo, hi = (np.asarray(s) for s in segments)
  covered = {}
  for b, g, block, i_lo, i_hi in items.T:
    if i_hi <= i_lo:
      continue
    assert block * tile_m <= i_lo < i_hi <= (block + 1) * tile_m
    for r in range(i_lo, i_hi):
      assert (b, r) not in covered, f"row {r} of batch {b} in two items"
      covered[(b, r)] = g
  want = {(b, r): g for b, g, s_lo, s_hi in zip(batch, group, lo, hi) for r in range(s_lo, s_hi)}
  assert covered == want
  # Computed items come before zero items, and both before the dead ones: the live grid's count is their prefix.
  is_live = items[4] > items[3]
  live = items[:, is_live]
  is_zero = live[1] == ggm.ZERO_GROUP
  assert not (is_zero[:-1] & ~is_zero[1:]).any()
  assert is_live[:live.shape[1]].all() and int(ggm.live_item_count(jnp.asarray(items))[0]) == live.shape[1]
  return live.shape[1]


def _random_sizes(rng, e, m):
  kind = rng.integers(4)
  if kind == 0:  # one row per group where they fit: the most segment boundaries
    return np.where(np.arange(e) < m, 1, 0).astype(np.int32)
  if kind == 1:  # a few rows per group, boundaries everywhere inside the tiles
    return rng.integers(0, 4, e).astype(np.int32)
  sizes = rng.integers(-3, 3 * m // e + 2, e).astype(np.int32)
  sizes[rng.random(e) < 0.3] = 0
  return sizes


@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("zero_unowned_rows", [True, False])
def test_work_items_cover_every_row_once(rng, tile_m, zero_unowned_rows):
  """The item table's static size bounds every routing: decode-sized M with many experts included (the bound
  follows min(E, M), not E)."""
  # Shapes from small sets (each new shape compiles every op again); the sizes are fresh draws each time.
  for _ in range(14):
    e = int(rng.choice([1, 3, 8, 32, 128, 300]))
    m = int(rng.choice([1, 2, 7, 8, 63, 64, 65, 257]))
    sizes = _random_sizes(rng, e, m)
    segments = ggm.ragged_segments(jnp.asarray(sizes), m, zero_unowned_rows)
    used = _items_cover(ggm.work_items(segments, tile_m, ggm.ragged_num_items(m, e, tile_m)), segments, tile_m)
    assert used <= ggm.ragged_num_items(m, e, tile_m)
    t = int(rng.choice([1, 5, 64, 130]))
    masked_m = rng.integers(-2, t + 3, e).astype(np.int32)
    segments = ggm.masked_segments(jnp.asarray(masked_m), t, zero_unowned_rows)
    _items_cover(ggm.work_items(segments, tile_m, ggm.masked_num_items(e, t, tile_m, zero_unowned_rows)), segments,
                 tile_m)


@pytest.mark.parametrize("tile_m", [64, 4])
@pytest.mark.parametrize("gathered", [True, False])
def test_items_from_sorted_rows_are_the_ragged_items(rng, tile_m, gathered, monkeypatch):
  """`ragged_items_from_rows` (the MoE dispatch's table, from each row's group and sorted position) lists the work
  items `ragged_items` lists from the group sizes, in the same order; its padding items are empty. Both forms: one
  fused reduction (few rows) and the scatter."""
  monkeypatch.setattr(ggm, "GATHERED_TABLE_MAX", 1 << 30 if gathered else 0)
  for _ in range(16):  # shapes from small sets (each new shape compiles again); ids fresh each time
    n, e = int(rng.choice([1, 2, 7, 63, 64, 65, 79])), int(rng.choice([1, 3, 19]))
    ids = rng.integers(-2, e + 2, n)
    key = np.where((ids >= 0) & (ids < e), ids, e).astype(np.int32)
    rows = np.empty(n, np.int32)
    rows[np.argsort(key, kind="stable")] = np.arange(n)
    within = np.array([np.sum(key[:i] == key[i]) for i in range(n)], np.int32)
    sizes = np.bincount(key, minlength=e + 1)[:e].astype(np.int32)
    want = np.asarray(ggm.ragged_items(jnp.asarray(sizes), n, tile_m, zero_unowned_rows=False))
    got = np.asarray(ggm.ragged_items_from_rows(jnp.asarray(key), jnp.asarray(rows), jnp.asarray(within), e, tile_m))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got[:, got[4] > got[3]], want[:, want[4] > want[3]])
    assert (got[:, got[4] <= got[3]] == 0).all()


def test_ragged_item_bound_is_reached():
  """One row per group in one row tile, the zero row after them: every item the bound allows is needed."""
  for m, e, tile_m in ((8, 128, 64), (64, 128, 64), (50, 300, 64), (100, 300, 128)):
    sizes = np.where(np.arange(e) < m - 1, 1, 0).astype(np.int32)  # m - 1 groups of one row, then one zero row
    segments = ggm.ragged_segments(jnp.asarray(sizes), m)
    bound = ggm.ragged_num_items(m, e, tile_m)
    assert _items_cover(ggm.work_items(segments, tile_m, bound), segments, tile_m) == bound == m


# ------------------------------------------------------------------------------------------- lowering for an H200

# The expert GEMMs of the table: DeepSeek-V3 EP8-local (32 experts) gate_up and down, Qwen3-30B-A3B (128).
EXPERT_SHAPES = {"deepseek_v3_ep8.gate_up": (32, 4096, 7168), "deepseek_v3_ep8.down": (32, 7168, 2048),
                 "qwen3_30b_a3b.gate_up": (128, 1536, 2048), "qwen3_30b_a3b.down": (128, 2048, 768)}


def _lower(layout, e, rows, n, k, out_dtype, config=None, block_size=(128, 128)):
  gn, gk = block_size
  if layout == "ragged":
    a = jax.ShapeDtypeStruct((rows, k), F8)
    s = jax.ShapeDtypeStruct((k // gk, -(-rows // 4) * 4), jnp.float32)
    f = jaxfp8.ragged_w8a8_block_fp8_matmul
  else:
    a = jax.ShapeDtypeStruct((e, rows, k), F8)
    s = jax.ShapeDtypeStruct((e, k // gk, -(-rows // 4) * 4), jnp.float32)
    f = jaxfp8.masked_w8a8_block_fp8_matmul
  structs = [a, jax.ShapeDtypeStruct((e, n, k), F8), s,
             jax.ShapeDtypeStruct((e, -(-n // gn), k // gk), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32)]
  call = functools.partial(f, block_size=block_size, a_s_column_major=True, out_dtype=out_dtype,
                           implementation="mosaic", config=config)
  with _platform.abstract_h200():
    plan = grouped.plan_for(a, structs[1], block_size, out_dtype=out_dtype, a_s_column_major=True,
                            implementation="mosaic", config=config)
    assert plan.implementation == "mosaic", plan
    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*structs)
  assert exported.out_avals[0].shape == ((rows, n) if layout == "ragged" else (e, rows, n))
  # One grouped kernel; the codes, the scales and the output reach it and leave it as they are (free reshapes only:
  # no transpose, concatenate or cast outside the kernel), but for the launcher's pad of a_q's rows to the TMA row
  # tile where their count has no tiled view (and only there).
  text = exported.mlir_module()
  # (and a decode-sized ragged call's work-item table kernel before it)
  kernels = 2 if grouped_mosaic.table_kernel_config(plan.problem, plan.config) else 1
  assert helpers.kernel_calls(text) == ["mosaic_gpu_v2"] * kernels, helpers.kernel_calls(text)
  ops = helpers.lowered_ops(text)
  free = {"custom_call", "broadcast_in_dim", "reshape"}
  assert ops["f8E4M3FN"] - free == (set() if tma_rows_ok(rows) else {"pad"}), (rows, ops)
  for element in ("f32", {"bfloat16": "bf16", "float32": "f32"}[jnp.dtype(out_dtype).name]):
    assert ops.get(element, set()) <= free, (element, ops)
  return plan


@needs_mosaic
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES))
@pytest.mark.parametrize("layout,rows", [("ragged", 256), ("ragged", 16384 + 4), ("masked", 64), ("masked", 200)])
def test_default_configs_lower_for_cuda(shape, layout, rows):
  e, n, k = EXPERT_SHAPES[shape]
  plan = _lower(layout, e, rows, n, k, jnp.bfloat16)
  assert ggm.config_problems(plan.config, n, jnp.bfloat16) == []


@needs_mosaic
@pytest.mark.parametrize("layout,rows", [("ragged", 8), ("ragged", 4096), ("masked", 64)])
def test_column_tails_lower_for_cuda(layout, rows):
  """Experts of 576 output columns (a partial last column tile) on the default schedules, decode and prefill."""
  _lower(layout, 32, rows, 576, 7168, jnp.bfloat16)


@needs_mosaic
@pytest.mark.parametrize("block_size", OTHER_BLOCK_SIZES)
@pytest.mark.parametrize("layout,rows", [("ragged", 8), ("ragged", 4096), ("masked", 64)])
def test_block_sizes_lower_for_cuda(block_size, layout, rows):
  """The default schedules with blocks of 64 (sub-tiles of 64 columns where gn = 64), K an odd number of 64-wide
  blocks where gk = 64, N a multiple of 64 and not of 128."""
  k = 7168 + 64 if block_size[1] == 64 else 7168
  plan = _lower(layout, 32, rows, 4096 + 64, k, jnp.bfloat16, block_size=block_size)
  assert (plan.config.block_n, plan.config.block_k) == block_size
  assert plan.config.block_n % plan.config.sub_n == 0 and not plan.config.scales_per_column, plan.config


@needs_mosaic
@pytest.mark.parametrize("kind", list(KINDS))
def test_config_kinds_lower_for_cuda(kind):
  config = dataclasses.replace(KINDS[kind], grid_size=None, max_concurrent_steps=4)
  _lower("ragged", 32, 4100, 4096, 7168, jnp.float32, grouped_mosaic.fit_smem(config, jnp.float32, 7168))
  _lower("masked", 8, 128, 2048, 768, jnp.bfloat16, grouped_mosaic.fit_smem(config, jnp.bfloat16, 768))


def test_plans_say_why():
  a = jax.ShapeDtypeStruct((4096, 7168), F8)
  b = jax.ShapeDtypeStruct((32, 4096, 7168), F8)
  cpu = grouped.plan_for(a, b, (128, 128), device=helpers.fake_device(None))
  assert cpu.implementation == "xla" and "no NVIDIA GPU" in str(cpu)
  if MOSAIC_GEMM_IMPORTABLE:
    with _platform.abstract_h200():
      prefill = grouped.plan_for(a, b, (128, 128))
      decode = grouped.plan_for(jax.ShapeDtypeStruct((32, 64, 7168), F8), b, (128, 128))
      blocks_of_64 = grouped.plan_for(a, b, (128, 64))
      odd = grouped.plan_for(a, b, (64, 128))
      tail = grouped.plan_for(a, jax.ShapeDtypeStruct((32, 576, 7168), F8), (128, 128))
    assert tail.implementation == "mosaic", str(tail)  # a partial last column tile
    assert prefill.implementation == "mosaic" and prefill.config.persistent and "prefill" in str(prefill)
    assert (prefill.config.tile_m, prefill.config.tile_n, prefill.config.wg_split) == (64, 256, ggm.Dim.N)
    # (E, T, K) activations: the masked layout's decode schedule (its live grid is a knob until the GPU measures it)
    assert decode.config.tile_m == 64 and decode.config.live_grid == grouped_mosaic.DECODE_LIVE_GRID["masked"]
    assert "decode" in str(decode) and ("live items" in str(decode)) == decode.config.live_grid
    ragged = grouped.plan(grouped.problem("ragged", 128, 8, 1536, 2048, (128, 128)), implementation="mosaic")
    assert not ragged.config.persistent and not ragged.config.live_grid and "decode" in str(ragged), str(ragged)
    assert not prefill.config.live_grid
    # blocks of 64 timed against XLA's grouped GEMM run on the kernel by default; (64, 128) only when named
    assert blocks_of_64.implementation == "mosaic", str(blocks_of_64)
    assert odd.implementation == "xla" and "not yet timed" in str(odd), str(odd)


@pytest.mark.skipif(not MOSAIC_GEMM_IMPORTABLE, reason="needs jax.experimental.pallas.mosaic_gpu")
@pytest.mark.parametrize("groups,rows,n", [(0, 64, 256), (4, 64, 0), (4, 0, 256), (0, 0, 0)])
def test_empty_problems_plan_on_a_hopper(groups, rows, n):
  """No expert, no row or no column: the Mosaic plan exists (the call returns zeros without a launch), and an MoE
  layer without experts keeps packed rows."""
  from jaxfp8 import moe
  with _platform.abstract_h200():
    for layout in ("ragged", "masked"):
      plan = grouped.plan(grouped.problem(layout, groups, rows, n, 256, (128, 128)), implementation="mosaic")
      assert plan.implementation == "mosaic" and plan.problem.empty
    layer = moe.explain(jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16), jax.ShapeDtypeStruct((groups, 256, 256), F8),
                        jax.ShapeDtypeStruct((groups, 256, 128), F8), 2)
  assert layer.row_align == 1 or groups > 0, str(layer)


@pytest.mark.skipif(not MOSAIC_GEMM_IMPORTABLE, reason="needs jax.experimental.pallas.mosaic_gpu")
def test_prefill_schedule_is_the_same_whether_the_register_split_is_kept(monkeypatch):
  """The grouped prefill schedule takes one K block per step (one wgmma accumulator beside the running one), which
  fits the launch's registers where JAX 0.12 drops setmaxnreg: the plan does not depend on it."""
  from pallas_kernels import _jax_compat
  a = jax.ShapeDtypeStruct((4096, 7168), F8)
  b = jax.ShapeDtypeStruct((32, 4096, 7168), F8)
  plans = []
  for kept in (True, False):
    monkeypatch.setattr(_jax_compat, "register_split_kept", lambda kept=kept: kept)
    with _platform.abstract_h200():
      plans.append(grouped.plan_for(a, b, (128, 128)))
  assert plans[0].config == plans[1].config
  assert (plans[0].config.num_compute_wgs, plans[0].config.k_blocks_per_step) == (2, 1), str(plans[0])


# ----------------------------------------------------------------------------------------------- errors, transforms


def _good_ragged():
  e, m, n, k = 2, 8, 128, 256
  return dict(a_q=jnp.zeros((m, k), F8), b_q=jnp.zeros((e, n, k), F8), a_s=jnp.ones((m, 2), jnp.float32),
              b_s=jnp.ones((e, 1, 2), jnp.float32), group_sizes=jnp.array([3, 5], jnp.int32))


@pytest.mark.parametrize("change,error,match", [
    (dict(a_q=jnp.zeros((8, 256), jnp.bfloat16)), TypeError, "a_q must have dtype float8_e4m3fn"),
    (dict(b_q=jnp.zeros((128, 256), F8)), ValueError, "b_q must be 3-D"),
    (dict(b_q=jnp.zeros((2, 128, 384), F8)), ValueError, "must share K"),
    (dict(group_sizes=jnp.array([3, 5], jnp.int64 if jax.config.jax_enable_x64 else jnp.int16)), TypeError,
     "group_sizes must have dtype int32"),
    (dict(group_sizes=jnp.array([3, 5, 0], jnp.int32)), ValueError, r"group_sizes must have shape \(E,\) = \(2,\)"),
    (dict(a_s=jnp.ones((2, 8), jnp.float32)), ValueError, "a_s_column_major=True"),
    (dict(b_s=jnp.ones((2, 2, 2), jnp.float32)), ValueError, r"b_s must have shape \(E, ceil\(N/gn\), ceil\(K/gk\)\)"),
])
def test_ragged_errors_name_the_argument(change, error, match):
  args = {**_good_ragged(), **change}
  with pytest.raises(error, match=match):
    jaxfp8.ragged_w8a8_block_fp8_matmul(**args, block_size=(128, 128))


def test_masked_errors_name_the_argument():
  b_q, b_s = jnp.zeros((2, 128, 256), F8), jnp.ones((2, 1, 2), jnp.float32)
  with pytest.raises(ValueError, match="one buffer per expert"):
    jaxfp8.masked_w8a8_block_fp8_matmul(jnp.zeros((3, 8, 256), F8), b_q, jnp.ones((3, 8, 2), jnp.float32), b_s,
                                        jnp.zeros((2,), jnp.int32), (128, 128))
  with pytest.raises(ValueError, match=r"column-major a_s must have shape \(E, ceil\(K/gk\), T'\)"):
    jaxfp8.masked_w8a8_block_fp8_matmul(jnp.zeros((2, 8, 256), F8), b_q, jnp.ones((2, 2, 4), jnp.float32), b_s,
                                        jnp.zeros((2,), jnp.int32), (128, 128), a_s_column_major=True)
  with pytest.raises(TypeError, match="masked_m must have dtype int32"):
    jaxfp8.masked_w8a8_block_fp8_matmul(jnp.zeros((2, 8, 256), F8), b_q, jnp.ones((2, 8, 2), jnp.float32), b_s,
                                        jnp.zeros((2,), jnp.float32), (128, 128))
  with pytest.raises(ValueError, match="implementation must be one of"):
    jaxfp8.masked_w8a8_block_fp8_matmul(jnp.zeros((2, 8, 256), F8), b_q, jnp.ones((2, 8, 2), jnp.float32), b_s,
                                        jnp.zeros((2,), jnp.int32), (128, 128), implementation="triton")
  with pytest.raises(ValueError, match="config applies to the 'mosaic' implementation, not 'xla'"):
    jaxfp8.masked_w8a8_block_fp8_matmul(jnp.zeros((2, 8, 256), F8), b_q, jnp.ones((2, 8, 2), jnp.float32), b_s,
                                        jnp.zeros((2,), jnp.int32), (128, 128), implementation="xla",
                                        config=KINDS["ws2_n_64x256"])


def test_mosaic_refuses_what_it_cannot_run():
  args = _good_ragged()
  with pytest.raises(ValueError, match=r"implementation='mosaic' cannot run .* block sizes of 64 or 128, got "
                                       r"\(32, 32\)"):
    jaxfp8.ragged_w8a8_block_fp8_matmul(**{**args, "a_s": jnp.ones((8, 8), jnp.float32),
                                           "b_s": jnp.ones((2, 4, 8), jnp.float32)},
                                        block_size=(32, 32), implementation="mosaic")
  if MOSAIC_GEMM_IMPORTABLE:
    with pytest.raises(ValueError, match="the grouped kernel does not build CTA clusters"):
      jaxfp8.ragged_w8a8_block_fp8_matmul(**args, block_size=(128, 128), implementation="mosaic",
                                          config=MosaicGemmConfig(tile_m=128, tile_n=128, cluster_dim=Dim.N))


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
def test_transforms_refused_with_one_error(implementation):
  if implementation == "mosaic" and not MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("the Mosaic GPU kernel does not import here")
  args = _good_ragged()
  call = functools.partial(jaxfp8.ragged_w8a8_block_fp8_matmul, block_size=(128, 128), out_dtype=jnp.float32,
                           implementation=implementation)
  as_f32 = lambda a_s: call(args["a_q"], args["b_q"], a_s, args["b_s"], args["group_sizes"]).sum()
  with pytest.raises(transforms.TransformError, match="ragged_w8a8_block_fp8_matmul is not differentiable"):
    jax.grad(as_f32)(args["a_s"])
  with pytest.raises(transforms.TransformError, match="jax.vmap of jaxfp8.ragged_w8a8_block_fp8_matmul"):
    jax.vmap(lambda a_s: call(args["a_q"], args["b_q"], a_s, args["b_s"], args["group_sizes"]))(
        jnp.stack([args["a_s"]] * 2))
  out = jax.eval_shape(lambda: call(**args))
  assert out.shape == (8, 128) and out.dtype == jnp.float32


def test_no_experts_or_rows_give_zeros():
  out = jaxfp8.ragged_w8a8_block_fp8_matmul(jnp.zeros((4, 128), F8), jnp.zeros((0, 128, 128), F8),
                                            jnp.ones((4, 1), jnp.float32), jnp.ones((0, 1, 1), jnp.float32),
                                            jnp.zeros((0,), jnp.int32), (128, 128))
  assert out.shape == (4, 128) and not np.asarray(out, np.float32).any()


# ------------------------------------------------------------------------------------------------------- on the H200


def _device_problem(key, lead, rows, e, n, k):
  """Random codes and scales made on the device (the float64 reference runs on sampled rows only)."""
  ka, kb, ks, kt = jax.random.split(key, 4)
  a_q = jnp.clip(jax.random.normal(ka, (*lead, rows, k)) * 100, -448, 448).astype(F8)
  b_q = jnp.clip(jax.random.normal(kb, (e, n, k)) * 100, -448, 448).astype(F8)
  a_s = jax.random.uniform(ks, (*lead, k // 128, -(-rows // 4) * 4), minval=1e-4, maxval=1e-2)
  b_s = jax.random.uniform(kt, (e, -(-n // 128), k // 128), minval=1e-4, maxval=1e-2)
  return a_q, b_q, a_s, b_s


def _check_sampled(out, a_q, b_q, a_s_col, b_s, expert_rows, rng):
  """Up to 4 rows of every expert and the columns of its first and last 128-column block (partial where N % 128)
  against the float64 reference, per expert; every other row (no expert owns it) exactly 0. expert_rows: per expert,
  its rows' indices into out/a_q (2-D)."""
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  n = out.shape[-1]
  last = -(-n // 128) - 1
  cols = np.r_[0:128, last * 128:n]
  owned = np.zeros(out.shape[0], bool)
  for e, rows in enumerate(expert_rows):
    owned[rows] = True
    if not len(rows):
      continue
    pick = rng.choice(rows, min(4, len(rows)), replace=False)
    a = np.asarray(a_q[pick])
    scales = np.asarray(a_s_col[:, pick])
    b = np.asarray(b_q[e])[cols]
    sb = np.asarray(b_s[e])[[0, last]]
    expect = ref.block_fp8_matmul(a, b, scales, sb, (128, 128), a_s_column_major=True)
    err = ref.relative_error(out[np.ix_(pick, cols)], ref.cast_output(expect, jnp.bfloat16).astype(np.float32))
    assert err <= 5e-3, (e, err)
  assert not out[~owned].any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES))
@pytest.mark.parametrize("rows,skew", [(256, False), (4096, False), (4096, True), (16384, True)])
def test_gpu_ragged_expert_shapes(shape, rows, skew):
  rng = np.random.default_rng(rows + len(shape))
  e, n, k = EXPERT_SHAPES[shape]
  if skew:  # one expert with half the rows, a third of the experts empty
    weights = np.where(np.arange(e) % 3 == 0, 0.0, 1.0)
    sizes = rng.multinomial(rows // 2 - 7, weights / weights.sum())
    sizes[1] += rows // 2
  else:
    sizes = rng.multinomial(rows - 7, np.full(e, 1.0 / e))  # 7 rows no expert owns
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(rows), (), rows, e, n, k)
  out = jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, jnp.asarray(sizes, jnp.int32), (128, 128),
                                            a_s_column_major=True)
  bounds = ref.ragged_group_bounds(sizes, rows)
  _check_sampled(out, a_q, b_q, a_s, b_s, [np.arange(lo, hi) for lo, hi in bounds], rng)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("k", [128, 256])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_short_k_on_the_persistent_schedule(k, out_dtype):
  """The MoE layer tests' small shapes natively: 6 experts of 256 columns at K = 128 and 256 (one and two pipeline
  stages), 80 packed rows (about 13 a group: several groups share a row tile), on the persistent 64x256 schedule the
  planner gives them. Natively on an H100 the layer's every_id_local test (H=256, I=128: down at K=128 in one stage)
  missed the float64 reference by 1.7% where its CPU-interpreted run matched it; this isolates the GEMMs."""
  rng = np.random.default_rng(k)
  e, n, rows = 6, 256, 80
  sizes = rng.multinomial(rows - 7, np.full(e, 1.0 / e))
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(k), (), rows, e, n, k)
  out = jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, jnp.asarray(sizes, jnp.int32), (128, 128),
                                            a_s_column_major=True, implementation="mosaic", out_dtype=out_dtype,
                                            zero_unowned_rows=False)
  bounds = ref.ragged_group_bounds(sizes, rows)
  out = jnp.where(jnp.arange(rows)[:, None] < int(sizes.sum()), out, 0)  # rows no group owns: unwritten
  _check_sampled(out.astype(jnp.float32), a_q, b_q, a_s, b_s, [np.arange(lo, hi) for lo, hi in bounds], rng)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["ragged", "masked"])
@pytest.mark.parametrize("rows", [8, 256, 4096])
def test_gpu_column_tails(layout, rows):
  """32 experts of 576 output columns (a partial last column tile) on the Mosaic kernel's default schedules."""
  rng = np.random.default_rng(rows)
  e, n, k = 32, 576, 7168
  if layout == "ragged":
    sizes = rng.multinomial(rows - 3, np.full(e, 1.0 / e))
    a_q, b_q, a_s, b_s = _device_problem(jax.random.key(rows), (), rows, e, n, k)
    out = jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, jnp.asarray(sizes, jnp.int32), (128, 128),
                                              a_s_column_major=True, implementation="mosaic")
    bounds = ref.ragged_group_bounds(sizes, rows)
    _check_sampled(out, a_q, b_q, a_s, b_s, [np.arange(lo, hi) for lo, hi in bounds], rng)
    return
  t = min(rows, 200)
  masked_m = rng.integers(0, t + 1, e)
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(rows), (e,), t, e, n, k)
  out = jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, jnp.asarray(masked_m, jnp.int32), (128, 128),
                                            a_s_column_major=True, implementation="mosaic")
  flat_scales = jnp.moveaxis(a_s[:, :, :t], 0, 1).reshape(k // 128, e * t)
  _check_sampled(out.reshape(e * t, n), a_q.reshape(e * t, k), b_q, flat_scales, b_s,
                 [g * t + np.arange(masked_m[g]) for g in range(e)], rng)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES))
@pytest.mark.parametrize("t", [64, 200])
def test_gpu_masked_expert_shapes(shape, t):
  rng = np.random.default_rng(len(shape) + t)
  e, n, k = EXPERT_SHAPES[shape]
  masked_m = rng.integers(0, t + 1, e)
  masked_m[0] = 0
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(t), (e,), t, e, n, k)
  out = jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, jnp.asarray(masked_m, jnp.int32), (128, 128),
                                            a_s_column_major=True)
  # Flatten the experts' buffers into one row axis for the sampled check.
  flat_scales = jnp.moveaxis(a_s[:, :, :t], 0, 1).reshape(k // 128, e * t)
  _check_sampled(out.reshape(e * t, n), a_q.reshape(e * t, k), b_q, flat_scales, b_s,
                 [g * t + np.arange(masked_m[g]) for g in range(e)], rng)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("shape", ["qwen3_30b_a3b.gate_up", "qwen3_30b_a3b.down"])
@pytest.mark.parametrize("routed,zero_unowned_rows", [(8, True), (8, False), (256, True), (0, False)])
def test_gpu_masked_live_grid_is_the_per_tile_grid_bit_for_bit(shape, routed, zero_unowned_rows):
  """The masked decode schedule on its live grid (a persistent loop over the live items) against the same tiles on
  one CTA per (item, column tile) of the table's static size: the same bits in every owned row, zeros in the others
  when zeroing; no routed row at all leaves every CTA of the live grid without an iteration."""
  rng = np.random.default_rng(routed)
  e, n, k = EXPERT_SHAPES[shape]
  t = 64
  masked_m = np.minimum(rng.multinomial(routed, np.full(e, 1.0 / e)), t) if routed else np.zeros(e, np.int64)
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(routed), (e,), t, e, n, k)
  p = grouped.problem("masked", e, t, n, k, (128, 128), a_s_column_major=True, zero_unowned_rows=zero_unowned_rows)
  decode = grouped.plan(p, implementation="mosaic").config
  live = grouped.plan(p, implementation="mosaic", config=dataclasses.replace(decode, persistent=True, live_grid=True))
  per_tile = grouped.plan(p, implementation="mosaic", config=dataclasses.replace(decode, persistent=False,
                                                                                 live_grid=False))
  counts = jnp.asarray(masked_m, jnp.int32)
  outs = [np.asarray(grouped.planner.run(a_q, b_q, a_s, b_s, counts, plan=plan).astype(jnp.float32))
          for plan in (live, per_tile)]
  owned = np.arange(t)[None, :] < masked_m[:, None]
  np.testing.assert_array_equal(outs[0][owned], outs[1][owned])
  if zero_unowned_rows:
    assert not outs[0][~owned].any()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("block_size", OTHER_BLOCK_SIZES)
@pytest.mark.parametrize("layout,rows", [("ragged", 8), ("ragged", 1200), ("masked", 64)])
def test_gpu_block_sizes(block_size, layout, rows):
  """Blocks of 64 on the default schedules (decode and prefill): 8 experts of N = 1088 (a multiple of 64, not of
  128), K an odd number of 64-wide blocks where gk = 64, the scales spread over 12 binades, every row against the
  float64 reference."""
  rng = np.random.default_rng(rows + block_size[0] + 2 * block_size[1])
  e, n, k = 8, 1088, 1088 if block_size[1] == 64 else 1152
  if layout == "ragged":
    case = _ragged_case(rng, rng.multinomial(rows - 3, np.full(e, 1.0 / e)), rows, n, k, block_size,
                        column_major=True)
    call = jaxfp8.ragged_w8a8_block_fp8_matmul
  else:
    case = _masked_case(rng, rng.integers(0, rows + 1, e), rows, n, k, block_size, column_major=True)
    call = jaxfp8.masked_w8a8_block_fp8_matmul
  args, expect = _block_spread(rng, case[0], layout, block_size, True)
  out = call(*args, block_size, a_s_column_major=True, out_dtype=jnp.bfloat16, implementation="mosaic")
  _check(out, expect, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("shape", ["deepseek_v3_ep8.gate_up", "qwen3_30b_a3b.gate_up"])
@pytest.mark.parametrize("rows_per_expert", [70, 600])
def test_gpu_gate_up_with_the_silu_quantizer_in_its_epilogue(shape, rows_per_expert):
  """The fused gate_up at the layer's expert shapes on aligned rows (each expert from a multiple of 64, a third of
  them empty): up to 4 rows of every expert against §1 of the h that the unfused gate_up computes on the GPU with the
  same schedule (scales within a bf16 ulp of h's amax, codes within one step), every expert's rows written. (Against
  the float64 GEMM's h the codes of values near zero may move further: the tensor cores' sums differ from it by
  about 1e-4 of the row's amax, several subnormal fp8 steps; the layer's GPU test bounds that.)"""
  rng = np.random.default_rng(rows_per_expert + len(shape))
  e, n, k = EXPERT_SHAPES[shape]
  sizes = np.where(np.arange(e) % 3 == 0, 0, rng.integers(1, 2 * rows_per_expert, e)).astype(np.int32)
  starts = np.concatenate([[0], np.cumsum(-(-sizes // 64) * 64)[:-1]]).astype(np.int32)
  rows = int(starts[-1] + -(-sizes[-1] // 64) * 64) + 3
  a_q, b_q, a_s, b_s = _device_problem(jax.random.key(rows), (), rows, e, n, k)
  p = grouped.problem("ragged", e, rows, n, k, (128, 128), a_s_column_major=True, zero_unowned_rows=False)
  plan = grouped.plan(p, implementation="mosaic")
  if grouped.planner.silu_quant_unsupported(plan, jnp.bfloat16):
    # (the decode schedule at few rows per expert: the fused epilogue's tile instead)
    plan = grouped.plan(p, implementation="mosaic", config=MosaicGemmConfig(tile_m=64, tile_n=256, wg_split=Dim.N))
  table = grouped.planner.prepare_from_starts(jnp.asarray(starts), jnp.asarray(sizes), plan)
  q, s = grouped.planner.run_gate_up_silu_quant(a_q, b_q, a_s, b_s, table, plan=plan, h_dtype=jnp.bfloat16, eps=1e-10)
  q, s = np.asarray(q), np.asarray(s)
  rows_of = {g: rng.choice(starts[g] + np.arange(sizes[g]), min(4, sizes[g]), replace=False)
             for g in range(e) if sizes[g]}
  h = np.asarray(grouped.planner.run(a_q, b_q, a_s, b_s, table, plan=plan, prepared=True))
  assert h.dtype == jnp.bfloat16
  expected = {g: ref.per_token_group_quant_fp8(h[r], 128, fuse_silu_and_mul=True, column_major_scales=True)
              for g, r in rows_of.items()}
  _check_fused(q, s, expected, rows_of, np.zeros(rows, bool))


@pytest.mark.parametrize("layout", ["ragged", "masked"])
def test_zero_unowned_rows_is_a_checked_option_of_the_public_calls(rng, layout):
  """The owned rows are the same bits with or without zeroing the others (XLA: it writes zeros anyway)."""
  if layout == "ragged":
    args, _ = _ragged_case(rng, [3, 0, 9], 20, 256, 256)
    call, owned = jaxfp8.ragged_w8a8_block_fp8_matmul, np.arange(20) < 12
  else:
    args, _ = _masked_case(rng, [3, 0, 9], 12, 256, 256)
    call, owned = jaxfp8.masked_w8a8_block_fp8_matmul, np.arange(12)[None, :] < np.array([3, 0, 9])[:, None]
  zeroed = np.asarray(call(*args, (128, 128), implementation="xla", out_dtype=jnp.float32))
  free = np.asarray(call(*args, (128, 128), implementation="xla", out_dtype=jnp.float32, zero_unowned_rows=False))
  np.testing.assert_array_equal(free[owned], zeroed[owned])
  with pytest.raises(TypeError, match="zero_unowned_rows"):
    call(*args, (128, 128), implementation="xla", zero_unowned_rows="no")
