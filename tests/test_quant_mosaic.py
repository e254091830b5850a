"""The Mosaic GPU per-token-group quantization kernel (pallas_kernels/quant_mosaic.py) against the reference.

On CPU: interpret mode (plgpu.InterpretGPUParams; outputs start NaN / INT_MAX-filled there, so an unwritten element
fails the comparison) and lowering for an abstract H200 with jax.export (layout errors, shared-memory overflow, and
that the call is one kernel with nothing around it). On a Hopper GPU: the real kernel at real sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import helpers
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxfp8
from jaxfp8 import _platform
from jaxfp8 import reference as ref
from jaxfp8 import quant
from pallas_kernels import quant_mosaic as qm
from jaxfp8.quant import mosaic as quant_mosaic_backend
from helpers import INPUT_DTYPES, assert_matches_reference, random_activations

ON_GPU = _platform.gpu_compute_capability() is not None
Config = qm.QuantMosaicConfig


def _quantize(x, valid, group_size, *, layout="col", ue8m0=False, fuse=False, out_rows=None, scale_cols=None,
              config=None, eps=1e-10):
  """Runs the kernel: interpreted on CPU, for real on a GPU."""
  out_rows = x.shape[1] if out_rows is None else out_rows
  scale_cols = out_rows if scale_cols is None else scale_cols
  return _launch(
      jnp.asarray(x), jnp.asarray(valid, jnp.int32), group_size=group_size, eps=eps, out_rows=out_rows,
      scale_layout=layout, scale_cols=scale_cols, scale_ue8m0=ue8m0, fuse_silu_and_mul=fuse, config=config,
      interpret=not ON_GPU)


def _launch(x, valid_rows, *, config=None, **kwargs):
  """The kernel's launcher as the library's backend calls it: the backend's config when none is given."""
  if config is None:
    p = quant.problem(x.shape[0], x.shape[1], x.shape[2], x.dtype, group_size=kwargs["group_size"],
                      eps=kwargs["eps"], scale_layout=kwargs["scale_layout"], scale_ue8m0=kwargs["scale_ue8m0"],
                      fuse_silu_and_mul=kwargs["fuse_silu_and_mul"])
    p = dataclasses.replace(p, out_rows=kwargs["out_rows"], scale_cols=kwargs["scale_cols"])
    config, _ = quant_mosaic_backend.default_config_for(p, _platform.device())
  return qm.per_token_group_quant(x, valid_rows, config=config, **kwargs)


def _expected(x, valid, group_size, *, layout="col", ue8m0=False, fuse=False, out_rows=None, scale_cols=None,
              eps=1e-10):
  """The reference's live rows, padded by hand to any out_rows / scale_cols (pad rows: q = 0, scale = 1.0)."""
  experts, rows = x.shape[:2]
  out_rows = rows if out_rows is None else out_rows
  scale_cols = out_rows if scale_cols is None else scale_cols
  q, s = ref.per_token_group_quant_fp8(x, group_size, eps=eps, scale_ue8m0=ue8m0, fuse_silu_and_mul=fuse,
                                       masked_m=np.asarray(valid, np.int32))
  groups = s.shape[-1]
  q_out = np.zeros((experts, out_rows, q.shape[-1]), ref.FP8)
  q_out[:, :rows] = q
  scale_rows = out_rows if layout == "row" else scale_cols
  s_rows = np.ones((experts, scale_rows, groups), np.float32)
  s_rows[:, :rows] = s
  if layout == "row":
    return q_out, s_rows
  s_cols = np.ascontiguousarray(np.swapaxes(s_rows, -1, -2))
  return q_out, (ref.pack_ue8m0_words(s_cols) if layout == "col_packed" else s_cols)


def _check(x, valid, group_size, *, context="", **options):
  q, s = _quantize(x, valid, group_size, **options)
  options.pop("config", None)
  q_ref, s_ref = _expected(x, valid, group_size, **options)
  context = f"{context} G={group_size} {options}"
  if options.get("fuse"):
    _assert_close_after_silu(q, s, q_ref, s_ref, x.dtype, packed=options.get("layout") == "col_packed",
                             context=context)
  else:
    assert_matches_reference(q, s, q_ref, s_ref, exact_codes=helpers.exact_codes("mosaic", ue8m0=options.get("ue8m0", False)), context=context)
  return np.asarray(q), np.asarray(s)


def _assert_close_after_silu(q, s, q_ref, s_ref, dtype, *, packed, context):
  """With fuse_silu_and_mul, exp() is rounded differently by the kernel (or XLA in interpret mode) and NumPy, so
  silu(x) may differ by an ulp or two. With f32 inputs that reaches the group maxima, so scales are compared within
  8 float32 ulps. bf16/f16 inputs round silu back to their dtype, which absorbs the difference except next to a
  rounding midpoint: there a value moves by one ulp of x.dtype, and so does its group's scale if it was the maximum
  (one exponent step for UE8M0); that may happen to a few scales, never by more. Codes: within one step, almost all
  exact."""
  q, s = np.asarray(q), np.asarray(s)
  assert q.shape == q_ref.shape and s.shape == s_ref.shape and s.dtype == s_ref.dtype, context
  if packed:
    exps = lambda w: w.view(np.uint8).astype(np.int32)  # little-endian: the exponent bytes of 4 groups per word
    scale_diff = np.abs(exps(s) - exps(s_ref))
    assert scale_diff.max(initial=0) <= 1, f"{context}: UE8M0 exponents differ by {scale_diff.max()}"
  else:
    assert (np.isnan(s) == np.isnan(s_ref)).all(), f"{context}: NaN scales differ"
    with np.errstate(invalid="ignore"):
      same = (s == s_ref) | np.isnan(s)  # also inf == inf
      rel = np.where(same, 0.0, np.abs(s.astype(np.float64) - s_ref) / np.abs(s_ref))
    tol = 2.0 ** -(ml_dtypes.finfo(dtype).nmant - 1) if dtype != np.float32 else 2.0 ** -20
    assert rel.max(initial=0) <= tol, f"{context}: scales differ by {rel.max():.3g} relative (> {tol:.3g})"
    scale_diff = rel > 0
  if dtype != np.float32:
    assert np.count_nonzero(scale_diff) <= max(2, 0.01 * scale_diff.size), (
        f"{context}: {np.count_nonzero(scale_diff)} of {scale_diff.size} scales differ")
  dist = ref.fp8_code_distance(q, q_ref)
  assert dist.max(initial=0) <= 1, f"{context}: codes differ by up to {dist.max()} steps"
  assert np.count_nonzero(dist) <= max(4, 0.01 * dist.size), f"{context}: {np.count_nonzero(dist)} codes differ"


# ---- numerics in interpret mode (the same tests run the real kernel on a GPU) --------------------------------------

# Small blocks, so that the shapes below have several row and group blocks, a last row block shifted back over its
# neighbour (scale_cols = 18 is not a multiple of 8) and a last group block shifted back (6 groups, 4 per block).
SMALL = Config(block_rows=8, groups_per_block=4)


@pytest.mark.parametrize("layout, ue8m0, fuse", [
    ("row", False, False), ("row", True, False), ("row", False, True),
    ("col", False, False), ("col", True, False), ("col", True, True),
    ("col_packed", True, False), ("col_packed", True, True),
])
def test_every_layout_and_option(layout, ue8m0, fuse, rng):
  # 6 groups of 64: the last packed word has 2 unused bytes. Expert 1 has pad rows inside T.
  x = random_activations(rng, (2, 13, (2 if fuse else 1) * 384), INPUT_DTYPES["bf16"])
  _check(x, [13, 6], 64, layout=layout, ue8m0=ue8m0, fuse=fuse, out_rows=16, scale_cols=18, config=SMALL)


def test_reference_padding_conventions_match(rng):
  """The kernel's out_rows / scale_cols are exactly the reference's row_alignment / scale_tma_aligned shapes."""
  x = random_activations(rng, (3, 13, 256), INPUT_DTYPES["bf16"])
  valid = np.array([13, 0, 7], np.int32)
  for layout, options in (("col", dict(column_major_scales=True)), ("row", dict()),
                          ("col_packed", dict(scale_ue8m0=True, pack_ue8m0=True))):
    q, s = _quantize(x, valid, 128, layout=layout, ue8m0=layout == "col_packed", out_rows=16, scale_cols=16)
    q_ref, s_ref = ref.per_token_group_quant_fp8(x, 128, masked_m=valid, row_alignment=8, scale_tma_aligned=True,
                                                 **options)
    assert_matches_reference(q, s, q_ref, s_ref, exact_codes=helpers.exact_codes("mosaic", ue8m0=layout == "col_packed"), context=layout)


@pytest.mark.parametrize("group_size", [16, 32, 48, 64, 96, 128, 256])
def test_group_sizes(group_size, rng):
  # 5 groups: not a multiple of 4 (packed) nor of the block; f32 at G = 256 holds 2 vectors per lane.
  dtype = "f32" if group_size in (48, 256) else "bf16"
  x = random_activations(rng, (1, 11, 5 * group_size), INPUT_DTYPES[dtype])
  _check(x, [11], group_size, layout="col", out_rows=12, config=Config(block_rows=8, groups_per_block=2))
  _check(x, [9], group_size, layout="col_packed", ue8m0=True, out_rows=11, scale_cols=12)


@pytest.mark.parametrize("dtype", list(INPUT_DTYPES))
def test_input_dtypes(dtype, rng):
  x = random_activations(rng, (2, 10, 512), INPUT_DTYPES[dtype])
  _check(x, [10, 3], 128, layout="row", out_rows=12)
  _check(x, [10, 3], 64, layout="col_packed", ue8m0=True, out_rows=12, scale_cols=12)
  _check(np.concatenate([x, x], -1), [10, 3], 128, layout="col", fuse=True)


def test_valid_rows_zero_full_and_partial(rng):
  # Row blocks of 8 over 21 rows: expert 0 has only pad blocks (their loads are skipped), 1 none, 2 and 3 cut
  # blocks in their middle.
  x = random_activations(rng, (4, 21, 256), INPUT_DTYPES["bf16"])
  valid = [0, 21, 1, 20]
  for layout in ("row", "col", "col_packed"):
    _check(x, valid, 128, layout=layout, ue8m0=layout == "col_packed", out_rows=24, scale_cols=28,
           config=Config(block_rows=8, groups_per_block=2))


@pytest.mark.parametrize("layout", qm.SCALE_LAYOUTS)
def test_pad_rows_unwritten_leaves_only_whole_pad_blocks(layout, rng):
  # 8-row blocks, valid [0, 21, 13, 3] of 21 rows (+3 pad rows, +7 scale-only columns): expert 0's blocks are all pad,
  # 1 has none past row 21, 2 and 3 end inside a block. Rows of a block holding a live row are what the default
  # writes, bit for bit; a block of pad rows only is not written (on the GPU the poison stays; interpreted, the
  # interpreter's NaN fill).
  x = random_activations(rng, (4, 21, 512), INPUT_DTYPES["bf16"])
  valid = [0, 21, 13, 3]
  options = dict(layout=layout, ue8m0=layout == "col_packed", fuse=True, out_rows=24, scale_cols=31,
                 config=Config(block_rows=8, groups_per_block=2))
  q_all, s_all = map(np.asarray, _quantize(x, valid, 128, **options))
  _poison_memory(8 * x.size)
  q, s = map(np.asarray, _launch(jnp.asarray(x), jnp.asarray(valid, jnp.int32), group_size=128, eps=1e-10,
                                 out_rows=24, scale_layout=layout, scale_cols=31, scale_ue8m0=layout == "col_packed",
                                 fuse_silu_and_mul=True, config=options["config"], interpret=not ON_GPU,
                                 pad_rows_written=False))
  as_rows = (lambda a: a) if layout == "row" else (lambda a: np.swapaxes(a, -1, -2))
  for e, live in enumerate(valid):
    written = -(-live // 8) * 8
    assert q[e, :written].view(np.uint8).tobytes() == q_all[e, :written].view(np.uint8).tobytes(), (e, layout)
    assert as_rows(s)[e, :written].tobytes() == as_rows(s_all)[e, :written].tobytes(), (e, layout)
    if written < 24:  # a whole pad block holds no code the default writes there (0) everywhere
      assert np.any(q[e, written:].view(np.uint8) != 0), (e, layout, "pad block written")


@pytest.mark.parametrize("config", [
    None,  # the default heuristic
    Config(block_rows=2, groups_per_block=1),
    Config(block_rows=256, groups_per_block=256),  # clamped to the problem
    Config(block_rows=4, groups_per_block=2, blocks_per_cta=3, num_stages=1),
    Config(block_rows=4, groups_per_block=2, blocks_per_cta=3, num_stages=2),
    Config(block_rows=8, groups_per_block=1, blocks_per_cta=7, num_stages=3),  # a split with a repeated last block
], ids=str)
def test_configs(config, rng):
  x = random_activations(rng, (2, 19, 7 * 64), INPUT_DTYPES["f16"])
  _check(x, [19, 11], 64, layout="col", out_rows=20, scale_cols=24, config=config)
  _check(x, [19, 11], 64, layout="col_packed", ue8m0=True, out_rows=20, scale_cols=20, config=config)


def test_tiny_blocks_in_a_pipeline_use_single_buffers(rng):
  # 1 row x 1 group of 16 f32: 64-byte blocks cannot form a ring of 128-byte aligned TMA buffers; the pipeline over
  # 4 blocks per CTA then reuses one input and one output buffer.
  x = random_activations(rng, (1, 3, 7 * 16), INPUT_DTYPES["f32"])
  config = Config(block_rows=1, groups_per_block=1, blocks_per_cta=4, num_stages=3)
  _check(x, [3], 16, layout="row", config=config)
  _check(x, [2], 16, layout="col_packed", ue8m0=True, out_rows=4, scale_cols=4,
         config=Config(block_rows=1, groups_per_block=4, blocks_per_cta=2, num_stages=2))


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_few_rows(rows, rng):
  x = random_activations(rng, (1, rows, 1024), INPUT_DTYPES["bf16"])
  _check(x, [rows], 128, layout="row")
  _check(x, [rows], 128, layout="col_packed", ue8m0=True, scale_cols=rows + 3)


@pytest.mark.parametrize("group_size, dtype", [(16, "bf16"), (48, "bf16"), (48, "f32")])
def test_blocks_under_128_bytes(group_size, dtype, rng):
  # One row of 2-3 small groups is under the 128 bytes a Mosaic TMA load must move: the load takes extra rows.
  x = random_activations(rng, (2, 1, 3 * group_size), INPUT_DTYPES[dtype])
  _check(x, [1, 0], group_size, layout="row")
  _check(x, [1, 1], group_size, layout="col_packed", ue8m0=True)
  _check(np.concatenate([x, x], -1), [1, 1], group_size, layout="col", fuse=True,
         config=Config(block_rows=1, groups_per_block=1, blocks_per_cta=3))


def test_one_row_one_group_blocks(rng):
  # Every scale store is a single element (stored as a scalar: Mosaic GPU cannot store a 1-element array to GMEM).
  x = random_activations(rng, (2, 1, 256), INPUT_DTYPES["bf16"])
  _check(x, [1, 0], 256, layout="row")
  _check(x, [1, 1], 256, layout="col")
  _check(x, [0, 1], 64, layout="col_packed", ue8m0=True)


def test_pad_rows_beyond_the_input_and_scale_only_columns(rng):
  # T = 5 input rows, 8 q rows, 13 scale columns: rows 5..12 exist only in the outputs.
  x = random_activations(rng, (2, 5, 256), INPUT_DTYPES["bf16"])
  _check(x, [5, 2], 128, layout="col", out_rows=8, scale_cols=13, config=Config(block_rows=4, groups_per_block=1))
  _check(x, [5, 2], 64, layout="col_packed", ue8m0=True, out_rows=8, scale_cols=13)


def test_quotients_next_to_an_fp8_midpoint():
  """x / s that XLA's reciprocal multiply (x * (1/s)) rounds onto an fp8 rounding midpoint, where round-to-even
  then picks the wrong neighbour: -0.0511 / s is -215.99998 (code -208), but x * (1/s) is -216.0 (code -224). Found by
  a random f16 case in interpret mode, where the kernel divides correctly rounded. Natively the kernel's hardware
  division is not correctly rounded (docs/CONTRACT.md §1): these adversarial quotients may come out one step off."""
  x = np.zeros((1, 4, 128), np.float16)
  x[0, :, 0] = np.float16(0.10596)  # amax: s = 0.10596 / 448 = 0.00023651125
  x[0, 0, 1], x[0, 1, 1] = np.float16(-0.051086426), np.float16(0.014663696)  # -215.99998 and 61.999996
  x[0, 2, 0], x[0, 2, 1] = np.float16(6.78125), np.float16(-1.1503906)  # s = 0.01513672: -75.99999
  if ON_GPU:
    q, _ = _quantize(x, [4], 128, layout="col")
    q_ref, _ = _expected(x, [4], 128, layout="col")
    assert ref.fp8_code_distance(np.asarray(q), q_ref).max() <= 1
    return
  q, _ = _check(x, [4], 128, layout="col")
  assert q[0, 0, 1].astype(np.float32) == -208 and q[0, 1, 1].astype(np.float32) == 60, (q[0, 0, 1], q[0, 1, 1])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_nan_and_inf(dtype, rng):
  x = random_activations(rng, (1, 7, 256), INPUT_DTYPES[dtype]).astype(np.float32)
  x[0, 1, 3] = np.nan  # group 0 of row 1: NaN scale, NaN codes; group 1 stays finite
  x[0, 2, 200] = np.inf  # scale inf: finite values -> 0, inf / inf -> NaN
  x[0, 3, 0] = -np.inf
  x[0, 4, :] = 1e-30  # below eps: scale = eps * R
  x[0, 5, 10] = 1e30 if dtype == "f32" else 1e38
  x[0, 6, 130] = np.nan  # a NaN in a pad row must not leak into its q or scale
  x = x.astype(INPUT_DTYPES[dtype])
  for layout, ue8m0 in (("row", False), ("col", True), ("col_packed", True)):
    q, s = _check(x, [6], 128, layout=layout, ue8m0=ue8m0, out_rows=8)
    if layout == "row":
      assert np.isnan(s[0, 1, 0]) and np.isfinite(s[0, 1, 1]) and np.isinf(s[0, 2, 1])
      assert np.isnan(q[0, 1, :128].astype(np.float32)).all() and s[0, 6, 1] == 1.0 and not q[0, 6].any()


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_saturation_when_the_scale_underflows(rng):
  """amax * R rounds to the smallest subnormal, so |x / s| = 512 > 448 must saturate to 448, not become NaN.

  This checks the satfinite cast that replaces the explicit clip on the GPU. (Interpret mode cannot: XLA on CPU
  flushes the subnormal scale to zero.)
  """
  x = np.full((1, 2, 128), 2.0**-140, np.float32) * rng.choice([-1.0, 1.0, 0.5], size=(1, 2, 128)).astype(np.float32)
  q, _ = _check(x, [2], 128, layout="row", eps=2.0**-145)
  assert (np.abs(q.astype(np.float32)) == 448).any()


def test_padded_and_unpadded_calls_agree_bit_for_bit(rng):
  x = random_activations(rng, (2, 29, 384), INPUT_DTYPES["bf16"])
  q1, s1 = _quantize(x, [29, 17], 128, layout="row")
  q2, s2 = _quantize(x, [29, 17], 128, layout="row", out_rows=37, config=Config(block_rows=16, groups_per_block=1))
  q3, s3 = _quantize(x, [29, 17], 128, layout="col", out_rows=32, scale_cols=36,
                     config=Config(block_rows=4, groups_per_block=2, blocks_per_cta=2))
  np.testing.assert_array_equal(np.asarray(q2)[:, :29].view(np.uint8), np.asarray(q1).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q3)[:, :29].view(np.uint8), np.asarray(q1).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s2)[:, :29].view(np.uint32), np.asarray(s1).view(np.uint32))
  np.testing.assert_array_equal(np.swapaxes(np.asarray(s3), 1, 2)[:, :29].view(np.uint32),
                                np.asarray(s1).view(np.uint32))


def test_no_data_races_in_the_pipeline():
  """The interpreter's race detector sees the SMEM ring, barriers and TMA stores of a pipelined config race-free.

  Overlapping edge blocks (by design, they write identical values) are reported as races: that case runs first to
  show the detector is on, then a shape without overlap must come out clean.
  """
  if ON_GPU:
    pytest.skip("interpret mode only")
  races = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks").get_races
  x = random_activations(np.random.default_rng(0), (1, 9, 2 * 256), INPUT_DTYPES["f16"])
  config = Config(block_rows=4, groups_per_block=4, blocks_per_cta=4, num_stages=2)
  for out_rows, expect_races in ((9, True), (12, False)):
    try:
      with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        q, s = _launch(
            jnp.asarray(x), jnp.array([9], jnp.int32), group_size=16, eps=1e-10, out_rows=out_rows,
            scale_layout="row", scale_cols=0, scale_ue8m0=True, fuse_silu_and_mul=True, config=config)
        jax.block_until_ready((q, s))
      found = races().races_found
    except Exception as e:  # noqa: BLE001 - JAX 0.12's detector raises at the first race instead of recording it
      if "RACE DETECTED" not in "".join(traceback.format_exception(e)):
        raise
      found = True
    assert found == expect_races, f"out_rows={out_rows}"
  q_ref, s_ref = _expected(x, [9], 16, layout="row", ue8m0=True, fuse=True, out_rows=12)
  _assert_close_after_silu(q, s, q_ref, s_ref, x.dtype, packed=False, context="race test")


def _block_boxes(plan):
  """Every (row0, g0, q_groups) a CTA of `plan` works on, from the kernel's own index helpers; q_groups is the
  number of groups its q store writes, 0 for blocks that store no q."""
  for row_block in range(plan.num_row_blocks):
    row0 = int(qm._row_block_start(plan, row_block))
    for split in range(plan.num_splits):
      for step in range(plan.blocks_per_cta):
        g0 = int(qm._group_block_start(plan, split, step))
        stores_q = plan.rows_out > 0 and row_block < plan.num_q_row_blocks
        whole = g0 + plan.groups_per_block <= plan.groups
        yield row0, g0, (plan.groups_per_block if whole else qm._q_store_groups(plan)) if stores_q else 0


@pytest.mark.parametrize("layout", qm.SCALE_LAYOUTS)
def test_no_store_sticks_out_of_its_array(layout):
  """Mosaic GPU stores a contiguous q box (whole rows, or one row) with a linear bulk copy that is clipped only at
  the end of the whole array: a box sticking out past an expert's last row or a row's last group overwrites the next
  expert's or row's first codes on the GPU (interpret mode clips per dimension and cannot see it; this failed on the
  H200 for out_rows=24, scale_cols=28, 8-row blocks, and for one-row "col_packed" blocks with K/G % 4 != 0).
  So: q boxes lie inside q (only taller blocks, which Mosaic stores with a tiled TMA store that clips, may stick
  out past K/G), scale boxes inside the scale array, and together they cover both arrays."""
  checked = 0
  for groups in (1, 2, 3, 5, 6, 7, 8, 13):
    for rows_in, out_rows, extra_scale_cols in ((1, 1, 0), (1, 4, 0), (3, 4, 0), (21, 24, 4), (13, 16, 2), (5, 8, 5),
                                                (17, 17, 0), (9, 12, 7), (0, 0, 4), (2, 3, 1)):
      scale_cols = out_rows + (0 if layout == "row" else extra_scale_cols)
      if layout == "row" and out_rows == 0:
        continue
      for block_rows in (1, 2, 4, 8, 16):
        for groups_per_block, blocks_per_cta in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 1), (2, 3), (1, 7)):
          plan = qm._make_plan(
              (1, rows_in, groups * 16), jnp.bfloat16, group_size=16, out_rows=out_rows, scale_layout=layout,
              scale_cols=scale_cols, fuse=False,
              config=Config(block_rows=block_rows, groups_per_block=groups_per_block, blocks_per_cta=blocks_per_cta))
          bm, gpb = plan.block_rows, plan.groups_per_block
          q_written = np.zeros((out_rows, groups), bool)
          s_written = np.zeros((plan.scale_rows, plan.group_extent), bool)
          for row0, g0, q_groups in _block_boxes(plan):
            context = f"{layout} T={rows_in} out_rows={out_rows} scale_cols={scale_cols} groups={groups} {plan}"
            assert 0 <= row0 and row0 + bm <= plan.scale_rows, context
            assert 0 <= g0 and g0 + gpb <= plan.group_extent, context
            s_written[row0:row0 + bm, g0:g0 + gpb] = True
            if q_groups:
              assert row0 + bm <= out_rows, f"q rows [{row0}, {row0 + bm}) stick out: {context}"
              assert g0 + q_groups <= groups or bm > 1, f"q groups [{g0}, {g0 + q_groups}) stick out: {context}"
              q_written[row0:row0 + bm, g0:g0 + q_groups] = True
            checked += 1
          assert q_written.all() and s_written.all(), context
  assert checked > 1000


def _gathered(x, source, divisor, live, *, layout="col", out_rows=None, scale_cols=None, config=None):
  """The kernel on gathered rows (x (1, T, K), source (R,)): row r of q is x[source[r] // divisor]."""
  rows = source.shape[0]
  scale_cols = rows if scale_cols is None else scale_cols
  return qm.per_token_group_quant(
      jnp.asarray(x), jnp.asarray([live], jnp.int32), group_size=128, eps=1e-10, out_rows=rows,
      scale_layout=layout, scale_cols=scale_cols, scale_ue8m0=layout == "col_packed", fuse_silu_and_mul=False,
      config=config or Config(block_rows=4, groups_per_block=2), interpret=not ON_GPU, pad_rows_written=False,
      source=jnp.asarray(source, jnp.int32), source_divisor=divisor)


@pytest.mark.parametrize("layout", qm.SCALE_LAYOUTS)
def test_gathered_rows_are_the_reference_of_the_rows_they_name(layout, rng):
  """source (the MoE layer's quantize-and-permute): the live rows are the reference's quantization of x's rows
  source[r] // divisor, bit for bit; the blocks past the count are not written (the interpreter's NaN fill, the
  GPU's poison); a count outside [0, R] is clipped in the kernel; rows of a block holding a live row that are past
  the count are pad rows (q = 0, scale 1.0)."""
  for _ in range(2):
    t, groups, rows, divisor = int(rng.integers(1, 12)), int(rng.integers(2, 7)), int(rng.integers(5, 30)), 3
    rows += rows % 4 == 0  # a last row block shifted back over its neighbour
    x = random_activations(rng, (1, t, 128 * groups), INPUT_DTYPES["bf16"])
    source = rng.integers(0, t * divisor, rows).astype(np.int32)
    gathered = x[:, source // divisor]
    scale_cols = -(-rows // 4) * 4
    for count in sorted({-3, 0, 1, int(rng.integers(0, rows + 1)), rows, rows + 5}):
      live = min(max(count, 0), rows)
      _poison_memory(4 * x.size + 64 * rows)
      q, s = map(np.asarray, _gathered(x, source, divisor, count, layout=layout, scale_cols=scale_cols))
      q_ref, s_ref = _expected(gathered, [live], 128, layout=layout, ue8m0=layout == "col_packed", out_rows=rows,
                               scale_cols=scale_cols)
      # the rows of the 4-row blocks that start below the count (the last block shifted back to end at R)
      starts = [min(b * 4, rows - 4) for b in range(-(-rows // 4))]
      written = max([start + 4 for start in starts if start < live], default=0)
      as_rows = (lambda a: a) if layout == "row" else (lambda a: np.swapaxes(a, -1, -2))
      context = f"T={t} R={rows} count={count} {layout}"
      assert_matches_reference(q[:, :written], as_rows(s)[:, :written], q_ref[:, :written],
                               as_rows(s_ref)[:, :written], exact_codes=helpers.exact_codes(
                                   "mosaic", ue8m0=layout == "col_packed"), context=context)
      if not ON_GPU and written < rows:  # interpreted: unwritten rows keep the NaN fill
        assert np.isnan(q[:, written:].astype(np.float32)).all(), f"{context}: a pad block was written"


def test_gathered_rows_need_whole_tma_quanta_and_no_fused_silu():
  """A gathered row is loaded alone: its groups must make whole 128-byte TMA units, and the fused SiLU (two halves
  of a row) is not offered; both are stated by `problems` and refused by the launcher."""
  assert not qm.problems(group_size=128, scale_layout="col", scale_ue8m0=False, gather_k=7168, dtype=jnp.bfloat16)
  assert not qm.problems(group_size=16, scale_layout="col", scale_ue8m0=False, gather_k=64, dtype=jnp.bfloat16)
  found = qm.problems(group_size=16, scale_layout="col", scale_ue8m0=False, gather_k=32, dtype=jnp.bfloat16)
  assert any("128-byte loads" in p for p in found), found
  found = qm.problems(group_size=128, scale_layout="col", scale_ue8m0=False, gather_k=128, dtype=jnp.bfloat16,
                      fuse_silu_and_mul=True)
  assert any("fuse_silu_and_mul" in p for p in found), found
  with pytest.raises(ValueError, match="source"):
    qm.per_token_group_quant(jnp.zeros((2, 4, 256), jnp.bfloat16), jnp.array([4, 4], jnp.int32), group_size=128,
                             eps=1e-10, out_rows=4, scale_layout="col", scale_cols=4, scale_ue8m0=False,
                             fuse_silu_and_mul=False, config=Config(), interpret=True,
                             source=jnp.zeros((4,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("t, rows, k, live", [(1, 8, 7168, 3), (64, 512, 2048, 377), (4096, 32768, 2048, 29001)])
def test_gpu_gathered_rows_at_the_layers_sizes(t, rows, k, live, rng):
  """The MoE layer's quantize-and-permute at decode, medium and prefill sizes (top-8), native, against the
  reference, with the planner's config."""
  from jaxfp8 import quant as quant_api
  x = random_activations(rng, (1, t, k), INPUT_DTYPES["bf16"])
  source = rng.permutation(t * 8)[:rows].astype(np.int32)
  p = quant_api.problem(1, rows, k, jnp.bfloat16, group_size=128, eps=1e-10, scale_layout="col",
                        scale_tma_aligned=True, pad_rows_written=False, gather_divisor=8)
  config, _ = quant_mosaic_backend.default_config_for(p, _platform.device())
  _poison_memory(4 * x.size + 64 * rows)
  q, s = map(np.asarray, _gathered(x, source, 8, live, scale_cols=p.scale_cols, config=config))
  q_ref, s_ref = _expected(x[:, source // 8], [live], 128, out_rows=rows, scale_cols=p.scale_cols)
  assert_matches_reference(q[:, :live], s[:, :, :live], q_ref[:, :live], s_ref[:, :, :live],
                           exact_codes=helpers.exact_codes("mosaic", ue8m0=False), context=f"T={t} R={rows} {config}")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(out_rows=3), "out_rows=3 must be >= T"),
    (dict(scale_layout="col", scale_cols=7), "scale_cols=7 must be >= out_rows"),
    (dict(config=Config(block_rows=64, groups_per_block=8, blocks_per_cta=4, num_stages=4), rows=64, k=8192,
          out_rows=64), "shared memory"),
], ids=["out_rows<T", "scale_cols<out_rows", "smem_overflow"])
def test_bad_arguments_are_rejected(kwargs, fragment):
  kwargs = dict(kwargs)
  rows, k = kwargs.pop("rows", 8), kwargs.pop("k", 1024)
  args = dict(group_size=128, eps=1e-10, out_rows=rows, scale_layout="row", scale_cols=rows, scale_ue8m0=False,
              fuse_silu_and_mul=False, config=None, interpret=True)
  args.update(kwargs)
  with pytest.raises(ValueError, match=fragment):
    _launch(jnp.zeros((1, rows, k), jnp.bfloat16), jnp.array([rows], jnp.int32), **args)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(group_size=40), "group_size must be a multiple of 16"),
    (dict(group_size=512), "group_size must be a multiple of 16"),
    (dict(scale_layout="col_packed", scale_ue8m0=False), "requires scale_ue8m0"),
    (dict(scale_layout="diagonal"), "scale_layout must be one of"),
])
def test_what_the_kernel_cannot_do_is_stated(kwargs, fragment):
  args = dict(group_size=128, scale_layout="row", scale_ue8m0=False)
  args.update(kwargs)
  assert any(fragment in p for p in qm.problems(**args)), qm.problems(**args)
  assert not qm.problems(group_size=128, scale_layout="col", scale_ue8m0=False)
  # Through the public function the problem is refused with the same words, naming the implementation.
  if kwargs.get("scale_layout") in (None, "row"):
    with pytest.raises(ValueError, match=f"implementation='mosaic' cannot quantize this: .*{fragment}"):
      jaxfp8.per_token_group_quant_fp8(jnp.zeros((4, 8 * args["group_size"]), jnp.bfloat16), args["group_size"],
                                       implementation="mosaic", interpret=True)


def test_config_is_validated():
  with pytest.raises(ValueError, match="block_rows"):
    Config(block_rows=0)
  with pytest.raises(ValueError, match="<= 256"):
    Config(groups_per_block=512)


# ---- lowering for an H200 on CPU ----------------------------------------------------------------------------------

LOWERING_CASES = [
    # (E, T, K, G, dtype, layout, fuse, out_rows, scale_cols, config)
    (1, 4096, 7168, 128, "bf16", "col", False, 4096, 4096, None),
    (1, 4096, 7168, 128, "bf16", "col_packed", False, 4096, 4096, None),
    (1, 1, 7168, 128, "bf16", "row", False, 1, 1, None),
    (1, 1, 7168, 128, "bf16", "col", False, 4, 4, None),
    (1, 1, 7168, 128, "bf16", "col_packed", False, 1, 1, None),  # one-element scale stores
    (2, 1, 256, 256, "f32", "row", False, 1, 1, None),
    (1, 1, 144, 48, "bf16", "row", True, 1, 1, None),  # blocks under 128 bytes
    (3, 1, 32, 16, "bf16", "col_packed", False, 1, 1, None),  # one-row q stores that leave out groups past K/G
    (4, 21, 256, 128, "bf16", "col", False, 24, 28, Config(block_rows=8, groups_per_block=2)),  # scale-only blocks
    (1, 64, 7168, 128, "bf16", "col", False, 64, 64, None),
    (1, 4097, 18432, 128, "bf16", "col_packed", False, 4100, 4100, None),
    (1, 13, 18432, 128, "f32", "row", False, 16, 16, None),
    (8, 256, 2048, 128, "bf16", "col", True, 256, 256, None),
    (1, 1000, 2304, 128, "f16", "col_packed", True, 1000, 1000, None),
    (1, 512, 2048, 16, "bf16", "col", False, 512, 512, None),
    (1, 512, 2304, 48, "f32", "row", False, 512, 512, None),
    # 2-byte inputs whose 4-group "col_packed" sub-blocks have no bank-conflict-free q store (JAX 0.12 checks)
    (2, 301, 352, 16, "bf16", "col_packed", False, 304, 304, None),
    (2, 301, 1056, 48, "f16", "col_packed", False, 304, 304, None),
    (1, 4096, 7168, 128, "bf16", "col", False, 4096, 4096, Config(block_rows=32, groups_per_block=4)),
    (1, 4096, 7168, 128, "bf16", "col", False, 4096, 4096,
     Config(block_rows=16, groups_per_block=4, blocks_per_cta=14, num_stages=4)),
    (1, 4096, 7168, 128, "bf16", "col", True, 4096, 4096, Config(block_rows=64, groups_per_block=4)),
]


@pytest.mark.parametrize("t, rows, k", [(1, 8, 7168), (4096, 32768, 2048)])
def test_gathered_rows_lower_for_h200_as_one_kernel(t, rows, k):
  fn = functools.partial(qm.per_token_group_quant, group_size=128, eps=1e-10, out_rows=rows, scale_layout="col",
                         scale_cols=rows, scale_ue8m0=False, fuse_silu_and_mul=False,
                         config=Config(block_rows=4, groups_per_block=4), pad_rows_written=False, source_divisor=8)
  with _platform.abstract_h200():
    exported = jax.export.export(jax.jit(lambda x, v, src: fn(x, v, source=src)), platforms=["cuda"])(
        jax.ShapeDtypeStruct((1, t, k), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32))
  assert [o.shape for o in exported.out_avals] == [(1, rows, k), (1, k // 128, rows)]
  ops = re.findall(r"stablehlo\.([a-z_]+)", exported.mlir_module())
  assert ops.count("custom_call") == 1 and not set(ops) - {"custom_call", "reshape", "return"}, set(ops)


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: "-".join(map(str, c[:9])) + ("-cfg" if c[9] else ""))
def test_lowers_for_h200_as_one_kernel(case):
  experts, rows, k, group_size, dtype, layout, fuse, out_rows, scale_cols, config = case
  fn = functools.partial(
      _launch, group_size=group_size, eps=1e-10, out_rows=out_rows, scale_layout=layout,
      scale_cols=scale_cols, scale_ue8m0=layout == "col_packed", fuse_silu_and_mul=fuse, config=config)
  x = jax.ShapeDtypeStruct((experts, rows, (2 if fuse else 1) * k), INPUT_DTYPES[dtype])
  with _platform.abstract_h200():
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(x, jax.ShapeDtypeStruct((experts,), jnp.int32))
  groups = k // group_size
  scale_shape = {"row": (experts, out_rows, groups), "col": (experts, groups, scale_cols),
                 "col_packed": (experts, -(-groups // 4), scale_cols)}[layout]
  assert [o.shape for o in exported.out_avals] == [(experts, out_rows, k), scale_shape]
  # One Mosaic GPU kernel writes the final buffers: no pad, transpose, concatenate, slice or copy around it.
  text = exported.mlir_module()
  ops = re.findall(r"stablehlo\.([a-z_]+)", text)
  assert ops.count("custom_call") == 1 and "mosaic_gpu" in text, ops
  assert not set(ops) - {"custom_call", "reshape", "return"}, set(ops)


# ---- on a Hopper GPU: the real kernel ------------------------------------------------------------------------------

def _poison_memory(num_bytes: int) -> None:
  """Frees NaN-filled buffers, so that outputs allocated next start as garbage rather than zeros."""
  poison = [jnp.full((num_bytes // 2,), jnp.nan, jnp.bfloat16) for _ in range(4)]
  jax.block_until_ready(poison)
  del poison


GPU_CONFIGS = [None, Config(block_rows=32, groups_per_block=4), Config(block_rows=8, groups_per_block=8),
               Config(block_rows=16, groups_per_block=4, blocks_per_cta=14, num_stages=3)]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("experts, rows, k, valid", [
    (1, 1, 7168, [1]), (1, 64, 7168, [64]), (1, 4096, 7168, [4096]), (1, 13, 18432, [13]), (1, 1000, 2304, [1000]),
    (8, 256, 2048, [0, 256, 1, 100, 255, 17, 128, 64]),
])
def test_gpu_real_sizes(experts, rows, k, valid, rng):
  x = random_activations(rng, (experts, rows, k), INPUT_DTYPES["bf16"])
  out_rows = -(-rows // 4) * 4
  for layout in ("col", "col_packed", "row"):
    options = dict(layout=layout, ue8m0=layout != "col", out_rows=out_rows)
    q_ref, s_ref = _expected(x, valid, 128, **options)
    for config in GPU_CONFIGS:
      _poison_memory(2 * experts * out_rows * k)
      q, s = _quantize(x, valid, 128, config=config, **options)
      assert_matches_reference(q, s, q_ref, s_ref, exact_codes=helpers.exact_codes("mosaic", ue8m0=options["ue8m0"]),
                               context=f"E={experts} T={rows} K={k} {options} {config}")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES))
@pytest.mark.parametrize("group_size", [16, 32, 48, 64, 96, 128, 256])
def test_gpu_group_sizes_and_dtypes(group_size, dtype, rng):
  x = random_activations(rng, (2, 301, 22 * group_size), INPUT_DTYPES[dtype])
  _check(x, [301, 77], group_size, layout="col", out_rows=304, scale_cols=308)
  _check(x, [301, 77], group_size, layout="col_packed", ue8m0=True, out_rows=304)
  _check(np.concatenate([x, x[..., ::-1]], -1), [301, 77], group_size, layout="row", fuse=True)


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_special_values(rng):
  test_nan_and_inf("f32", rng)
  test_nan_and_inf("bf16", rng)
