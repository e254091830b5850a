"""The Mosaic GPU block-FP8 GEMM (pallas_kernels/gemm_mosaic.py).

On CPU: every config kind runs in Mosaic GPU interpret mode against the float64 reference (docs/CONTRACT.md §2 tolerances, the
exactness check, bias, scale arrays wider than M, partial tiles), and every config the heuristic can pick is lowered
for CUDA at real model shapes (layout errors and shared-memory overflow fail here). Interpret mode fills fresh buffers
with NaN, so an output element the kernel forgets to write shows up as NaN and fails the comparison.
On an H200 (marked gpu + hopper): full-size DeepSeek-V3 / Qwen3 shapes.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import zlib
from typing import Any
import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest

import jaxfp8
from jaxfp8 import _platform
from jaxfp8 import reference as ref
from jaxfp8.gemm import mosaic as mosaic_backend
from pallas_kernels import gemm_mosaic as gm
from pallas_kernels.gemm_mosaic import Dim, MosaicGemmConfig

import helpers

# The (N, K) weight shapes of /work/shared/shapes.json (DeepSeek-V3 full/TP8/TP16, Qwen3-32B/4B) with N and K
# multiples of 128, the ones this kernel takes (576 and 2112 go to the portable kernel). Embedded so that the tests do
# not depend on where the shared folder is mounted.
MODEL_SHAPES = [
    (1536, 7168), (24576, 1536), (32768, 512), (7168, 16384), (36864, 7168), (7168, 18432), (24576, 7168),
    (4096, 7168), (7168, 2048), (3072, 1536), (4096, 512), (4608, 7168), (7168, 2304), (3072, 7168), (512, 7168),
    (7168, 256), (2048, 512), (7168, 1024), (2304, 7168), (7168, 1152), (10240, 5120), (5120, 8192), (51200, 5120),
    (5120, 25600), (6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728),
]
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 3, 100, 1000]

# Every structure the kernel has, small enough to interpret. grid_size=2 makes the persistent kernels loop over tiles.
KINDS: dict[str, MosaicGemmConfig] = {
    # One warpgroup, emit_pipeline, one CTA per tile.
    "simple_64x128_k2": MosaicGemmConfig(
        tile_m=64, tile_n=128, max_concurrent_steps=2, k_blocks_per_step=2, warp_specialized=False),
    "simple_128x256": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=2, warp_specialized=False),
    # Prefill: 2 consumer warpgroups stacked in M (64x128 each), persistent.
    "ws2_m_128x128": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=2, grid_size=2),
    # Two K blocks per step with the 16-column epilogue stores of the shipped config of that kind.
    "ws2_m_128x128_k2_epi16": MosaicGemmConfig(
        tile_m=128, tile_n=128, max_concurrent_steps=2, k_blocks_per_step=2, epi_tile_n=16, grid_size=3,
        grid_minor_dim=Dim.N, grid_tile_width=2),
    # 128x128 per warpgroup (two 64-row sub-tiles each), in both splits.
    "ws2_m_256x128": MosaicGemmConfig(tile_m=256, tile_n=128, max_concurrent_steps=2, grid_size=2),
    "ws2_n_128x256": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=2, wg_split=Dim.N, grid_size=2),
    # Medium M: 2 warpgroups side by side in N (64x64 each).
    "ws2_n_64x128": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=3, wg_split=Dim.N, grid_size=2),
    # CTA pairs in a cluster sharing the B tile (Dim.M) or the A tile (Dim.N) by TMA multicast; odd tile counts leave
    # one CTA of the last pair a tile wholly past the edge.
    "ws2_n_64x128_clusterM": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, wg_split=Dim.N,
                                              grid_size=4, cluster_dim=Dim.M),
    "ws2_m_128x128_clusterN": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=2, grid_size=2,
                                               cluster_dim=Dim.N),
    # Three consumer warpgroups of 64x128 (the large-M default's math), one CTA looping over the tiles; interpreted
    # only where the interpreter cannot deadlock (_run). The pair multicast of the shipped config is interpreted with
    # two warpgroups (ws2_*_cluster*); the combination is lowered for CUDA here and run on the H200.
    "ws3_m_192x128": MosaicGemmConfig(tile_m=192, tile_n=128, max_concurrent_steps=2, num_compute_wgs=3,
                                      grid_size=1, grid_tile_width=16),
    # Decode: one consumer warpgroup, one CTA per tile.
    "ws1_64x64": MosaicGemmConfig(tile_m=64, tile_n=64, max_concurrent_steps=4, num_compute_wgs=1, persistent=False),
    "ws1_64x128": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, num_compute_wgs=1, persistent=False),
    # Weight scales loaded a pipeline step ahead and carried: the decode default, the simple kernel, and two
    # warpgroups looping over tiles (the carry starts afresh at every tile).
    "ws1_64x128_k2_ahead": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=2,
                                            num_compute_wgs=1, persistent=False, weight_scales_ahead=True),
    "simple_128x256_ahead": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=2, warp_specialized=False,
                                             weight_scales_ahead=True),
    "ws2_n_128x256_ahead": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=2, wg_split=Dim.N,
                                            grid_size=2, weight_scales_ahead=True),
    # Sub-tiles narrower than a weight-scale block (several share one b_s): the schedules whose consumers fit the
    # launch's even register share (three consumers of 64x128 in 64-column sub-tiles), two K blocks per step, and
    # the decode schedule in 32-column sub-tiles with its scales a step ahead.
    "ws2_m_128x128_sub64": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=2, grid_size=2,
                                            sub_tile_n=64),
    "ws3_m_192x128_sub64": MosaicGemmConfig(tile_m=192, tile_n=128, max_concurrent_steps=2, num_compute_wgs=3,
                                            grid_size=1, grid_tile_width=16, sub_tile_n=64),
    "ws2_n_128x256_k2_sub64": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=2, k_blocks_per_step=2,
                                               wg_split=Dim.N, grid_size=2, sub_tile_n=64),
    "ws1_64x128_k2_ahead_sub32": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=2,
                                                  num_compute_wgs=1, persistent=False, weight_scales_ahead=True,
                                                  sub_tile_n=32),
}


# Tile widths that neither divide 128 nor are multiples of it: sub-tiles straddle weight-scale blocks and scale per
# column. Each with the N it is tested at (a multiple of the width whose tiles meet the block boundaries at several
# offsets), the M and output dtype.
COLUMN_KINDS: dict[str, tuple[MosaicGemmConfig, int, int, Any]] = {
    # Decode widths: 80 (N=10240 in 128 tiles), two K blocks per step, bf16 out (16-column epilogue).
    "ws1_64x80_k2": (MosaicGemmConfig(tile_m=64, tile_n=80, max_concurrent_steps=2, k_blocks_per_step=2,
                                      num_compute_wgs=1, persistent=False), 640, 4, jnp.bfloat16),
    # The same with the per-column weight-scale vectors loaded a step ahead and carried.
    "ws1_64x80_k2_ahead": (MosaicGemmConfig(tile_m=64, tile_n=80, max_concurrent_steps=2, k_blocks_per_step=2,
                                            num_compute_wgs=1, persistent=False, weight_scales_ahead=True),
                           640, 4, jnp.bfloat16),
    # 56 (N=7168 in 128 tiles): 8-column epilogue stores, unswizzled 16-byte rows in bf16, 32-byte in f32.
    "ws1_64x56_bf16": (MosaicGemmConfig(tile_m=64, tile_n=56, max_concurrent_steps=3, num_compute_wgs=1,
                                        persistent=False), 896, 13, jnp.bfloat16),
    "ws1_64x56_f32": (MosaicGemmConfig(tile_m=64, tile_n=56, max_concurrent_steps=3, num_compute_wgs=1,
                                       persistent=False), 896, 7, jnp.float32),
    # 192 (N=24576 in 128 tiles): two 96-column sub-tiles.
    "ws1_64x192": (MosaicGemmConfig(tile_m=64, tile_n=192, max_concurrent_steps=2, k_blocks_per_step=2,
                                    num_compute_wgs=1, persistent=False), 768, 64, jnp.bfloat16),
    # Two consumer warpgroups, split in N (96 columns each) and in M, on a persistent grid looping over tiles.
    "ws2_n_128x192": (MosaicGemmConfig(tile_m=128, tile_n=192, max_concurrent_steps=2, wg_split=Dim.N, grid_size=2),
                      768, 132, jnp.float32),
    "ws2_m_128x80": (MosaicGemmConfig(tile_m=128, tile_n=80, max_concurrent_steps=2, grid_size=3), 640, 200,
                     jnp.float32),
}


def _quantized_problem(rng, m: int, n: int, k: int, *, extra_scale_cols: int = 0, scale_pad_value=1.0,
                       decades: float = 2.0, block_size=(128, 128)):
  """Random activations and weights quantized as docs/CONTRACT.md §1 and 4 in blocks of block_size = (gn, gk);
  group and block magnitudes vary over +-`decades` decades so that a misapplied scale cannot hide."""
  gn, gk = block_size
  x = rng.standard_normal((m, k)).astype(np.float32)
  x *= np.repeat(10.0 ** rng.uniform(-decades, decades, (m, k // gk)), gk, axis=1).astype(np.float32)
  a_q, a_s = ref.per_token_group_quant_fp8(x, gk, column_major_scales=True, scale_tma_aligned=True)
  if extra_scale_cols:
    pad = np.full((a_s.shape[0], extra_scale_cols), scale_pad_value, np.float32)
    a_s = np.concatenate([a_s, pad], axis=1)
  w = rng.standard_normal((n, k)).astype(np.float32)
  w_scales = 10.0 ** rng.uniform(-decades, decades, (-(-n // gn), k // gk))
  w *= np.repeat(np.repeat(w_scales, gn, 0), gk, 1)[:n].astype(np.float32)
  b_q, b_s = ref.quantize_weight_blockwise(w, block_size)
  return a_q, b_q, a_s, b_s


def _matmul(a_q, b_q, a_s, b_s, *, config=None, out_dtype=jnp.bfloat16, bias=None, out_rows=None, interpret=False):
  """The kernel's launcher as the library's backend calls it: the backend's schedule when no config is given, and
  the device's SM count."""
  if config is None:
    config = mosaic_backend.default_config(a_q.shape[0], b_q.shape[0], a_q.shape[1], out_dtype,
                                           num_sms=_platform.num_sms())
  return gm.block_fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=out_dtype, bias=bias, config=config,
                             num_sms=_platform.num_sms(), out_rows=out_rows, interpret=interpret)


# The Mosaic GPU interpreter runs every warpgroup of every CTA as a thread, but their io_callbacks (barrier waits
# among them) on XLA's CPU thread pool, one thread per schedulable CPU: when every pool thread holds a blocked wait,
# the threads that would release them never run. On a 2-CPU machine a 4-warpgroup CTA (three consumers and the
# producer) deadlocked in about one interpreted run in six (2026-11-29: 2 pool threads in barrier waits, the 4-8
# warpgroup threads waiting to run their callbacks). With a pool thread per warpgroup it should not (untried here).
_INTERPRETER_POOL_THREADS = len(os.sched_getaffinity(0))


def _run(a_q, b_q, a_s, b_s, *, config, out_dtype=jnp.float32, bias=None):
  if config is not None and config.num_wgs + 1 > max(_INTERPRETER_POOL_THREADS, 3):  # 1-2 consumers: never hung
    pytest.skip(f"{config.num_wgs + 1} warpgroups per CTA can deadlock the interpreter on "
                f"{_INTERPRETER_POOL_THREADS} CPUs; lowered for CUDA and run on the H200 instead")
  out = _matmul(
      jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s), jnp.asarray(b_s), out_dtype=out_dtype,
      bias=None if bias is None else jnp.asarray(bias), config=config, interpret=True)
  return np.asarray(out)


def _check(out, a_q, b_q, a_s, b_s, out_dtype, bias=None):
  expect = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), a_s_column_major=True, bias=bias)
  assert out.shape == expect.shape and out.dtype == jnp.dtype(out_dtype)
  assert np.isfinite(out.astype(np.float32)).all(), "unwritten (NaN-poisoned) or non-finite output elements"
  tolerance = 2e-4 if jnp.dtype(out_dtype) == jnp.float32 else 5e-3
  err = ref.relative_error(out, ref.cast_output(expect, out_dtype))
  assert err <= tolerance, err


# --------------------------------------------------------------------------------------------- interpret-mode numerics


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("m,n,k", [(4, 384, 256), (132, 256, 512)])
def test_matches_reference(rng, kind, m, n, k):
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k)
  _check(_run(a_q, b_q, a_s, b_s, config=KINDS[kind]), a_q, b_q, a_s, b_s, jnp.float32)


@pytest.mark.parametrize("kind", list(COLUMN_KINDS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_per_column_weight_scales(rng, kind, with_bias):
  config, n, m, out_dtype = COLUMN_KINDS[kind]
  k = 384
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k)
  bias = (rng.standard_normal(n) * 10).astype(np.float32) if with_bias else None
  out = _run(a_q, b_q, a_s, b_s, config=config, out_dtype=out_dtype, bias=bias)
  _check(out, a_q, b_q, a_s, b_s, out_dtype, bias=bias)


@pytest.mark.parametrize("kind", ["ws1_64x80_k2", "ws1_64x192"])
def test_per_column_exact_small_integers(rng, kind):
  # Each column must take exactly its own block's scale; weight scales over 2^-6..2^6 so that a neighbour's shows.
  config, n, m, _ = COLUMN_KINDS[kind]
  _check_exact_small_integers(rng, config, m, n, 256, max_b_s_exponent=6)


@pytest.mark.parametrize("kind", ["simple_64x128_k2", "ws2_m_128x128", "ws2_n_128x256", "ws1_64x64"])
def test_single_k_block_and_odd_tiles(rng, kind):
  # K = one block (the pipeline has one step); N not a multiple of 256 (a tile past N for the 256-wide configs);
  # M = 8 (one partial row tile).
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 8, 128 * 3, 128)
  _check(_run(a_q, b_q, a_s, b_s, config=KINDS[kind]), a_q, b_q, a_s, b_s, jnp.float32)


@pytest.mark.parametrize("rows, cols, minor_dim, width", [(11, 192, 0, 16), (11, 6, 0, 8), (7, 5, 1, 2),
                                                            (4, 3, 0, 3), (1, 9, 1, 4)])
def test_live_first_order_visits_every_tile_once_live_rows_first(rows, cols, minor_dim, width):
  """The persistent loop's order with a live-row count: a bijection onto the tiles, the live rows' tiles first (in
  planar-snake order among themselves), for every count."""
  from pallas_kernels.gemm_mosaic_common import live_first_order
  lin = jnp.arange(rows * cols, dtype=jnp.int32)
  # one scalar index at a time, as in the kernel (planar_snake branches on it)
  order = jax.jit(jax.vmap(lambda t, live: live_first_order(t, (rows, cols), live, minor_dim, width), (0, None)))
  for live in range(rows + 1):
    i, j = (np.asarray(a) for a in order(lin, jnp.int32(live)))
    assert sorted(zip(i.tolist(), j.tolist())) == [(a, b) for a in range(rows) for b in range(cols)], live
    assert (i[:live * cols] < live).all() and (i[live * cols:] >= live).all(), live
    if live:
      snake = jax.vmap(lambda t: plgpu.planar_snake(t, (live, cols), minor_dim, width))(lin[:live * cols])
      np.testing.assert_array_equal(i[:live * cols], np.asarray(snake[0]))
      np.testing.assert_array_equal(j[:live * cols], np.asarray(snake[1]))


# The persistent kinds a live-row count runs on: the tile loop in live-first order, clusters along M and N.
@pytest.mark.parametrize("kind", ["ws2_m_128x128", "ws2_m_128x128_k2_epi16", "ws2_n_64x128_clusterM",
                                  "ws2_m_128x128_clusterN"])
def test_live_rows_on_a_persistent_grid(rng, kind):
  """Every count on a CTA loop over several row tiles: the live rows match the reference, every other row is exactly
  0 (the interpreter fills unwritten memory with NaN, so a tile the loop skipped would show), codes and scales past
  the count are NaN poison."""
  m, n, k = 300, 256, 256
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k, decades=1.0)
  expect = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), a_s_column_major=True)
  f = jax.jit(lambda a_q, a_s, live: gm.block_fp8_matmul(a_q, jnp.asarray(b_q), a_s, jnp.asarray(b_s),
                                                          out_dtype=jnp.float32, config=KINDS[kind], num_sms=132,
                                                          live_rows=live, interpret=True))
  for live in sorted({0, 1, 64, int(rng.integers(65, m)), m, m + 7}):
    codes, scales = a_q.copy(), a_s.copy()
    codes[live:] = np.float32(np.nan).astype(ref.FP8)
    scales[:, live:m] = np.nan
    out = np.asarray(f(jnp.asarray(codes), jnp.asarray(scales), jnp.int32(live)))
    assert (out[live:] == 0).all(), (kind, live)
    if live:
      assert ref.relative_error(out[:live], expect[:live]) <= 2e-4, (kind, live)


@pytest.mark.parametrize("kind,out_dtype,bias_dtype", [
    ("ws2_m_128x128", jnp.bfloat16, jnp.float32),
    ("ws2_n_128x256", jnp.float16, jnp.float16),
    ("ws1_64x128", jnp.bfloat16, jnp.bfloat16),
    ("simple_64x128_k2", jnp.float32, jnp.float32),
    ("ws2_m_128x128_k2_epi16", jnp.float32, None),
    ("simple_128x256", jnp.bfloat16, None),
    ("ws3_m_192x128", jnp.bfloat16, jnp.bfloat16),
])
def test_out_dtypes_and_bias(rng, kind, out_dtype, bias_dtype):
  m, n, k = 132, 384, 256
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k, decades=1.0)  # keeps float16 outputs finite
  bias = None
  if bias_dtype is not None:
    bias = (rng.standard_normal(n) * 10).astype(np.float32).astype(jnp.dtype(bias_dtype))
  out = _run(a_q, b_q, a_s, b_s, config=KINDS[kind], out_dtype=out_dtype, bias=bias)
  _check(out, a_q, b_q, a_s, b_s, out_dtype, bias=None if bias is None else bias.astype(np.float32))


@pytest.mark.parametrize("kind", ["simple_128x256", "ws2_m_128x128_k2_epi16", "ws2_n_128x256", "ws1_64x64",
                                  "ws3_m_192x128"])
def test_exact_small_integers(rng, kind):
  _check_exact_small_integers(rng, KINDS[kind], 132, 256, 640)


def _check_exact_small_integers(rng, config, m, n, k, max_b_s_exponent=2):
  """docs/CONTRACT.md §2 exactness: integer fp8 in [-4, 4], power-of-two scales, K <= 2048 -> bit-exact fp32."""
  a_q = rng.integers(-4, 5, (m, k)).astype(np.float32).astype(ref.FP8)
  b_q = rng.integers(-4, 5, (n, k)).astype(np.float32).astype(ref.FP8)
  a_s = (2.0 ** rng.integers(-2, 3, (k // 128, -(-m // 4) * 4))).astype(np.float32)
  b_s = (2.0 ** rng.integers(-max_b_s_exponent, max_b_s_exponent + 1, (-(-n // 128), k // 128))).astype(np.float32)
  out = _run(a_q, b_q, a_s, b_s, config=config)
  expect = ref.cast_output(ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), a_s_column_major=True), jnp.float32)
  np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("kind", ["ws2_m_128x128", "ws1_64x64", "simple_64x128_k2"])
def test_scale_columns_past_m_are_ignored(rng, kind):
  # a_s may be wider than M (M' >= M): its extra columns (NaN here) must not reach the output.
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 8, 256, 256, extra_scale_cols=8, scale_pad_value=np.nan)
  assert a_s.shape[1] == 16
  _check(_run(a_q, b_q, a_s, b_s, config=KINDS[kind]), a_q, b_q, a_s, b_s, jnp.float32)


@pytest.mark.parametrize("kind", ["ws1_64x64", "ws1_64x128_k2_ahead", "ws2_m_128x128", "ws2_n_128x256",
                                  "simple_128x256"])
@pytest.mark.parametrize("n", [200, 576])
def test_column_tails(rng, kind, n):
  """N not a multiple of 128 (DeepSeek-V3's kv_a_proj_with_mqa has 576 columns; 200 leaves a 72-column block): the
  last column tile partial, its weight rows read as zeros, the last block's scale its own, the bias padded; every
  column written (the interpreter's NaN fill shows any that is not), with the bias, in bfloat16."""
  m, k = 70, 256
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k)
  bias = (rng.standard_normal(n) * 10).astype(np.float32)
  out = _run(a_q, b_q, a_s, b_s, config=KINDS[kind], out_dtype=jnp.bfloat16, bias=bias)
  _check(out, a_q, b_q, a_s, b_s, jnp.bfloat16, bias=bias)


@pytest.mark.parametrize("kind", ["ws1_64x128_k2_ahead", "ws2_n_128x256"])
def test_column_tails_exact_small_integers(rng, kind):
  # The partial block takes exactly its own scale (scales 2^-6..2^6, so that a neighbour's shows).
  _check_exact_small_integers(rng, KINDS[kind], 70, 200, 256, max_b_s_exponent=6)


def test_any_m(rng):
  # The contract promises M % 4 == 0, but nothing in the kernel needs it (only the scale array's M' % 4 == 0).
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 5, 128, 256)
  a_q = a_q[:5]
  _check(_run(a_q, b_q, a_s, b_s, config=KINDS["ws2_m_128x128"]), a_q, b_q, a_s, b_s, jnp.float32)


# (gn, gk) the kernel takes besides DeepSeek-V3's (128, 128) (docs/CONTRACT.md §2), and the structures they are
# interpreted on with the N each is run at: one CTA per tile with two K blocks per step and scales ahead, two
# consumers side by side along N on a persistent grid, the simple kernel, two K blocks with 16-column stores,
# 56-column tiles that scale per column (a tile meets two blocks of 64 at several offsets), and 80-column ones.
OTHER_BLOCK_SIZES = [(64, 64), (128, 64), (64, 128)]
BLOCK_SIZE_KINDS = {"ws1_64x128_k2_ahead": (KINDS["ws1_64x128_k2_ahead"], 200),
                    "ws2_n_128x256": (KINDS["ws2_n_128x256"], 200),
                    "simple_64x128_k2": (KINDS["simple_64x128_k2"], 200),
                    "ws2_m_128x128_k2_epi16": (KINDS["ws2_m_128x128_k2_epi16"], 200),
                    "ws1_64x56_f32": (COLUMN_KINDS["ws1_64x56_f32"][0], 896),
                    # 80-column sub-tiles: wider than gn = 64 and not a multiple of it, the backend narrows them
                    "ws2_m_128x80": (COLUMN_KINDS["ws2_m_128x80"][0], 640)}


@pytest.mark.parametrize("block_size", OTHER_BLOCK_SIZES)
@pytest.mark.parametrize("kind", list(BLOCK_SIZE_KINDS))
def test_block_sizes(rng, block_size, kind):
  """Blocks of 64 through the public call (the backend sets the config's blocks, and 64-column sub-tiles where
  gn = 64 and the tile's sub-tiles are wider): a weight scale per 64 columns, activation and weight scales per 64 K
  (64-byte swizzled K blocks), K an odd number of 64-wide blocks where gk = 64, a partial last column tile, a bias."""
  config, n = BLOCK_SIZE_KINDS[kind]
  m, k = 70, 320 if block_size[1] == 64 else 384
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k, block_size=block_size)
  bias = (rng.standard_normal(n) * 10).astype(np.float32)
  out = jaxfp8.w8a8_block_fp8_matmul(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s), jnp.asarray(b_s),
                                     block_size, a_s_column_major=True, bias=jnp.asarray(bias),
                                     out_dtype=jnp.float32, implementation="mosaic", config=config, interpret=True)
  expect = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, block_size, a_s_column_major=True, bias=bias)
  out = np.asarray(out)
  assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
  assert ref.relative_error(out, ref.cast_output(expect, jnp.float32)) <= 2e-4


def test_every_config_takes_every_block_size():
  """The backend fits any config to a block size: sub-tiles wider than gn narrowed to the widest that splits the
  warpgroup's columns (a config no kernel could build would raise here), every other field kept."""
  configs = [*KINDS.values(), *DEEP_KINDS.values(), *(config for config, *_ in COLUMN_KINDS.values())]
  for config in configs:
    for block_size in OTHER_BLOCK_SIZES:
      fitted = mosaic_backend.with_block_size(config, block_size)
      assert (fitted.block_n, fitted.block_k) == block_size
      assert fitted.sub_n == config.sub_n if config.sub_n <= block_size[0] else fitted.sub_n <= block_size[0]
      assert dataclasses.replace(fitted, block_n=128, block_k=128, sub_tile_n=config.sub_tile_n) == config


@pytest.mark.parametrize("block_size", OTHER_BLOCK_SIZES)
@pytest.mark.parametrize("m", [4, 256, 4096])
def test_block_sizes_lower_for_cuda(block_size, m):
  """The default schedules (decode, two row tiles, prefill) with blocks of 64, lowered for an H200: one kernel."""
  gn, gk = block_size
  n, k = 7168 + 64, 2048 + (64 if gk == 64 else 0)
  structs = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((k // gk, -(-m // 4) * 4), jnp.float32),
             jax.ShapeDtypeStruct((-(-n // gn), k // gk), jnp.float32)]
  call = lambda *xs: jaxfp8.w8a8_block_fp8_matmul(*xs, block_size, a_s_column_major=True, implementation="mosaic")
  with _platform.abstract_h200():
    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(*structs)
    plan = jaxfp8.gemm.planner.plan(jaxfp8.gemm.planner.problem(m, n, k, block_size), implementation="mosaic")
    default = jaxfp8.gemm.planner.plan(jaxfp8.gemm.planner.problem(m, n, k, block_size))
  assert helpers.kernel_calls(exported.mlir_module()) == ["mosaic_gpu_v2"]
  assert (plan.config.block_n, plan.config.block_k) == block_size, plan
  if block_size in jaxfp8.gemm.mosaic.DEFAULT_BLOCK_SIZES:  # timed against Triton on an H100: Mosaic from M > 4
    assert (default.implementation == "mosaic") == (m > 4), str(default)
  else:  # not by default until timed against the other kernels
    assert default.implementation != "mosaic" and (m <= 4 or "not yet timed" in str(default)), str(default)


def test_default_config_runs(rng):
  for m in (4, 132):
    a_q, b_q, a_s, b_s = _quantized_problem(rng, m, 256, 256)
    _check(_run(a_q, b_q, a_s, b_s, config=None), a_q, b_q, a_s, b_s, jnp.float32)


def test_poison_is_detected():
  # The NaN fill of interpret mode is what makes forgotten outputs fail: check that it is on, with a kernel whose
  # scales for one row are NaN: only that row may be NaN.
  rng = np.random.default_rng(0)
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 8, 128, 128)
  a_s[0, 3] = np.nan
  out = _run(a_q, b_q, a_s, b_s, config=KINDS["ws1_64x64"])
  assert np.isnan(out[3]).all() and np.isfinite(np.delete(out, 3, axis=0)).all()


@pytest.mark.parametrize("kind", ["simple_128x256", "ws2_m_128x128", "ws1_64x64", "ws2_n_128x256"])
def test_no_data_races(rng, kind, capfd):
  # The interpreter's happens-before race detector, e.g. on the epilogue's SMEM slots against their TMA stores. In JAX
  # 0.11.2 it also flags the warp-specialized pipeline's own protocol (the producer's TMA write of a stage against the
  # consumer's earlier read of it, ordered by the consumed barrier that it does not model): those reports, and only
  # those, name the scale load in scaled_mma_step; every other report fails the test.
  # JAX 0.12's detector raises at the first race instead of printing each: its report is then the exception's.
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 132, 256, 256)
  try:
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
      out = np.asarray(_matmul(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s), jnp.asarray(b_s),
                               out_dtype=jnp.float32, config=KINDS[kind]))
    text = capfd.readouterr().out
  except Exception as e:  # noqa: BLE001 - only a race report is expected; anything else is re-raised
    text = "".join(traceback.format_exception(e))
    if "RACE DETECTED" not in text:
      raise
    out = None
  reports = text.split("RACE DETECTED")[1:]
  unexplained = [r for r in reports if "scaled_mma_step" not in r]
  assert not unexplained, unexplained[0]
  if not KINDS[kind].warp_specialized:
    assert not reports
  if out is not None:
    _check(out, a_q, b_q, a_s, b_s, jnp.float32)


# ------------------------------------------------------------------------------------------------------ validation


def _args(m=8, n=256, k=384, m_cols=None):
  return (jnp.zeros((m, k), jnp.float8_e4m3fn), jnp.zeros((n, k), jnp.float8_e4m3fn),
          jnp.ones((k // 128, m_cols or m), jnp.float32), jnp.ones((n // 128, k // 128), jnp.float32))


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0], a[1][:196], a[2], a[3][:2]), "N=196 must be a positive multiple of 8"),
    (lambda a: (a[0][:, :200], a[1][:, :200], a[2][:2], a[3][:, :2]), "K=200 must be a positive multiple of 128"),
    (lambda a: (a[0].astype(jnp.float8_e5m2), *a[1:]), "a_q must have dtype float8_e4m3fn"),
    (lambda a: (a[0], a[1], a[2][:, :6], a[3]), r"column-major a_s must have shape \(ceil\(K/gk\), M'\) = \(3, >= 8\)"),
    (lambda a: (a[0], a[1], a[2], a[3].T), "b_s must have shape"),
    (lambda a: (a[0], a[1], a[2].astype(jnp.bfloat16), a[3]), "a_s must have dtype float32"),
    (lambda a: (a[0], a[1][:, :128], a[2], a[3]), "must share K"),
])
def test_rejects_unsupported_inputs(change, match):
  """What the kernel cannot take is refused before it is built, naming the argument (the library's validation and
  the backend's `shape_problems`)."""
  a_q, b_q, a_s, b_s = change(_args())
  with pytest.raises((ValueError, TypeError), match=match):
    jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), a_s_column_major=True, implementation="mosaic",
                                 interpret=True)


def test_any_m_and_any_scale_columns_run(rng):
  """M that is no multiple of 4 or 8, and column-major scales whose M' is no multiple of 4: the backend pads."""
  a_q, b_q, a_s, b_s = _quantized_problem(rng, 6, 256, 256)
  out = jaxfp8.w8a8_block_fp8_matmul(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s[:, :6]), jnp.asarray(b_s),
                                     (128, 128), a_s_column_major=True, out_dtype=jnp.float32,
                                     implementation="mosaic", interpret=True)
  _check(np.asarray(out), a_q, b_q, a_s[:, :6], b_s, jnp.float32)


@pytest.mark.parametrize("kwargs", [
    dict(tile_n=100), dict(tile_n=264), dict(tile_n=200), dict(tile_n=0), dict(tile_m=96), dict(tile_m=320),
    dict(k_blocks_per_step=3), dict(tile_m=64, wg_split=Dim.M), dict(num_compute_wgs=3), dict(num_compute_wgs=4),
    dict(tile_m=256, num_compute_wgs=4), dict(epi_tile_n=48), dict(epi_tile_n=128), dict(grid_size=0),
    dict(max_concurrent_steps=0), dict(max_concurrent_steps=2.0), dict(grid_tile_width=0),
    dict(cluster_dim=Dim.M, persistent=False), dict(cluster_dim=Dim.N, warp_specialized=False),
    dict(live_grid=True, persistent=False), dict(sub_tile_n=48),
    dict(sub_tile_n=4), dict(sub_tile_n=256), dict(sub_tile_n=True), dict(block_n=32), dict(block_k=256),
    dict(block_k=True), dict(tile_n=192, num_compute_wgs=1, block_n=64)],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_config_no_kernel_can_build_is_refused_when_made(kwargs):
  """Configs check themselves on construction (and on dataclasses.replace), naming the field."""
  field = next(iter(kwargs)) if len(kwargs) == 1 else None
  with pytest.raises(ValueError, match=field or ""):
    MosaicGemmConfig(**kwargs)
  with pytest.raises(ValueError):
    dataclasses.replace(MosaicGemmConfig(), **kwargs)


def test_rejects_configs_that_do_not_fit_the_problem():
  def problems(config, out_dtype=jnp.bfloat16, n=256):
    return gm.config_problems(config, n, out_dtype)

  assert not problems(MosaicGemmConfig())
  assert any("128 bytes" in p for p in problems(MosaicGemmConfig(epi_tile_n=64), jnp.float32))
  assert any("tile_n=96" in p and "must divide N=256" in p for p in problems(MosaicGemmConfig(tile_n=96)))
  assert any("shared memory" in p for p in problems(MosaicGemmConfig(max_concurrent_steps=12)))
  assert any("warp-specialized" in p for p in gm.config_problems(MosaicGemmConfig(warp_specialized=False), 256,
                                                                 jnp.bfloat16, live_rows=True))
  assert any("live_grid" in p for p in problems(MosaicGemmConfig(live_grid=True)))  # the grouped kernel's only
  # Through the public function: a config that cannot run is refused with its problem, naming the config.
  args = _args()
  with pytest.raises(ValueError, match="tile_n=96.*must divide N=256"):
    jaxfp8.w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=True, config=MosaicGemmConfig(tile_n=96),
                                 interpret=True)
  with pytest.raises(ValueError, match="bias must have shape"):
    jaxfp8.w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=True, implementation="mosaic",
                                 bias=jnp.zeros((255,), jnp.float32), interpret=True)
  with pytest.raises(ValueError, match="out_dtype must be"):
    jaxfp8.w8a8_block_fp8_matmul(*args, (128, 128), a_s_column_major=True, implementation="mosaic",
                                 out_dtype=jnp.int8, interpret=True)


# -------------------------------------------------------------------------------------------- heuristic and lowering


def test_default_config_is_valid_everywhere():
  for n, k in MODEL_SHAPES:
    for m in M_VALUES:
      for out_dtype in (jnp.bfloat16, jnp.float32):
        config = mosaic_backend.default_config(m, n, k, out_dtype, num_sms=132)
        assert config.smem_bytes(out_dtype) <= gm.SMEM_BYTES, (m, n, k, config)
        if m <= 64:
          assert config.num_wgs == 1 and config.tile_m == 64


def _lower(m, n, k, config, out_dtype=jnp.bfloat16, with_bias=False):
  structs = [jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((k // 128, -(-m // 4) * 4), jnp.float32),
             jax.ShapeDtypeStruct((-(-n // 128), k // 128), jnp.float32)]
  if with_bias:
    structs.append(jax.ShapeDtypeStruct((n,), jnp.float32))

  def f(a_q, b_q, a_s, b_s, bias=None):
    return _matmul(a_q, b_q, a_s, b_s, out_dtype=out_dtype, bias=bias, config=config)

  with _platform.abstract_h200():
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(*structs)
  assert exported.out_avals[0].shape == (m, n)
  # One kernel, its operands and output as they are (free reshapes only), but for the launcher's pad of a_q's rows
  # to the TMA row tile where their count has no tiled view (and only there).
  text = exported.mlir_module()
  assert helpers.kernel_calls(text) == ["mosaic_gpu_v2"], helpers.kernel_calls(text)
  ops = helpers.lowered_ops(text)
  free = {"custom_call", "broadcast_in_dim", "reshape"}
  assert ops["f8E4M3FN"] - free == (set() if gm.tma_rows_ok(m) else {"pad"}), (m, ops)
  # and the bias's pad to whole sub-tiles where one straddles N
  assert ops.get("f32", set()) - free == ({"pad"} if with_bias and n % config.sub_n else set()), (n, ops)
  assert ops.get("bf16", set()) <= free, ops


# Real shapes, including M % 8 == 4 (M = 4100, 12: the a_q padding path) and M < 8.
LOWERING_SHAPES = [(4096, 24576, 7168), (4100, 7168, 2048), (64, 7168, 2048), (12, 1536, 7168), (4, 1536, 7168)]


@pytest.mark.parametrize("m,n,k", LOWERING_SHAPES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_default_config_lowers_for_cuda(m, n, k, out_dtype):
  with _platform.abstract_h200():
    config = mosaic_backend.default_config(m, n, k, out_dtype, num_sms=132)
  _lower(m, n, k, config, out_dtype, with_bias=True)


# The large-tile kinds at the pipeline depths a GPU run would use (the CPU kinds above are shallow).
DEEP_KINDS = {
    "ws2_m_128x128_s5": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=5),
    "ws2_m_128x128_k2_s3": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=3, k_blocks_per_step=2,
                                            epi_tile_n=16),
    "ws2_n_128x256_s3": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=3, wg_split=Dim.N),
    "ws2_m_256x128_s3": MosaicGemmConfig(tile_m=256, tile_n=128, max_concurrent_steps=3),
    "ws2_n_64x128_s7": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=7, wg_split=Dim.N),
    "ws1_64x64_s8": MosaicGemmConfig(tile_m=64, tile_n=64, max_concurrent_steps=8, num_compute_wgs=1,
                                     persistent=False),
    "ws1_64x128_s8": MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=8, num_compute_wgs=1,
                                      persistent=False),
    "simple_128x128_s4": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, warp_specialized=False),
    "ws2_m_128x128_s5_clusterM": MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=5,
                                                  cluster_dim=Dim.M),
    "ws2_n_128x256_s3_clusterN": MosaicGemmConfig(tile_m=128, tile_n=256, max_concurrent_steps=3, wg_split=Dim.N,
                                                  cluster_dim=Dim.N),
    "ws1_64x64_s8_persistent": MosaicGemmConfig(tile_m=64, tile_n=64, max_concurrent_steps=8, num_compute_wgs=1),
    "ws3_m_192x128_s4_clusterN": MosaicGemmConfig(tile_m=192, tile_n=128, max_concurrent_steps=4, num_compute_wgs=3,
                                                  cluster_dim=Dim.N, grid_tile_width=16),
}


@pytest.mark.parametrize("kind", list(KINDS) + list(DEEP_KINDS))
def test_config_kinds_lower_for_cuda(kind):
  config = KINDS.get(kind) or DEEP_KINDS[kind]
  for m, n, k in LOWERING_SHAPES:
    _lower(m, n, k, config)


# The per-column widths at the shapes they balance (decode: N / width = 128 tiles; M=256-512: 128-row tiles split in M
# between the two consumer warpgroups, the candidates the H200 sweep of per-column widths timed), in both output
# dtypes, at the pipeline depths a GPU run would use.
@pytest.mark.parametrize("config,m,n,k", [
    (COLUMN_KINDS["ws1_64x80_k2"][0], 64, 10240, 5120),
    (COLUMN_KINDS["ws1_64x56_bf16"][0], 16, 7168, 18432),
    (COLUMN_KINDS["ws1_64x192"][0], 64, 24576, 7168),
    (COLUMN_KINDS["ws2_n_128x192"][0], 300, 24576, 7168),
    (MosaicGemmConfig(tile_m=128, tile_n=160, max_concurrent_steps=3, k_blocks_per_step=2), 256, 10240, 5120),
    (MosaicGemmConfig(tile_m=128, tile_n=224, max_concurrent_steps=5), 512, 7168, 18432),
    (MosaicGemmConfig(tile_m=128, tile_n=112, max_concurrent_steps=5), 256, 7168, 18432),
], ids=["d80_k2", "d56", "d192", "n_128x192", "m_128x160_k2", "m_128x224", "m_128x112"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_column_kinds_lower_for_cuda(config, m, n, k, out_dtype):
  depth = max(config.max_concurrent_steps, 4)  # the CPU kinds are shallow; _fit_smem trims what does not fit
  config = mosaic_backend._fit_smem(dataclasses.replace(config, max_concurrent_steps=depth, grid_size=None), out_dtype, 1 << 20)
  _lower(m, n, k, config, out_dtype, with_bias=True)


# DeepSeek-V3's kv_a_proj_with_mqa (576 columns) and fused_qkv_a_proj (2112), at decode, two decode tiles and prefill.
@pytest.mark.parametrize("m,n,k", [(1, 576, 7168), (64, 2112, 7168), (100, 576, 7168), (4096, 2112, 7168),
                                   (4100, 576, 7168)])
def test_column_tails_lower_for_cuda(m, n, k):
  with _platform.abstract_h200():
    config = mosaic_backend.default_config(m, n, k, num_sms=132)
  _lower(m, n, k, config, with_bias=True)


def test_default_config_follows_the_measurements():
  """The choices the H200 sweeps made (gemm_mosaic.default_config's comments), and the k2 prefill choice lowers."""
  pick = lambda m, n, k: mosaic_backend.default_config(m, n, k, num_sms=132)
  assert (pick(16, 7168, 18432).tile_n, pick(64, 7168, 18432).tile_n, pick(64, 24576, 7168).tile_n) == (128, 64, 128)
  # Session 6: three consumer warpgroups on 192x128 tiles won at M=2048 and 4096 on all three weights, lost at M=1024.
  for m, n, k in [(4096, 24576, 7168), (4096, 7168, 18432), (4096, 10240, 5120), (2048, 24576, 7168),
                  (2048, 7168, 18432), (2048, 10240, 5120)]:
    config = pick(m, n, k)
    assert (config.num_compute_wgs, config.tile_m, config.tile_n, config.cluster_dim) == (3, 192, 128, Dim.N), (m, n)
  for m, n, k in [(1024, 24576, 7168), (1024, 7168, 18432)]:
    config = pick(m, n, k)
    assert (config.num_compute_wgs, config.tile_n, config.wg_split) == (2, 256, Dim.N), (m, n)
  # Session 8: where the 128x256 tiles run in one wave, 128x128 tiles with two K blocks per step instead (M=512
  # N=7168 K=18432: 112 wide tiles; 110.2 vs 124.2 us); with more than a wave of them (N=24576) 128x256 stays.
  config = pick(512, 7168, 18432)
  assert (config.tile_m, config.tile_n, config.k_blocks_per_step, config.num_compute_wgs) == (128, 128, 2, 2)
  assert (pick(512, 24576, 7168).tile_n, pick(1024, 7168, 18432).tile_n) == (256, 256)
  qwen3_qkv = pick(1024, 10240, 5120)  # 320 tiles of 128x256 leave 76 of 396 slots empty
  assert (qwen3_qkv.tile_n, qwen3_qkv.k_blocks_per_step, qwen3_qkv.epi_tile_n) == (128, 2, 16)
  _lower(1024, 10240, 5120, qwen3_qkv)
  # M=256: 128x128 tiles for N=24576 and 7168; 128 tiles of 128x160 for N=10240 (32.7 vs 44.9 us for 64x128).
  assert [pick(256, n, k).tile_n for n, k in [(24576, 7168), (7168, 18432), (10240, 5120)]] == [128, 128, 160]
  # Session 7: the 128x128 tiles take two K blocks per step (M=256 on N=24576 and 7168, M=128 on N=10240); at M=128
  # the decode schedule, two 64-row tiles per column, where its CTAs fill most of a wave (N=24576 and 7168).
  for m, n, k in [(256, 24576, 7168), (256, 7168, 18432), (128, 10240, 5120)]:
    config = pick(m, n, k)
    assert (config.tile_m, config.tile_n, config.k_blocks_per_step, config.num_compute_wgs) == (128, 128, 2, 2), m
  for n, k in [(24576, 7168), (7168, 18432)]:
    config = pick(128, n, k)
    assert (config.tile_m, config.tile_n, config.num_compute_wgs, config.persistent) == (64, 128, 1, False), n
  _lower(128, 7168, 18432, pick(128, 7168, 18432))
  _lower(100, 24576, 7168, pick(100, 24576, 7168))
  # H100 sweep at M=100: the decode schedule wherever its 64x128 CTAs fit one wave, 64-wide while under half a wave
  # (N=1536 and 4096 at K=7168, 64x64 tiles; N=5120 K=8192, 64x128), not the scored prefill schedules
  for n, k, tile_n in [(1536, 7168, 64), (4096, 7168, 64), (5120, 8192, 128), (5120, 25600, 128)]:
    config = pick(100, n, k)
    assert (config.tile_m, config.tile_n, config.num_compute_wgs, config.persistent) == (64, tile_n, 1, False), n
    _lower(100, n, k, config)


def test_without_the_register_split_prefill_takes_schedules_that_fit_the_launch_registers(monkeypatch):
  """Where the compiler ignores setmaxnreg (JAX 0.12's libnvJitLink path), every prefill choice has two consumer
  warpgroups of at most 64x128 whose running and fresh wgmma accumulators take at most 128 registers a thread (of
  the launch's 168); decode keeps its one-consumer schedule; the plan says why."""
  from pallas_kernels import _jax_compat
  assert _jax_compat.register_split_kept() == (tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12))
  for n, k in MODEL_SHAPES:
    for m in (65, 128, 256, 300, 512, 1024, 2048, 4096, 8192):
      config = mosaic_backend.default_config(m, n, k, num_sms=132, register_split=False)
      if config.num_compute_wgs == 1:  # the decode schedule over 64-row tiles (M <= 128)
        assert m <= 128 and config.tile_m == 64, (m, n, config)
        continue
      assert (config.num_compute_wgs, config.cluster_dim) == (2, None), (m, n, config)
      assert config.wg_tile in ((64, 128), (64, 64)), (m, n, config)
      wg_m, wg_n = config.wg_tile
      assert wg_m * wg_n // 128 + config.k_blocks_per_step * 64 * config.sub_n // 128 <= 128, (m, n, config)
  assert mosaic_backend.default_config(64, 24576, 7168, num_sms=132, register_split=False) == \
      mosaic_backend.default_config(64, 24576, 7168, num_sms=132)
  schedules = mosaic_backend.live_row_schedules(4096, 24576, 7168, jnp.bfloat16, 132, register_split=False)
  assert all(c.num_compute_wgs in (1, 2) and c.cluster_dim is None for c in schedules.configs)
  problem = jaxfp8.gemm.problem(4096, 24576, 7168, (128, 128))
  for kept in (True, False):
    monkeypatch.setattr(_jax_compat, "register_split_kept", lambda kept=kept: kept)
    config, reason = mosaic_backend.default_config_for(problem, helpers.fake_device((9, 0)))
    assert ("without setmaxnreg" in reason) != kept, reason
    assert config == mosaic_backend.default_config(4096, 24576, 7168, num_sms=132, register_split=kept)
  _lower(4096, 24576, 7168, mosaic_backend.default_config(4096, 24576, 7168, num_sms=132, register_split=False))


H100 = "NVIDIA H100 80GB HBM3"


def test_measured_table_serves_its_device_and_bucket_only(monkeypatch):
  """The H100 table's entries: configs that run their (N, K) and beat the heuristic as measured; each serves every M
  with as many 64-row tiles on an H100 with the register split, and nothing else (another device, other M, JAX
  0.12's register-light schedules); the plan names the table; each lowers for CUDA."""
  [table] = (jaxfp8.gemm.tables.load(name) for name in mosaic_backend.MEASURED_TABLES)
  assert table["device"] == "NVIDIA H100" and table["entries"] and "bench" in table["source"]
  assert table["num_sms"] == 132
  keys = [tuple(int(x) for x in key.split(",")) for key in table["entries"]]
  assert len({(n, k, mosaic_backend.m_bucket(m)) for n, k, m in keys}) == len(keys)  # one entry a bucket
  heuristic = lambda m, n, k, num_sms=132, **kw: mosaic_backend.default_config(m, n, k, num_sms=num_sms, **kw)
  for key, entry in table["entries"].items():
    n, k, m = (int(x) for x in key.split(","))
    config = mosaic_backend.entry_config(entry)
    assert not gm.config_problems(config, n, jnp.bfloat16), key
    assert entry["us"] < 0.98 * entry["heuristic_us"], key
    bucket = mosaic_backend.m_bucket(m)
    assert bucket >= m and bucket - 64 < m and bucket % 64 == 0, key
    for rows in {m, bucket, bucket - 63}:
      assert heuristic(rows, n, k, device_kind=H100) == mosaic_backend._fit_smem(config, jnp.bfloat16, k), key
      assert heuristic(rows, n, k, device_kind="NVIDIA H200") == heuristic(rows, n, k), key
      # an H100 of another SM count (PCIe, a MIG slice) has other waves than the one measured
      assert heuristic(rows, n, k, 114, device_kind="NVIDIA H100 PCIe") == heuristic(rows, n, k, 114), key
      assert heuristic(rows, n, k, device_kind=H100, register_split=False) == heuristic(rows, n, k,
                                                                                        register_split=False)
    for rows in (bucket - 64, bucket + 1):
      if rows > 0 and mosaic_backend.measured_entry(rows, n, k, H100, 132) is None:
        assert heuristic(rows, n, k, device_kind=H100) == heuristic(rows, n, k), (key, rows)
    from pallas_kernels import _jax_compat
    monkeypatch.setattr(_jax_compat, "register_split_kept", lambda: True)  # as under JAX 0.11, where it was measured
    plan = jaxfp8.gemm.plan(jaxfp8.gemm.problem(m, n, k, (128, 128)), implementation="mosaic",
                            device=_platform.Device(H100, (9, 0), 132))
    assert plan.config == heuristic(m, n, k, device_kind=H100) and "mosaic_gemm_h100.json" in plan.config_reason
    monkeypatch.undo()
    _lower(m, n, k, config)


def test_heuristic_lowers_for_model_shapes():
  """Every config the heuristic picks over the model shapes lowers, once per kernel structure it meets: the config
  with the partial last row and column tiles present or not (the sizes beyond that change no code)."""
  lowered = set()
  for n, k in MODEL_SHAPES:
    for m in (1, 12, 300, 4100):
      with _platform.abstract_h200():
        config = mosaic_backend.default_config(m, n, k, num_sms=132)
      structure = (config, m % config.tile_m == 0, n % config.tile_n == 0)
      if structure not in lowered:
        lowered.add(structure)
        _lower(m, n, k, config)
  assert len(lowered) >= 4, lowered


# ------------------------------------------------------------------------------------------------------ on the H200


def _gpu_reference_f32(a_q, b_q, a_s_col, b_s, bias):
  """f32 XLA computation of docs/CONTRACT.md §2 on the GPU (full precision dots, one per K group): for whole-output checks."""
  m, k = a_q.shape
  n = b_q.shape[0]
  groups = k // 128
  a = a_q.astype(jnp.float32).reshape(m, groups, 128)
  b = b_q.astype(jnp.float32).reshape(n, groups, 128)
  b_s_cols = jnp.repeat(b_s, 128, axis=0)[:n]  # (N, G)

  def body(g, acc):
    part = jax.lax.dot_general(a[:, g], b[:, g], (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return acc + part * a_s_col[g, :m][:, None] * b_s_cols[:, g][None, :]

  acc = jax.lax.fori_loop(0, groups, body, jnp.zeros((m, n), jnp.float32))
  return acc if bias is None else acc + bias.astype(jnp.float32)[None, :]


def _gpu_problem(key, m, n, k):
  ka, kb, ks, kt, kbias = jax.random.split(key, 5)
  a_q = jnp.clip(jax.random.normal(ka, (m, k)) * 60, -448, 448).astype(jnp.float8_e4m3fn)
  b_q = jnp.clip(jax.random.normal(kb, (n, k)) * 60, -448, 448).astype(jnp.float8_e4m3fn)
  a_s = 10.0 ** jax.random.uniform(ks, (k // 128, -(-m // 4) * 4), minval=-3, maxval=-1)
  b_s = 10.0 ** jax.random.uniform(kt, (-(-n // 128), k // 128), minval=-4, maxval=-2)
  bias = jax.random.normal(kbias, (n,), jnp.float32)
  return a_q, b_q, a_s.astype(jnp.float32), b_s.astype(jnp.float32), bias


def _check_on_gpu(m, n, k, config, out_dtype, seed, with_bias=True):
  a_q, b_q, a_s, b_s, bias = _gpu_problem(jax.random.key(seed), m, n, k)
  bias = bias if with_bias else None
  out = jax.jit(lambda *xs: _matmul(*xs[:4], bias=xs[4] if with_bias else None, out_dtype=out_dtype,
                                                config=config))(a_q, b_q, a_s, b_s, bias)
  assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
  # Whole output against an f32 computation on the GPU (catches any tile gone wrong).
  full = _gpu_reference_f32(a_q, b_q, a_s, b_s, bias)
  out32 = out.astype(jnp.float32)
  assert bool(jnp.isfinite(out32).all())
  rel = float(jnp.linalg.norm(out32 - full.astype(out_dtype).astype(jnp.float32)) / jnp.linalg.norm(full))
  assert rel <= (2e-4 if jnp.dtype(out_dtype) == jnp.float32 else 5e-3), rel
  # Sampled rows and column blocks (first, last, random) against the float64 oracle.
  rng = np.random.default_rng(seed)
  rows = np.unique(np.concatenate([[0, m - 1], rng.integers(0, m, 14)]))
  n_blocks = -(-n // 128)  # the last one partial where N % 128
  col_blocks = np.unique(np.concatenate([[0, n_blocks - 1], rng.integers(0, n_blocks, 2)]))
  cols = (col_blocks[:, None] * 128 + np.arange(128)[None, :]).reshape(-1)
  cols = cols[cols < n]
  a_s_np = np.asarray(a_s)
  expect = ref.block_fp8_matmul(np.asarray(a_q)[rows], np.asarray(b_q)[cols], a_s_np[:, rows],
                                np.asarray(b_s)[col_blocks], (128, 128), a_s_column_major=True,
                                bias=None if bias is None else np.asarray(bias)[cols])
  got = np.asarray(out32)[np.ix_(rows, cols)]
  tolerance = 2e-4 if jnp.dtype(out_dtype) == jnp.float32 else 5e-3
  assert ref.relative_error(got, ref.cast_output(expect, out_dtype).astype(np.float32)) <= tolerance


# DeepSeek-V3 (full, TP8) and Qwen3-32B weights: wide and narrow N, long and short K, K % 256 != 0 (1152 = 9 blocks).
GPU_SHAPES = [(24576, 7168), (7168, 2048), (1536, 7168), (3072, 1536), (4096, 512), (5120, 25600), (7168, 1152),
              (10240, 5120)]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("n,k", GPU_SHAPES)
# Every kind of default config: decode, the decode schedule over two row tiles (M=100 on N=24576 and 7168), 128x128
# tiles with two K blocks (M=200; Qwen3 qkv M=1024), 128x256, three warpgroups.
@pytest.mark.parametrize("m", [1, 16, 64, 100, 200, 1024, 4096])
def test_gpu_default_config_model_shapes(n, k, m):
  if m * n * k > 4096 * 24576 * 7168:
    pytest.skip("larger than the prefill benchmark shape")
  _check_on_gpu(m, n, k, None, jnp.bfloat16, seed=m + n + k)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("n,k", [(576, 7168), (2112, 7168), (200, 1536)])
@pytest.mark.parametrize("m", [1, 64, 100, 300, 4096])
def test_gpu_column_tails(n, k, m):
  """N not a multiple of 128 on the default schedules: TMA's zero fill of the weight rows past N and its clipped
  stores, whole output and sampled columns of the partial block against the references."""
  config = mosaic_backend.default_config(m, n, k, num_sms=_platform.num_sms())
  _check_on_gpu(m, n, k, config, jnp.bfloat16, seed=m + n)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind", list(KINDS) + list(DEEP_KINDS))
def test_gpu_config_kinds(kind):
  config = KINDS.get(kind) or DEEP_KINDS[kind]
  if config.grid_size is not None:  # the CPU kinds loop on 2-3 CTAs: use every SM on the GPU
    config = dataclasses.replace(config, grid_size=None)
  seed = zlib.crc32(kind.encode()) % 1000
  # Partial row tiles, N not a multiple of 256, K not a multiple of 256; then a decode-like shape in f32.
  _check_on_gpu(4096 - 36, 7168 + 128, 2048 + 128, config, jnp.bfloat16, seed=seed)
  _check_on_gpu(36, 1536, 7168, mosaic_backend._fit_smem(config, jnp.float32, 1 << 20), jnp.float32, seed=seed + 1)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind,n,k", [("ws1_64x80_k2", 10240, 5120), ("ws1_64x56_bf16", 7168, 18432),
                                      ("ws1_64x56_f32", 7168, 2048), ("ws1_64x192", 24576, 7168),
                                      ("ws2_n_128x192", 24576, 7168), ("ws2_m_128x80", 10240, 5120)])
@pytest.mark.parametrize("m", [1, 16, 64, 1000])
def test_gpu_column_kinds(kind, n, k, m):
  config, _, _, out_dtype = COLUMN_KINDS[kind]
  config = mosaic_backend._fit_smem(dataclasses.replace(config, max_concurrent_steps=4, grid_size=None), out_dtype, 1 << 20)
  _check_on_gpu(m, n, k, config, out_dtype, seed=zlib.crc32(kind.encode()) % 1000 + m)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("block_size", OTHER_BLOCK_SIZES)
@pytest.mark.parametrize("m", [16, 300, 1024])
def test_gpu_block_sizes(block_size, m):
  """Blocks of 64 on the default schedules (decode, two row tiles, prefill) natively: N = 1600 (a multiple of 64, not
  of 128), K an odd number of 64-wide blocks where gk = 64, a bias; the whole output against the float64 reference."""
  rng = np.random.default_rng(m + block_size[0] + 2 * block_size[1])
  n, k = 1600, 2112 if block_size[1] == 64 else 2176
  a_q, b_q, a_s, b_s = _quantized_problem(rng, m, n, k, block_size=block_size)
  bias = (rng.standard_normal(n) * 10).astype(np.float32)
  out = jaxfp8.w8a8_block_fp8_matmul(jnp.asarray(a_q), jnp.asarray(b_q), jnp.asarray(a_s), jnp.asarray(b_s),
                                     block_size, a_s_column_major=True, bias=jnp.asarray(bias),
                                     implementation="mosaic")
  expect = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, block_size, a_s_column_major=True, bias=bias)
  out = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out).all()
  assert ref.relative_error(out, ref.cast_output(expect, jnp.bfloat16).astype(np.float32)) <= 5e-3


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_exact_small_integers():
  m, n, k = 512, 1024, 2048
  key = jax.random.key(7)
  ka, kb, ks, kt = jax.random.split(key, 4)
  a_q = jax.random.randint(ka, (m, k), -4, 5).astype(jnp.float8_e4m3fn)
  b_q = jax.random.randint(kb, (n, k), -4, 5).astype(jnp.float8_e4m3fn)
  a_s = (2.0 ** jax.random.randint(ks, (k // 128, m), -2, 3)).astype(jnp.float32)
  b_s = (2.0 ** jax.random.randint(kt, (n // 128, k // 128), -2, 3)).astype(jnp.float32)
  expect = ref.cast_output(ref.block_fp8_matmul(np.asarray(a_q), np.asarray(b_q), np.asarray(a_s), np.asarray(b_s),
                                                (128, 128), a_s_column_major=True), np.float32)
  for config in [None, *DEEP_KINDS.values()]:
    config = None if config is None else mosaic_backend._fit_smem(config, jnp.float32, 1 << 20)
    out = _matmul(a_q, b_q, a_s, b_s, out_dtype=jnp.float32, config=config)
    np.testing.assert_array_equal(np.asarray(out), expect, err_msg=str(config))
