"""The Mosaic GPU combine (pallas_kernels/combine_rows_mosaic.py), the MoE layer's last step: interpreted on CPU
(natively on a Hopper GPU) against the XLA formula of `jaxfp8.moe.combine.combine_slots`, bit for bit, on random
slots whose invalid ones carry NaN/inf weights and rows of NaN (or out of range) that must never be read; lowered
for an H200 at DeepSeek-V3's and Qwen3's sizes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxfp8 import _platform
from helpers import ON_GPU, backend_importable

IMPORTABLE = backend_importable("pallas_kernels.combine_rows_mosaic")
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason="pallas_kernels.combine_rows_mosaic does not import here")
INTERPRET = not ON_GPU
OUT_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _config(*args, **kwargs):
  from pallas_kernels import combine_rows_mosaic as c
  return c.CombineRowsConfig(*args, **kwargs)


def _case(rng, t, k, h, frac, *, spare=5):
  """y (R, H) float32 whose rows from `live` on are NaN; slots valid with probability `frac`, each valid one reading a
  live row, each invalid one a NaN row, a row out of range, and a NaN or infinite weight."""
  r = max(t * k, 1) + spare
  live = max(1, r - spare - 1)
  y = (rng.standard_normal((r, h)) * np.exp2(rng.integers(-4, 5, (r, 1)))).astype(np.float32)
  y[live:] = np.nan
  valid = rng.random((t, k)) < frac
  rows = rng.integers(0, live, (t, k)).astype(np.int32)
  bad_rows = rng.choice(np.array([live, r - 1, -1, r + 1000, 2**31 - 1], np.int64), (t, k)).astype(np.int32)
  rows = np.where(valid, rows, bad_rows)
  w = rng.standard_normal((t, k)).astype(np.float32)
  w = np.where(valid, w, rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), (t, k)))
  return y, rows, w, valid


def _xla_combine(y, rows, w, valid, out_dtype):
  """combine / combine_slots of jaxfp8.moe.combine, in jnp (the XLA the kernel stands in for), each product behind an
  optimization barrier: XLA's CPU compiler contracts a multiply and the add it feeds into an FMA in some fusions
  (T=11, k=3, H=256 here), and the kernel rounds the product first, as the formula reads."""
  t, k = rows.shape
  rows = jnp.where(valid.reshape(-1), rows.reshape(-1), 0)
  y_slots = y[rows].reshape(t, k, -1)
  weights = jnp.where(valid, w.astype(jnp.float32), 0.0)
  acc = jnp.zeros((t, y.shape[1]), jnp.float32)
  for j in range(k):
    acc = acc + jax.lax.optimization_barrier(weights[:, j, None] * jnp.where(valid[:, j, None], y_slots[:, j], 0.0))
  return acc.astype(out_dtype)


def _reference(y, rows, w, valid, out_dtype=jnp.bfloat16):
  """The XLA formula, run on the CPU (checked against NumPy's per-operation float32 in
  test_reference_rounds_each_operation)."""
  cpu = jax.devices("cpu")[0]
  args = jax.device_put((y, rows, w, valid), cpu)
  return np.asarray(jax.jit(_xla_combine, static_argnums=4)(*args, out_dtype))


def _numpy_reference(y, rows, w, valid, out_dtype):
  acc = np.zeros((rows.shape[0], y.shape[1]), np.float32)
  weights = np.where(valid, w, np.float32(0))
  for j in range(rows.shape[1]):
    acc = acc + weights[:, j, None] * np.where(valid[:, j, None], y[np.where(valid[:, j], rows[:, j], 0)],
                                               np.float32(0))
  return acc.astype(ml_dtypes.bfloat16 if out_dtype == jnp.bfloat16 else out_dtype)


def _combine(y, rows, w, valid, out_dtype=jnp.bfloat16, config=None):
  from pallas_kernels import combine_rows_mosaic as c
  return np.asarray(c.combine_rows(jnp.asarray(y), jnp.asarray(rows), jnp.asarray(w), jnp.asarray(valid),
                                   out_dtype=out_dtype, config=config or c.CombineRowsConfig(), interpret=INTERPRET))


def _assert_same_bits(out, expected, context=""):
  assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype, expected.shape)
  bits = lambda a: a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
  nan = np.isnan(out.astype(np.float32)) & np.isnan(expected.astype(np.float32))
  bad = (bits(out) != bits(expected)) & ~nan
  assert not bad.any(), (f"{context}: {bad.sum()} of {bad.size} elements differ, first at {np.argwhere(bad)[0]}: "
                         f"{out[tuple(np.argwhere(bad)[0])]} vs {expected[tuple(np.argwhere(bad)[0])]}")


@pytest.mark.parametrize("t, k, h", [(1, 1, 128), (7, 2, 384), (33, 8, 128), (33, 2, 256), (16, 8, 384), (9, 1, 256)])
def test_matches_xla_bit_for_bit(rng, t, k, h):
  frac = float(rng.uniform(0.1, 0.9))
  y, rows, w, valid = _case(rng, t, k, h, frac)
  _assert_same_bits(_combine(y, rows, w, valid), _reference(y, rows, w, valid), f"T={t} k={k} H={h} valid {frac:.2f}")


@pytest.mark.parametrize("config", [(1, 128, 1), (3, 128, 2), (8, 256, 3), (5, 384, 16), (256, 1024, 8)],
                         ids=lambda c: "-".join(map(str, c)))
def test_configs(rng, config):
  # block_cols 384 on H = 512 shifts the last column chunk back (overlapping its neighbour); block_tokens 5 and 3
  # shift the last token block; num_stages below k is raised to k; 256 tokens are clamped to 256 / k and to T.
  y, rows, w, valid = _case(rng, 23, 4, 512, 0.6)
  _assert_same_bits(_combine(y, rows, w, valid, config=_config(*config)), _reference(y, rows, w, valid), str(config))


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_output_dtypes(rng, dtype):
  y, rows, w, valid = _case(rng, 11, 3, 256, 0.5)
  out_dtype = OUT_DTYPES[dtype]
  _assert_same_bits(_combine(y, rows, w, valid, out_dtype), _reference(y, rows, w, valid, out_dtype), dtype)


@pytest.mark.parametrize("t, k, config", [(34, 2, (16, 1024, 8)), (44, 3, (5, 128, 4)), (33, 2, (16, 1024, 8))])
def test_boxes_of_scalars_start_on_16_bytes(rng, t, k, config):
  # The block's scalars go by TMA in a box aligned down to 4 slots and shifted back to end at T * k: token blocks
  # starting at slot 15, 30, ... (k = 3, 5 tokens a block); T = 34, k = 2: the last two blocks' boxes end at slot 68.
  # T * k = 66 (not a multiple of 4) reads its scalars from global memory instead: on the H200, its last block's box
  # starting at slot 34 (136 bytes) stopped the GPU with an illegal instruction.
  y, rows, w, valid = _case(rng, t, k, 256, 0.5)
  _assert_same_bits(_combine(y, rows, w, valid, config=_config(*config)), _reference(y, rows, w, valid))


def test_sixteen_slots_and_slots_in_shared_memory(rng):
  # k = 16: 16 tokens' 256 slots are one TMA box of scalars; T * k = 640 >= that box, so they go by TMA.
  y, rows, w, valid = _case(rng, 40, 16, 128, 0.3)
  _assert_same_bits(_combine(y, rows, w, valid, config=_config(16, 128, 4)), _reference(y, rows, w, valid))


def test_all_invalid_gives_zeros_and_no_tokens_an_empty_output(rng):
  y, rows, w, valid = _case(rng, 13, 8, 256, 0.0)
  assert not valid.any()
  out = _combine(y, rows, w, valid)  # every slot's weight is NaN or inf and its row NaN or out of range
  assert out.dtype == ml_dtypes.bfloat16 and not out.astype(np.float32).view(np.uint32).any(), "not +0 everywhere"
  empty = _combine(y, rows[:0], w[:0], valid[:0])
  assert empty.shape == (0, 256) and empty.dtype == ml_dtypes.bfloat16


def test_valid_nan_weight_poisons_its_token_only(rng):
  y, rows, w, valid = _case(rng, 9, 2, 128, 1.0)
  w[4, 1] = np.nan
  out = _combine(y, rows, w, valid).astype(np.float32)
  assert np.isnan(out[4]).all() and not np.isnan(np.delete(out, 4, axis=0)).any()
  _assert_same_bits(_combine(y, rows, w, valid), _reference(y, rows, w, valid))


def test_int32_valid_and_one_compile_for_any_slots(rng):
  from pallas_kernels import combine_rows_mosaic as c
  y, rows, w, valid = _case(rng, 10, 2, 128, 0.5)
  f = jax.jit(lambda r, w, v: c.combine_rows(jnp.asarray(y), r, w, v, config=c.CombineRowsConfig(),
                                             interpret=INTERPRET))
  for frac in (0.2, 0.9, 0.0):
    _, rows, w, valid = _case(rng, 10, 2, 128, frac)
    out = np.asarray(f(jnp.asarray(rows), jnp.asarray(w), jnp.asarray(valid.astype(np.int32))))
    _assert_same_bits(out, _reference(y, rows, w, valid), f"valid {frac}")
  assert f._cache_size() == 1


@pytest.mark.parametrize("t, k, h", [(64, 8, 256), (11, 3, 256)])
def test_reference_rounds_each_operation(rng, t, k, h):
  # The reference rounds each product before its add, as NumPy's float32 does (no FMA): the kernel is held to that.
  y, rows, w, valid = _case(rng, t, k, h, 0.7)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    _assert_same_bits(_reference(y, rows, w, valid, dtype), _numpy_reference(y, rows, w, valid, dtype), str(dtype))


def test_problems_name_what_it_cannot_take():
  from pallas_kernels import combine_rows_mosaic as c
  cfg = c.CombineRowsConfig()
  assert not c.problems(4096, 8, 7168, config=cfg)
  assert not c.problems(1, 16, 2048, out_dtype=jnp.float32, config=cfg)
  assert any("multiple of 128" in p for p in c.problems(8, 8, 100, config=cfg))
  assert any("k=0" in p for p in c.problems(8, 0, 128, config=cfg))
  assert any("k=33" in p for p in c.problems(8, 33, 128, config=cfg))
  assert any("y must be float32" in p for p in c.problems(8, 8, 128, y_dtype=jnp.bfloat16, config=cfg))
  assert any("out_dtype" in p for p in c.problems(8, 8, 128, out_dtype=jnp.int8, config=cfg))
  assert any("shared memory" in p for p in c.problems(8, 8, 32768, config=c.CombineRowsConfig(block_cols=32768)))


@pytest.mark.parametrize("kwargs, field", [
    ({"block_tokens": 0}, "block_tokens"), ({"block_tokens": 2.0}, "block_tokens"),
    ({"block_tokens": True}, "block_tokens"),
    ({"block_cols": 100}, "block_cols"), ({"block_cols": 0}, "block_cols"), ({"block_cols": 128 * 257}, "block_cols"),
    ({"num_stages": 0}, "num_stages"), ({"num_stages": 65}, "num_stages"),
])
def test_config_is_validated(kwargs, field):
  with pytest.raises(ValueError, match=f"CombineRowsConfig.{field}"):
    _config(**kwargs)


LOWERING_CASES = [  # (T, k, H, R, config)
    (4096, 8, 7168, 32768, None),  # DeepSeek-V3
    (4096, 8, 2048, 32768, None),  # Qwen3-MoE
    (4096, 8, 7168, 32768, (8, 1792, 8)),
    (4096, 8, 2048, 32768, (16, 2048, 8)),
    (1, 8, 7168, 8, (1, 256, 8)),  # decode: scalars straight from global memory
    (33, 1, 384, 40, (8, 256, 2)),
    (100, 16, 2048, 1600, None),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: "-".join(map(str, c[:4])) + ("-cfg" if c[4] else ""))
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
def test_lowers_for_an_h200_as_one_kernel(case, out_dtype):
  from pallas_kernels import combine_rows_mosaic as c
  t, k, h, r, config = case
  config = c.CombineRowsConfig(*config) if config else c.CombineRowsConfig()
  assert not c.problems(t, k, h, out_dtype=OUT_DTYPES[out_dtype], config=config)
  fn = lambda y, rows, w, v: c.combine_rows(y, rows, w, v, out_dtype=OUT_DTYPES[out_dtype], config=config)
  with _platform.abstract_h200():
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        jax.ShapeDtypeStruct((r, h), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32),
        jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32))
  assert [o.shape for o in exported.out_avals] == [(t, h)]
  ops = re.findall(r"stablehlo\.([a-z_]+)", exported.mlir_module())
  # The rows are moved by the kernel, not by an XLA gather; nothing but free reshapes around it.
  assert ops.count("custom_call") == 1 and not set(ops) - {"custom_call", "reshape", "return"}, set(ops)


# ---- on a Hopper GPU: the real kernel ------------------------------------------------------------------------------

def _routed_case(rng, t, k, h, valid_slots):
  """Slots of no local expert everywhere but `valid_slots` of them (expert parallelism); the valid ones read the
  first rows of y in a random order, the rows past them NaN."""
  r = t * k
  y = rng.standard_normal((r, h), dtype=np.float32)
  y[valid_slots:] = np.nan
  valid = np.zeros(r, bool)
  valid[rng.permutation(r)[:valid_slots]] = True
  valid = valid.reshape(t, k)
  rows = rng.integers(valid_slots, r + 1, (t, k)).astype(np.int32)
  rows[valid] = rng.permutation(valid_slots)
  w = rng.random((t, k), dtype=np.float32)
  w[~valid] = np.nan
  return y, rows, w, valid


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("t, k, h, valid_slots, config", [
    (4096, 8, 7168, 3940, None), (4096, 8, 7168, 3940, (8, 1792, 8)), (4096, 8, 7168, 32768, None),
    (4096, 8, 2048, 3940, (16, 2048, 8)), (4096, 8, 2048, 32768, None), (1, 8, 7168, 8, (1, 256, 8)),
    (4095, 8, 2048, 20000, (16, 384, 12)),
])
def test_gpu_real_sizes(rng, t, k, h, valid_slots, config):
  if not _platform.is_hopper():
    pytest.skip("needs a Hopper GPU")
  y, rows, w, valid = _routed_case(rng, t, k, h, min(valid_slots, t * k))
  out = _combine(y, rows, w, valid, config=_config(*config) if config else None)
  _assert_same_bits(out, _reference(y, rows, w, valid), f"T={t} H={h} valid={valid_slots}")
