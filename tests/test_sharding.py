"""Column- and row-parallel block-FP8 linears through jax.shard_map / NamedSharding, on 8 simulated CPU devices.

XLA_FLAGS must be set before JAX starts, so `test_sharding_suite_on_8_cpu_devices` reruns this file in a fresh
pytest process with `--xla_force_host_platform_device_count=8` and JAX_PLATFORMS=cpu (also on a GPU machine); there
the tests below run, and in the outer process (one device) they skip. Run them directly with
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m pytest tests/test_sharding.py
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import helpers
from jaxfp8 import gemm, linear
from jaxfp8 import reference as ref

DEVICES = 8
_INNER = "JAXFP8_SHARDING_INNER"
needs_8 = pytest.mark.skipif(len(jax.devices()) < DEVICES, reason="needs 8 devices (run by the subprocess test)")


def test_sharding_suite_on_8_cpu_devices():
  if os.environ.get(_INNER) or len(jax.devices()) >= DEVICES:
    pytest.skip("already the 8-device process")
  output = helpers.rerun_on_cpu_devices(__file__, _INNER, DEVICES, "-rs", timeout=600)
  passed = re.search(r"(\d+) passed", output)
  # Every 8-device test ran (only the Flax one may skip, where Flax is not installed).
  assert passed and int(passed.group(1)) >= 8, output[-3000:]


# ---- the tests that run in the 8-device process ----------------------------------------------------------------------

def _mesh(shape=(DEVICES,), names=("tp",), axis_type=jax.sharding.AxisType.Explicit):
  """Explicit axes are jax.make_mesh's default; Auto axes leave resharding to the compiler (GSPMD)."""
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


AXIS_TYPES = [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto]


def _weight(rng, n, k, block_size=(128, 128)):
  w = rng.standard_normal((n, k)).astype(np.float32)
  gn, gk = block_size
  w *= np.repeat(np.repeat(np.exp2(rng.uniform(-3, 3, (-(-n // gn), -(-k // gk)))), gn, 0), gk, 1)[:n, :k]
  return ref.quantize_weight_blockwise(w.astype(np.float32), block_size)


def _x(rng, shape, dtype=jnp.bfloat16):
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape[:-1] + (1,)))
  return jnp.asarray(x, dtype)


def _close(out, x, w_q, w_s, block_size, bias=None, tolerance=None):
  want = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), w_q, w_s, block_size, bias=bias), out.dtype)
  assert out.shape == want.shape
  err = ref.relative_error(np.asarray(out), want)
  assert err <= (tolerance or (2e-4 if out.dtype == jnp.float32 else 5e-3)), err


def _bits(a):
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@needs_8
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("x_shape, block_size, dtype, bias", [
    ((5, 256), (128, 128), jnp.bfloat16, True),
    ((2, 3, 128), (64, 64), jnp.float32, False),
])
def test_column_parallel_matches_unsharded(rng, x_shape, block_size, dtype, bias, axis_type):
  mesh = _mesh(axis_type=axis_type)
  n, k = DEVICES * block_size[0], x_shape[-1]
  w_q, w_s = _weight(rng, n, k, block_size)
  b = rng.standard_normal(n).astype(np.float32) if bias else None
  placed = linear.shard_linear_weights(w_q, w_s, b, mesh=mesh, axis_name="tp", parallel="column")
  assert placed[0].sharding.spec == P("tp", None) and placed[0].addressable_shards[0].data.shape == (n // 8, k)
  x = jax.device_put(_x(rng, x_shape, dtype), NamedSharding(mesh, P()))
  f = jax.jit(lambda x, w_q, w_s, b: linear.column_parallel_linear(x, w_q, w_s, block_size, b, mesh=mesh,
                                                                   axis_name="tp"))
  out = f(x, *placed)
  assert out.sharding.spec == P(*([None] * (len(x_shape) - 1)), "tp")
  _close(out, x, w_q, w_s, block_size, b)
  # Each device runs the unsharded computation on its columns: the same bits.
  unsharded = linear.w8a8_block_fp8_linear(np.asarray(x), w_q, w_s, block_size, b)
  np.testing.assert_array_equal(_bits(out), _bits(unsharded))
  # Eager, with host weights (placed by the call) and an all-gathered output.
  gathered = linear.column_parallel_linear(np.asarray(x), w_q, w_s, block_size, b, mesh=mesh, axis_name="tp",
                                           gather_output=True)
  assert gathered.sharding.is_fully_replicated
  np.testing.assert_array_equal(_bits(gathered), _bits(unsharded))


@needs_8
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("x_shape, block_size, bias", [((5, 1024), (128, 128), True), ((3, 4, 512), (64, 64), False)])
def test_row_parallel_matches_unsharded(rng, x_shape, block_size, bias, axis_type):
  mesh = _mesh(axis_type=axis_type)
  n, k = 200, x_shape[-1]
  w_q, w_s = _weight(rng, n, k, block_size)
  b = rng.standard_normal(n).astype(np.float32) if bias else None
  placed = linear.shard_linear_weights(w_q, w_s, b, mesh=mesh, axis_name="tp", parallel="row")
  assert placed[1].sharding.spec == P(None, "tp")
  x = jax.device_put(_x(rng, x_shape, jnp.float32), NamedSharding(mesh, P(*([None] * (len(x_shape) - 1)), "tp")))
  f = jax.jit(lambda x, w_q, w_s, b: linear.row_parallel_linear(x, w_q, w_s, block_size, b, mesh=mesh,
                                                                axis_name="tp"))
  out = f(x, *placed)
  assert out.sharding.is_fully_replicated and out.dtype == jnp.float32
  _close(out, x, w_q, w_s, block_size, b)
  # The same quantization; only the float32 sum order over the K slices differs from the unsharded call.
  unsharded = np.asarray(linear.w8a8_block_fp8_linear(np.asarray(x), w_q, w_s, block_size, b))
  assert ref.relative_error(out, unsharded) <= 1e-6
  eager = linear.row_parallel_linear(np.asarray(x), w_q, w_s, block_size, b, mesh=mesh, axis_name="tp")
  np.testing.assert_array_equal(_bits(eager), _bits(out))
  if axis_type == jax.sharding.AxisType.Explicit:
    with pytest.raises(ValueError, match=r"x is sharded over the Explicit mesh axes \('tp',\)"):
      linear.w8a8_block_fp8_linear(x, w_q, w_s, block_size, b)


@needs_8
def test_megatron_mlp_column_then_row(rng):
  # gate_up column-parallel (outputs stay N-sharded), SiLU-and-mul per shard, down row-parallel (K-sharded input).
  mesh = _mesh((2, 4), ("data", "tp"))
  hidden, inter = 256, 4 * 128
  up_q, up_s = _weight(rng, inter, hidden)
  down_q, down_s = _weight(rng, hidden, inter)
  up = linear.shard_linear_weights(up_q, up_s, mesh=mesh, axis_name="tp", parallel="column")
  down = linear.shard_linear_weights(down_q, down_s, mesh=mesh, axis_name="tp", parallel="row")

  @jax.jit
  def mlp(x, up_q, up_s, down_q, down_s):
    h = linear.column_parallel_linear(x, up_q, up_s, (128, 128), mesh=mesh, axis_name="tp")
    h = jax.nn.relu(h)
    return linear.row_parallel_linear(h, down_q, down_s, (128, 128), mesh=mesh, axis_name="tp")

  x = _x(rng, (6, hidden))
  out = mlp(x, *up[:2], *down[:2])
  h = jax.nn.relu(linear.w8a8_block_fp8_linear(x, up_q, up_s, (128, 128)))
  _close(out, h, down_q, down_s, (128, 128))
  assert ref.relative_error(out, linear.w8a8_block_fp8_linear(h, down_q, down_s, (128, 128))) <= 5e-3


@needs_8
def test_triton_interpret_under_shard_map(rng):
  mesh = _mesh()
  block_size = (32, 32)
  # An explicit config: inside shard_map on CPU the abstract device has no SM count for the GEMM's heuristic
  # (_platform.num_sms() returns None there; see the helper report).
  config = gemm.TritonGemmConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=2)
  w_q, w_s = _weight(rng, DEVICES * 32, 64, block_size)
  x = _x(rng, (3, 64))
  out = jax.jit(lambda x: linear.column_parallel_linear(x, w_q, w_s, block_size, mesh=mesh, axis_name="tp",
                                                        implementation="triton", config=config, interpret=True))(x)
  _close(out, x, w_q, w_s, block_size)
  w_q, w_s = _weight(rng, 64, DEVICES * 32, block_size)
  x = _x(rng, (3, DEVICES * 32))
  out = jax.jit(lambda x: linear.row_parallel_linear(x, w_q, w_s, block_size, mesh=mesh, axis_name="tp",
                                                     implementation="triton", config=config, interpret=True))(x)
  _close(out, x, w_q, w_s, block_size)


@needs_8
def test_eager_sharded_calls_use_the_bucket_cache(rng):
  linear.cache_clear()
  mesh = _mesh()
  w_q, w_s = _weight(rng, DEVICES * 128, 256)
  placed = linear.shard_linear_weights(w_q, w_s, mesh=mesh, axis_name="tp", parallel="column")
  x_host = np.asarray(_x(rng, (20, 256), jnp.float32))
  for m in (3, 4, 11, 16, 20):
    out = linear.column_parallel_linear(x_host[:m], *placed[:2], (128, 128), mesh=mesh, axis_name="tp")
    assert out.shape == (m, DEVICES * 128)
    _close(out, x_host[:m], w_q, w_s, (128, 128))
  info = linear.cache_info()
  assert (info.misses, info.hits, info.buckets) == (3, 2, (4, 16, 32)), info


@needs_8
def test_nnx_layer_with_parallel(rng):
  nnx = pytest.importorskip("flax.nnx")
  from jaxfp8.nn import Fp8Linear
  mesh = _mesh()
  dense = nnx.Linear(256, DEVICES * 128, rngs=nnx.Rngs(0))
  column = Fp8Linear.from_linear(dense, parallel="column", mesh=mesh, axis_name="tp")
  plain = Fp8Linear.from_linear(dense)
  x = _x(rng, (4, 256))
  out = nnx.jit(lambda m, x: m(x))(column, x)
  np.testing.assert_array_equal(_bits(out), _bits(plain(x)))
  row = Fp8Linear.from_linear(nnx.Linear(DEVICES * 128, 64, rngs=nnx.Rngs(1)), parallel="row", mesh=mesh,
                              axis_name="tp")
  out = nnx.jit(lambda m, x: m(x))(row, jax.nn.relu(out))
  assert out.shape == (4, 64) and out.sharding.is_fully_replicated


@needs_8
def test_indivisible_splits_are_refused(rng):
  mesh = _mesh()
  w_q, w_s = _weight(rng, 576, 256)  # 576 / 8 = 72 rows per device: not whole 128-row scale blocks
  with pytest.raises(ValueError, match=r"each share must be whole weight-scale blocks .* N / 8 = 72"):
    linear.column_parallel_linear(_x(rng, (2, 256)), w_q, w_s, (128, 128), mesh=mesh, axis_name="tp")
  w_q, w_s = _weight(rng, 64, 512)  # 512 / 8 = 64 columns: not whole 128-wide groups
  with pytest.raises(ValueError, match=r"each share must be whole scale groups .* K / 8 = 64"):
    linear.row_parallel_linear(_x(rng, (2, 512)), w_q, w_s, (128, 128), mesh=mesh, axis_name="tp")
  with pytest.raises(ValueError, match="axis_name 'model' is not an axis of the mesh"):
    linear.row_parallel_linear(_x(rng, (2, 512)), w_q, w_s, (128, 128), mesh=mesh, axis_name="model")
