"""Inputs built to break the contract's promises (issue 34), each a class of generated inputs:

- scales anywhere in float32's normal range, whose products overflow or underflow float32: each implementation
  against the rule docs/CONTRACT.md §2 writes for it (XLA: finite wherever the exact result is; the kernels, run
  interpreted here: the same where every a_s * b_s is a normal float32, not finite where one overflows);
- a NaN in one expert's weights (docs/CONTRACT.md §7, §8): it reaches that expert's live rows only, in both grouped
  layouts and through the MoE layer, with 8, 64 and 256 experts;
- `valid_rows` of every integer dtype, at its dtype's extremes, concrete and traced (docs/CONTRACT.md §2);
- every public op under `jax.shard_map`, check_vma on and off, inputs sharded and replicated, on 8 simulated CPU
  devices (docs/CONTRACT.md §5; the test re-runs itself in a subprocess, as tests/test_sharding.py does).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import jaxfp8
from jaxfp8 import _checks, moe
from jaxfp8 import reference as ref

FP8 = ref.FP8
F32_MAX = float(np.finfo(np.float32).max)
KERNEL_IMPLEMENTATIONS = ["triton", "mosaic"]


def _kernel_options(implementation):
  if implementation == "xla":
    return dict(implementation="xla")
  helpers.runnable(implementation)
  if implementation == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("the Mosaic GPU kernel does not import here")
  config = (helpers.mosaic_interpret_config() if implementation == "mosaic" else
            jaxfp8.TritonGemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=2))
  return dict(implementation=implementation, config=config, interpret=not helpers.ON_GPU)


# ---- scales anywhere in float32's normal range (docs/CONTRACT.md §2) -----------------------------------------------


def _wide_scales(rng, shape) -> np.ndarray:
  """Normal float32 scales whose exponents span the whole range, [2**-126, 2**128)."""
  return (np.exp2(rng.integers(-126, 128, shape)) * rng.uniform(1, 2, shape)).astype(np.float32)


def _codes(rng, rows, k, gk) -> np.ndarray:
  """Quantized normal data with some all-zero K groups (P = 0, where 0 * inf would be NaN)."""
  x = rng.standard_normal((rows, k)).astype(np.float32)
  zero = rng.random((rows, -(-k // gk))) < 0.2
  x[np.repeat(zero, gk, axis=1)[:, :k]] = 0
  return ref.per_token_group_quant_fp8(x, gk)[0]


def _range_rule(out, a_q, b_q, a_s, b_s, block_size, *, kernel: bool) -> tuple[bool, bool]:
  """Asserts docs/CONTRACT.md §2's range rule on every element of one dense product (row-major a_s); returns
  whether elements of both kinds were there: some of whose a_s * b_s overflow float32, some of whose do not."""
  gk = block_size[1]
  groups = a_s.shape[1]
  b_cols = np.repeat(b_s, block_size[0], axis=0)[:b_q.shape[0]]  # (N, G)
  a, b = a_q.astype(np.float64), b_q.astype(np.float64)
  with np.errstate(all="ignore"):
    products = np.stack([a_s[:, g:g + 1] * b_cols[None, :, g] for g in range(groups)])  # float32, as kernels do
    size = sum((np.abs(a[:, g * gk:(g + 1) * gk]) @ np.abs(b[:, g * gk:(g + 1) * gk]).T)
               * np.abs(a_s[:, g:g + 1].astype(np.float64)) * np.abs(b_cols[None, :, g].astype(np.float64))
               for g in range(groups))
  exact = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, block_size)
  out = np.asarray(out, np.float64)
  inside = size < F32_MAX / 4  # every partial sum well inside float32's range
  overflow = ~np.isfinite(products).all(axis=0)
  # float32 partial sums of gk fp8 products, then float32 scaling; terms under 2**-126 flush (and on the kernels, a
  # subnormal a_s * b_s loses a term under 2**-101). Natively, Hopper's FP8 tensor cores sum a K group's products
  # with about 14 bits (docs/CONTRACT.md §2), so a native kernel's partial sums are that far from exact.
  native = kernel and helpers.ON_GPU
  bound = (2.0**-10 if native else 2.0**-15) * size + groups * (2.0**-100 if kernel else 2.0**-125)
  held = inside & ~overflow if kernel else inside
  with np.errstate(invalid="ignore"):
    bad = held & ~(np.abs(out - exact) <= bound)
  assert not bad.any(), (f"{bad.sum()} of {held.sum()} elements beyond the rule, first {np.argwhere(bad)[0]}: "
                         f"{out[bad][0]} vs exact {exact[bad][0]}")
  if kernel:
    assert not np.isfinite(out[overflow]).any(), "a kernel kept a term whose a_s * b_s overflows float32"
  return bool((inside & overflow).any()), bool((inside & ~overflow).any())


@pytest.mark.parametrize("implementation", ["xla", *KERNEL_IMPLEMENTATIONS])
@pytest.mark.parametrize("m, n, k, block_size, column_major", [
    (64, 256, 256, (128, 128), False),
    (37, 200, 384, (64, 128), True),
    (1, 130, 256, (32, 128), False),
])
def test_gemm_scales_across_float32(rng, implementation, m, n, k, block_size, column_major):
  if implementation != "xla" and (block_size != (128, 128) or column_major):
    pytest.skip("one shape per kernel: interpreted kernels are slow")
  a_q = _codes(rng, m, k, block_size[1])
  b_q = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), block_size)[0]
  groups = -(-k // block_size[1])
  a_s, b_s = _wide_scales(rng, (m, groups)), _wide_scales(rng, (-(-n // block_size[0]), groups))
  # Both cases for sure, however few the elements: row 0's all-zero group 0 with an a_s * b_s that overflows in
  # weight block 0 and not in block 1, its other groups' scales ordinary there.
  a_q[0, :block_size[1]] = 0
  a_s[0], b_s[:2] = 1.0, 1.0
  a_s[0, 0], b_s[0, 0], b_s[1, 0] = 2.0**127, 2.0**127, 2.0**-126
  a_s_arg = np.ascontiguousarray(a_s.T) if column_major else a_s
  out = jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s_arg, b_s, block_size, a_s_column_major=column_major,
                                     out_dtype=jnp.float32, **_kernel_options(implementation))
  assert all(_range_rule(out, a_q, b_q, a_s, b_s, block_size, kernel=implementation != "xla")), "a case is missing"


@pytest.mark.parametrize("m, n, k, block_size", [(13, 256, 384, (128, 128)), (40, 130, 200, (64, 64))])
def test_xla_terms_are_the_plain_products_where_those_are_normal(rng, m, n, k, block_size):
  """A row whose a_s * b_s overflows switches the XLA GEMM to its exponent split for the whole call (docs/CONTRACT.md
  §2): every other row, whose products are normal, comes out bit for bit as without that row."""
  x = rng.standard_normal((m, -(-k // block_size[1]) * block_size[1])).astype(np.float32)
  a_q, a_s = ref.per_token_group_quant_fp8(x, block_size[1])
  a_q = np.ascontiguousarray(a_q[:, :k])
  b_q, b_s = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), block_size)
  a_s = (a_s * np.exp2(rng.uniform(-30, 30, a_s.shape))).astype(np.float32)
  call = lambda a_q, a_s: np.asarray(jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, block_size,
                                                                  out_dtype=jnp.float32, implementation="xla"))
  plain = call(a_q, a_s)
  extreme = np.full((1, a_s.shape[1]), 2.0**127, np.float32)
  split = call(np.concatenate([a_q, a_q[:1]]), np.concatenate([a_s, extreme]))
  np.testing.assert_array_equal(split[:m].view(np.uint32), plain.view(np.uint32))
  assert np.isfinite(plain).all() and not np.isfinite(split[m]).all()  # that row's exact result overflows


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
@pytest.mark.parametrize("layout", ["ragged", "masked"])
def test_grouped_scales_across_float32(rng, implementation, layout):
  """Each expert's rows hold the dense rule against its own weight and scales."""
  options = _kernel_options(implementation)
  e, n, k, bs = 3, 256, 256, (128, 128)
  b_q = np.stack([ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), bs)[0]
                  for _ in range(e)])
  b_s = _wide_scales(rng, (e, 2, 2))
  b_s[0, 0, 0] = 2.0**127  # with expert 0's first row's zero group below: an overflowing a_s * b_s, for sure
  if layout == "ragged":
    first = int(rng.integers(1, 40))
    sizes = np.array([first, 0, 64 - first], np.int32)
    a_q, a_s = _codes(rng, 64, k, 128), _wide_scales(rng, (64, 2))
    # ... and its other group's scale small, so that the row's sum stays inside float32 whatever b_s was drawn (the
    # wide draws alone left no such row for some seeds)
    a_q[0, :128], a_s[0, 0], a_s[0, 1] = 0, 2.0**127, 2.0**-100
    out = np.asarray(jaxfp8.ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, sizes, bs, out_dtype=jnp.float32,
                                                         **options))
    rows = np.split(np.arange(64), np.cumsum(sizes)[:-1])
    parts = [(out[r], a_q[r], a_s[r]) for r in rows]
  else:
    masked_m = np.array([16, rng.integers(1, 16), 0], np.int32)
    a_q = np.stack([_codes(rng, 16, k, 128) for _ in range(e)])
    a_s = _wide_scales(rng, (e, 16, 2))
    a_q[0, 0, :128], a_s[0, 0, 0], a_s[0, 0, 1] = 0, 2.0**127, 2.0**-100
    out = np.asarray(jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, bs, out_dtype=jnp.float32,
                                                         **options))
    parts = [(out[i, :c], a_q[i, :c], a_s[i, :c]) for i, c in enumerate(masked_m)]
    assert (out[2] == 0).all() and (out[1, masked_m[1]:] == 0).all()
  seen = [_range_rule(o, aq, b_q[i], sa, b_s[i], bs, kernel=implementation != "xla")
          for i, (o, aq, sa) in enumerate(parts) if len(o)]
  assert all(map(any, zip(*seen))), "a case is missing"


@pytest.mark.parametrize("implementation", ["xla", *KERNEL_IMPLEMENTATIONS])
def test_scale_products_beyond_float32(rng, implementation):
  """The issue's two examples as a class: a_s * b_s = 2**(e + f) overflows float32 (e + f in [129, 134]) while the
  exact result, with small codes, is ordinary (2**118 .. 2**127); and an all-zero K group with those scales, which
  adds 0 exactly (the kernels: 0 * inf = NaN)."""
  options = _kernel_options(implementation)
  m, n, k = 8, 256, 256
  f = int(rng.integers(8, 127))
  e = 129 + rng.integers(0, 6, m) - f  # each row's a_s exponent: in [2, 126]
  a_q = np.zeros((m, k), np.float32)
  a_q[:, :128] = rng.integers(1, 8, (m, 128)) * 2.0**-9  # e4m3 subnormal codes: P = sum of c * 2**-18, exact
  b_q = np.zeros((n, k), np.float32)
  b_q[:, :128] = 2.0**-9
  b_q[:, 128:] = 1.0  # a_q's group 1 is all zero: P = 0 there
  a_q, b_q = a_q.astype(FP8), b_q.astype(FP8)
  a_s = np.repeat(np.exp2(e.astype(np.float64))[:, None], 2, axis=1).astype(np.float32)
  b_s = np.full((2, 2), 2.0**f, np.float32)
  out = np.asarray(jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128), out_dtype=jnp.float32, **options))
  exact = ref.block_fp8_matmul(a_q, b_q, a_s, b_s, (128, 128))
  assert np.isfinite(exact).all() and np.abs(exact).max() < F32_MAX / 2
  if implementation == "xla":  # every product and scale a power of two: exact
    np.testing.assert_array_equal(out, exact.astype(np.float32))
  else:  # docs/CONTRACT.md §2: an overflowing a_s * b_s is not finite, whatever the exact result
    assert not np.isfinite(out).any()


# ---- a NaN in one expert's weights (docs/CONTRACT.md §7, §8) --------------------------------------------------------

FP8_NAN = np.array(np.nan, np.float32).astype(FP8)


def _expert_weights(rng, e, n, k):
  """Random e4m3 codes and scales for E experts (no quantization needed: only sameness is compared)."""
  q = np.clip(rng.standard_normal((e, n, k)) * 64, -448, 448).astype(FP8)
  return q, np.exp2(rng.uniform(-12, -6, (e, -(-n // 128), -(-k // 128)))).astype(np.float32)


def _poison(b_q, b_s, rng, live, dead):
  """NaN in expert `live`'s codes at one (n, k) (its rows get NaN in column n only); NaN codes and scales all over
  expert `dead`, which holds no row. Returns the poisoned copies and the column n."""
  b_q, b_s = b_q.copy(), b_s.copy()
  column, depth = rng.integers(0, b_q.shape[1]), rng.integers(0, b_q.shape[2])
  b_q[live, column, depth] = FP8_NAN
  b_q[dead], b_s[dead] = FP8_NAN, np.nan
  return b_q, b_s, column


def _assert_isolated(dirty, clean, live_rows, column):
  """Rows of the poisoned live expert: NaN in `column`, the clean values elsewhere; every other row: the clean
  values, bit for bit."""
  others = np.ones(dirty.shape[:-1], bool)
  others[live_rows] = False
  np.testing.assert_array_equal(dirty[others].view(np.uint32), clean[others].view(np.uint32))
  assert np.isnan(dirty[live_rows][..., column]).all()
  keep = np.arange(dirty.shape[-1]) != column
  np.testing.assert_array_equal(dirty[live_rows][..., keep], clean[live_rows][..., keep])


def _grouped_experts(implementation, experts):
  if implementation == "mosaic" and experts > 8:
    pytest.skip("the interpreted Mosaic kernel: 8 experts")
  return _kernel_options(implementation)


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
@pytest.mark.parametrize("experts", [8, 64, 256])
def test_ragged_nan_in_one_expert_stays_there(rng, implementation, experts):
  options = _grouped_experts(implementation, experts)
  m, n, k = 90, 128, 256
  dead, live = rng.choice(experts, 2, replace=False)
  # 85 routed rows over every expert but `dead`, `live` holding at least one; 5 rows no expert owns (NaN there).
  owners = np.concatenate([[live], rng.choice(np.setdiff1d(np.arange(experts), [dead]), 84)])
  sizes = np.bincount(owners, minlength=experts).astype(np.int32)
  a_q = np.clip(rng.standard_normal((m, k)) * 64, -448, 448).astype(FP8)
  a_q[85:] = FP8_NAN
  a_s = np.exp2(rng.uniform(-8, -2, (m, 2))).astype(np.float32)
  b_q, b_s = _expert_weights(rng, experts, n, k)
  dirty_q, dirty_s, column = _poison(b_q, b_s, rng, live, dead)
  run = lambda b_q, b_s: np.asarray(jaxfp8.ragged_w8a8_block_fp8_matmul(
      a_q, b_q, a_s, b_s, sizes, (128, 128), out_dtype=jnp.float32, **options))
  clean, dirty = run(b_q, b_s), run(dirty_q, dirty_s)
  expect = ref.ragged_block_fp8_matmul(a_q, b_q, a_s, b_s, sizes, (128, 128))
  assert ref.relative_error(clean, expect) <= 2e-4 and (clean[85:] == 0).all()
  start = sizes[:live].sum()
  _assert_isolated(dirty, clean, np.arange(start, start + sizes[live]), column)


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
@pytest.mark.parametrize("experts", [8, 64, 256])
def test_masked_nan_in_one_expert_stays_there(rng, implementation, experts):
  options = _grouped_experts(implementation, experts)
  t, n, k = 8, 128, 256
  dead, live = rng.choice(experts, 2, replace=False)
  masked_m = rng.integers(-1, t + 2, experts).astype(np.int32)
  masked_m[dead], masked_m[live] = 0, rng.integers(1, t + 1)
  a_q = np.clip(rng.standard_normal((experts, t, k)) * 64, -448, 448).astype(FP8)
  a_s = np.exp2(rng.uniform(-8, -2, (experts, t, 2))).astype(np.float32)
  dead_rows = np.arange(t)[None, :] >= np.clip(masked_m, 0, t)[:, None]
  a_q[dead_rows], a_s[dead_rows] = FP8_NAN, np.nan  # rows past masked_m may hold anything
  b_q, b_s = _expert_weights(rng, experts, n, k)
  dirty_q, dirty_s, column = _poison(b_q, b_s, rng, live, dead)
  run = lambda b_q, b_s: np.asarray(jaxfp8.masked_w8a8_block_fp8_matmul(
      a_q, b_q, a_s, b_s, masked_m, (128, 128), out_dtype=jnp.float32, **options))
  clean, dirty = run(b_q, b_s), run(dirty_q, dirty_s)
  expect = ref.masked_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, (128, 128))
  assert ref.relative_error(clean, expect) <= 2e-4 and (clean[dead_rows] == 0).all()
  live_rows = np.zeros((experts, t), bool)
  live_rows[live, :masked_m[live]] = True
  _assert_isolated(dirty, clean, live_rows, column)


@pytest.mark.parametrize("experts", [8, 64, 256])
def test_moe_nan_in_one_expert_reaches_its_tokens_only(rng, experts):
  """Through `fp8_moe`: the tokens with a slot on the poisoned expert get NaN, every other token is bit for bit
  what it is with clean weights (an expert that no token picks, poisoned all over, touches nothing)."""
  tokens, top_k, h, i = 24, 4, 256, 128
  dead, live = rng.choice(experts, 2, replace=False)
  allowed = np.setdiff1d(np.arange(experts), [dead])
  ids = np.stack([rng.choice(allowed, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
  ids[0, 0] = live if live not in ids[0] else ids[0, 0]
  weights = rng.random((tokens, top_k)).astype(np.float32)
  x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.bfloat16)
  w13_q, w13_s = _expert_weights(rng, experts, 2 * i, h)
  w2_q, w2_s = _expert_weights(rng, experts, h, i)
  dirty13_q, dirty13_s, _ = _poison(w13_q, w13_s, rng, live, dead)
  run = lambda w13_q, w13_s: np.asarray(moe.fp8_moe(x, ids, weights, w13_q, w13_s, w2_q, w2_s,
                                                    implementation="xla"), np.float32)
  clean, dirty = run(w13_q, w13_s), run(dirty13_q, dirty13_s)
  assert np.isfinite(clean).all()
  hit = (ids == live).any(axis=1)
  assert hit[0] and np.isnan(dirty[hit]).any(axis=1).all()
  np.testing.assert_array_equal(dirty[~hit].view(np.uint32), clean[~hit].view(np.uint32))


# ---- valid_rows of every integer dtype (docs/CONTRACT.md §2) ----------------------------------------------------------

INTEGER_DTYPES = [np.dtype(d) for d in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                        np.uint64)]
INTEGER_DTYPES += [np.dtype(getattr(ml_dtypes, name)) for name in ("int2", "uint2", "int4", "uint4")
                   if hasattr(ml_dtypes, name)]


def _extreme_counts(dtype, rows: int) -> list[int]:
  """The dtype's extremes, the values around 0 and the row count, and the widths that wrap when narrowed."""
  info = ml_dtypes.iinfo(dtype)
  values = {int(info.min), int(info.min) + 1, -1, 0, 1, rows - 1, rows, rows + 1, 2**31 - 1, 2**31 + 1,
            2**32 + 2, 2**63 - 1, int(info.max) - 1, int(info.max)}
  return sorted(v for v in values if int(info.min) <= v <= int(info.max))


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("rows", [5, 300])
def test_valid_rows_is_clipped_in_its_own_dtype(dtype, rows):
  """Host (NumPy) counts, device counts and traced counts of each dtype: clipped to [0, rows] exactly, whatever the
  narrowing to int32 would do to them. A device count is the value JAX holds (int64 needs x64, below). An int32
  device count goes on as it is: its consumers clip it (test_linear_and_gemm_take_counts_past_int32)."""
  clip = jax.jit(lambda v: _checks.valid_rows(v, rows))
  for value in _extreme_counts(dtype, rows):
    host = np.array(value, dtype)
    assert int(_checks.valid_rows(host, rows)) == min(max(value, 0), rows), (dtype, value)
    device = jnp.asarray(host)
    held = int(np.asarray(device).astype(object))
    want = held if device.dtype == jnp.int32 else min(max(held, 0), rows)
    for got in (_checks.valid_rows(device, rows), clip(device)):
      assert got.dtype == jnp.int32 and int(got) == want, (dtype, value, device.dtype)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_wide_counts_under_x64(dtype):
  with jax.enable_x64(True):
    for value in _extreme_counts(np.dtype(dtype), 7):
      count = jnp.asarray(value, dtype)
      assert count.dtype == dtype
      for got in (_checks.valid_rows(count, 7), jax.jit(lambda v: _checks.valid_rows(v, 7))(count)):
        assert int(got) == min(max(value, 0), 7), (dtype, value)


def test_linear_and_gemm_take_counts_past_int32(rng):
  """Through the public ops: counts that the old cast to int32 wrapped (no live row where all rows are live, or a
  few) give the clipped count's rows, eager and traced (traced: the count JAX holds, since without x64 jax.jit
  itself narrows an int64 NumPy argument)."""
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((128, 256)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16)
  linear = lambda v: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), implementation="xla", valid_rows=v)
  a_q, a_s = jaxfp8.per_token_group_quant_fp8(x, 128, implementation="xla")
  gemm = lambda v: jaxfp8.w8a8_block_fp8_matmul(a_q, w_q, a_s, w_s, (128, 128), implementation="xla", valid_rows=v)
  counts = [np.array(2**32 + 2, np.int64), np.array(2**63 - 1, np.int64), jnp.asarray(2**31 + 1, jnp.uint32),
            np.array(np.iinfo(np.int64).min, np.int64), jnp.asarray(-128, jnp.int8), np.array(3, np.uint64),
            jnp.asarray(2**31 - 1, jnp.int32), jnp.asarray(-2**31, jnp.int32), jnp.asarray(7, jnp.int32)]
  for f in (linear, gemm):
    full = np.asarray(f(6))
    for count in counts:
      held = jnp.asarray(count)
      for value, out in ((count, f(count)), (held, jax.jit(f)(held))):
        live = min(max(int(np.asarray(value).astype(object)), 0), 6)
        out = np.asarray(out)
        np.testing.assert_array_equal(out[:live], full[:live])
        assert (out[live:] == 0).all(), (count, live)


# ---- every public op under jax.shard_map (docs/CONTRACT.md §5) --------------------------------------------------------

DEVICES = 8
_INNER = "JAXFP8_ADVERSARIAL_INNER"
needs_8 = pytest.mark.skipif(len(jax.devices()) < DEVICES, reason="needs 8 devices (run by the subprocess test)")


def test_shard_map_tests_on_8_cpu_devices():
  if os.environ.get(_INNER) or len(jax.devices()) >= DEVICES:
    pytest.skip("already the 8-device process")
  output = helpers.rerun_on_cpu_devices(__file__, _INNER, DEVICES, "-k", "under_shard_map")
  passed = re.search(r"(\d+) passed", output)
  assert passed and int(passed.group(1)) == len(SHARD_MAP_OPS) * len(MAP_KINDS) + 2, output[-3000:]


EXPERTS = 4


def _shard_map_ops(rng):
  """Each public op as f(x (R, 256) float32, counts (EXPERTS,) int32) on its XLA path, with its other arrays
  (weights, routers) fixed: x's rows and the counts are what a device gets."""
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((256, 256)), jnp.float32))
  bias = jnp.asarray(rng.standard_normal(256), jnp.float32)
  b_q, b_s = (jnp.asarray(a) for a in _expert_weights(rng, EXPERTS, 256, 256))
  w13 = tuple(jnp.asarray(a) for a in _expert_weights(rng, EXPERTS, 256, 256))
  w2 = tuple(jnp.asarray(a) for a in _expert_weights(rng, EXPERTS, 256, 128))
  xla = dict(implementation="xla")
  quant = lambda x, **kw: jaxfp8.per_token_group_quant_fp8(x, 128, **xla, **kw)
  linear = lambda x, **kw: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias, **xla, **kw)

  def masked(x, c):
    a_q, a_s = quant(x.reshape(2, -1, 256), masked_m=c[:2], column_major_scales=True)
    return jaxfp8.masked_w8a8_block_fp8_matmul(a_q, b_q[:2], a_s, b_s[:2], c[:2], (128, 128), a_s_column_major=True,
                                               **xla)

  def routed(x):
    scores, ids = jax.lax.top_k(x[:, :EXPERTS], 2)
    return ids, jax.nn.softmax(scores, axis=-1)

  return {
      "quant": lambda x, c: quant(x),
      "quant_masked": lambda x, c: quant(x.reshape(2, -1, 256), masked_m=c[:2]),
      "gemm": lambda x, c: jaxfp8.w8a8_block_fp8_matmul(*quant(x)[:1], w_q, quant(x)[1], w_s, (128, 128), bias=bias,
                                                        **xla),
      "gemm_valid_rows": lambda x, c: jaxfp8.w8a8_block_fp8_matmul(*quant(x)[:1], w_q, quant(x)[1], w_s, (128, 128),
                                                                   valid_rows=c[0], **xla),
      "linear": lambda x, c: linear(x),
      "linear_valid_rows": lambda x, c: linear(x, valid_rows=c[0]),
      "linear_grad": lambda x, c: jax.grad(lambda x: (linear(x, valid_rows=c[0]) ** 2).sum())(x),
      "ragged": lambda x, c: jaxfp8.ragged_w8a8_block_fp8_matmul(*quant(x)[:1], b_q, quant(x)[1], b_s, c, (128, 128),
                                                                 **xla),
      "masked": masked,
      "fp8_moe": lambda x, c: moe.fp8_moe(x, *routed(x), *w13, *w2, **xla),
      "fp8_moe_from_logits": lambda x, c: moe.fp8_moe_from_logits(x, x[:, :EXPERTS] * 4, *w13, *w2,
                                                                  router=moe.Qwen3MoeRouter(top_k=2), **xla),
  }


SHARD_MAP_OPS = list(_shard_map_ops(np.random.default_rng(0)))


def _flat(out) -> jax.Array:
  """An op's outputs as one float32 row (a device's share of the mapped result)."""
  return jnp.concatenate([jnp.ravel(o.astype(jnp.float32)) for o in jax.tree.leaves(out)])[None]


# Replicated inputs are checked with check_vma only: without it they add nothing the sharded case does not.
MAP_KINDS = [(True, True), (True, False), (False, True)]  # (sharded, check_vma)


@needs_8
@pytest.mark.parametrize("sharded,check_vma", MAP_KINDS)
@pytest.mark.parametrize("op", SHARD_MAP_OPS)
def test_public_ops_under_shard_map(rng, op, check_vma, sharded):
  f = _shard_map_ops(rng)[op]
  mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.asarray(rng.standard_normal((DEVICES * 4, 256)) * 3, jnp.float32)
  counts = jnp.asarray(rng.integers(-1, 6, DEVICES * EXPERTS), jnp.int32)
  g = lambda x, c: _flat(f(x, c))
  if sharded:  # each device: its 4 rows and its own EXPERTS counts
    mapped = jax.shard_map(g, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"), check_vma=check_vma)
    want = np.concatenate([np.asarray(g(x[4 * d:4 * d + 4], counts[EXPERTS * d:EXPERTS * (d + 1)]))
                           for d in range(DEVICES)])
    got = mapped(x, counts)
  else:  # replicated: every device the whole call
    mapped = jax.shard_map(g, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=check_vma)
    want = np.asarray(g(x, counts[:EXPERTS]))
    got = mapped(x, counts[:EXPERTS])
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@needs_8
@pytest.mark.parametrize("check_vma", [True, False])
def test_linear_bias_gradient_under_shard_map_follows_jax(rng, check_vma):
  """The cotangent of a bias every device shares: with check_vma, the sum of every device's (JAX's own rule for a
  replicated value's use, which a custom_vjp must follow); without, each device's own."""
  w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((256, 256)), jnp.float32))
  bias = jnp.asarray(rng.standard_normal(256), jnp.float32)
  mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.asarray(rng.standard_normal((DEVICES * 4, 256)), jnp.float32)

  def per_device(x):
    weight = jax.lax.stop_gradient(jnp.cos(x))  # dy: the bias's gradient is its rows' sum
    loss = lambda b: (jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), b, implementation="xla") * weight).sum()
    return jax.grad(loss)(bias)[None]

  got = np.asarray(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma)(x))
  rows = np.cos(np.asarray(x, np.float64)).reshape(DEVICES, 4, 256).sum(axis=1)
  want = np.broadcast_to(rows.sum(axis=0), rows.shape) if check_vma else rows
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
