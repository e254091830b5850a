"""jaxfp8.nn.Fp8Linear (Flax NNX): conversion from nnx.Linear (its (K, N) kernel), checkpoint tensors, nnx.jit,
quantize_linears over a model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import linear, weights
from jaxfp8 import reference as ref

nnx = pytest.importorskip("flax.nnx")
from jaxfp8.nn import Fp8Linear, Fp8Weight, quantize_linears  # noqa: E402  (after the importorskip)
from jaxfp8.nn import is_router as nn_is_router  # noqa: E402


def _bits(a):
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _x(rng, shape, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape) * 3, dtype)


def _expected(layer: nnx.Linear, x, block_size=(128, 128), out_dtype=None):
  """The reference linear on the reference quantization of the layer's transposed kernel."""
  w_q, w_s = ref.quantize_weight_blockwise(np.asarray(layer.kernel[...]).T, block_size)
  bias = None if layer.bias is None else np.asarray(layer.bias[...])
  return ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), w_q, w_s, block_size, bias=bias),
                         out_dtype or x.dtype)


@pytest.mark.parametrize("in_features, out_features, use_bias, block_size, x_shape", [
    (256, 200, True, (128, 128), (5, 256)),
    (384, 96, False, (64, 128), (2, 3, 384)),
])
def test_from_linear_matches_reference(rng, in_features, out_features, use_bias, block_size, x_shape):
  dense = nnx.Linear(in_features, out_features, use_bias=use_bias, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  if use_bias:
    dense.bias[...] = jnp.asarray(rng.standard_normal(out_features), jnp.float32)
  layer = Fp8Linear.from_linear(dense, block_size=block_size)
  assert layer.w_q[...].shape == (out_features, in_features) and layer.w_q[...].dtype == jnp.float8_e4m3fn
  assert isinstance(layer.w_q, Fp8Weight) and isinstance(layer.w_s, Fp8Weight)
  assert (layer.bias is None) == (not use_bias)
  x = _x(rng, x_shape)
  out = layer(x)
  # bf16 x, float32 parameters: float32 out, as from the nnx.Linear (test_output_dtype_follows_nnx_linear).
  assert out.shape == (*x_shape[:-1], out_features) and out.dtype == dense(x).dtype == jnp.float32
  assert ref.relative_error(out, _expected(dense, x, block_size, jnp.float32)) <= 5e-3
  # FP8 weights and activations: close to the float layer, within FP8's precision.
  assert ref.relative_error(out, dense(x.astype(jnp.float32))) <= 0.1
  # The dequantized kernel is the float kernel up to e4m3 rounding.
  kernel = np.asarray(dense.kernel[...])
  assert ref.relative_error(layer.dequantized_kernel(), kernel) <= 0.05


def test_under_nnx_jit_and_split_merge(rng):
  dense = nnx.Linear(256, 128, rngs=nnx.Rngs(0))
  layer = Fp8Linear.from_linear(dense)
  x = _x(rng, (7, 256))
  eager = layer(x)
  jitted = nnx.jit(lambda m, x: m(x))(layer, x)
  np.testing.assert_array_equal(_bits(jitted), _bits(eager))
  graphdef, state = nnx.split(layer)
  assert set(jax.tree.leaves(jax.tree.map(lambda a: str(a.dtype), state))) == {"float8_e4m3fn", "float32"}
  fp8_state = nnx.state(layer, Fp8Weight)
  assert len(jax.tree.leaves(fp8_state)) == 2 and len(jax.tree.leaves(nnx.state(layer, nnx.Param))) == 1
  merged = nnx.merge(graphdef, state)
  np.testing.assert_array_equal(_bits(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)), _bits(eager))
  np.testing.assert_array_equal(_bits(merged(x)), _bits(eager))
  assert linear.cache_info().misses >= 1  # the eager calls went through the bucket cache; the jitted ones did not


def test_from_weights_and_fp8_weight_round_trip(rng):
  w_q, w_s = ref.quantize_weight_blockwise(rng.standard_normal((200, 256)).astype(np.float32))
  bias = rng.standard_normal(200).astype(np.float32)
  layer = Fp8Linear.from_weights(w_q, w_s, bias, block_size=(128, 128), dtype=jnp.bfloat16)
  assert (layer.in_features, layer.out_features) == (256, 200)
  x = _x(rng, (3, 256), jnp.float32)
  out = layer(x)
  assert out.dtype == jnp.bfloat16  # x is cast to the layer's dtype first
  expect = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x.astype(jnp.bfloat16)), w_q, w_s, (128, 128),
                                                     bias=bias), jnp.bfloat16)
  assert ref.relative_error(out, expect) <= 5e-3
  weight = layer.fp8_weight()
  again = Fp8Linear.from_fp8_weight(weight, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(_bits(again(x)), _bits(out))
  with pytest.raises(ValueError, match=r"w_s must have shape"):
    Fp8Linear.from_weights(w_q, w_s[:1], block_size=(128, 128))
  with pytest.raises(ValueError, match="in_features=200 must be a multiple of block_size"):
    Fp8Linear(200, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs a mesh"):
    Fp8Linear(256, 64, parallel="column")
  with pytest.raises(TypeError, match="must be an nnx.Linear"):
    Fp8Linear.from_linear(layer)


def test_fresh_and_placeholder_layers(rng):
  fresh = Fp8Linear(256, 128, rngs=nnx.Rngs(3))
  assert float(jnp.abs(fresh.w_q[...].astype(jnp.float32)).max()) > 0 and fresh.bias[...].shape == (128,)
  placeholder = Fp8Linear(256, 128, use_bias=False)
  assert placeholder.bias is None and not jnp.any(placeholder(_x(rng, (2, 256))))
  abstract = nnx.eval_shape(lambda: Fp8Linear(7168, 1536, rngs=nnx.Rngs(0)))
  assert abstract.w_q.shape == (1536, 7168) and abstract.w_s.shape == (12, 56)


class _Mlp(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(256, 384, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(384, 384, rngs=rngs), nnx.Linear(384, 256, use_bias=False, rngs=rngs)])
    self.router = nnx.Linear(256, 8, rngs=rngs)  # in_features 256, but a router: the default predicate skips it
    self.odd = nnx.Linear(100, 4, rngs=rngs)     # 100 % 128 != 0: stays float

  def __call__(self, x):
    h = jax.nn.silu(self.up(x))
    for block in self.blocks:
      h = block(h)
    return self.router(h), self.odd(x[..., :100])


def test_quantize_linears_replaces_layers_in_place(rng):
  model = _Mlp(nnx.Rngs(0))
  x = _x(rng, (4, 256), jnp.float32)
  float_out = model(x)[0]
  paths = quantize_linears(model, predicate=lambda path, layer: layer.in_features % 128 == 0 and "router" not in path)
  assert sorted(paths) == [("blocks", 0), ("blocks", 1), ("up",)]
  assert isinstance(model.up, Fp8Linear) and isinstance(model.blocks[1], Fp8Linear)
  assert isinstance(model.router, nnx.Linear) and isinstance(model.odd, nnx.Linear)
  fp8_out = nnx.jit(lambda m, x: m(x))(model, x)[0]
  assert ref.relative_error(fp8_out, float_out) <= 0.1
  assert quantize_linears(model) == []  # the default predicate skips `router` (a router) and `odd` (100 wide)
  with pytest.raises(ValueError, match="itself an nnx.Linear"):
    quantize_linears(nnx.Linear(128, 4, rngs=nnx.Rngs(0)))


def test_checkpoint_to_layer(rng, tmp_path):
  pytest.importorskip("safetensors")
  saved = {"mlp.down_proj": weights.fp8_linear_weight(rng.standard_normal((128, 256)).astype(np.float32),
                                                      rng.standard_normal(128).astype(np.float32))}
  weights.save_hf_fp8_linears(tmp_path / "m.safetensors", saved)
  loaded = weights.load_hf_fp8_linears(tmp_path / "m.safetensors")
  layer = Fp8Linear.from_fp8_weight(loaded["mlp.down_proj"])
  x = _x(rng, (2, 256))
  w = saved["mlp.down_proj"]
  expect = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), w.w_q, w.w_s, (128, 128), bias=w.bias),
                           jnp.bfloat16)
  assert ref.relative_error(layer(x), expect) <= 5e-3


def test_a_bias_is_never_dropped(rng):
  w_q, w_s = ref.quantize_weight_blockwise(rng.standard_normal((128, 256)).astype(np.float32))
  bias = rng.standard_normal(128).astype(np.float32)
  weight = weights.Fp8LinearWeight(jnp.asarray(w_q), jnp.asarray(w_s), jnp.asarray(bias))
  message = r"use_bias=False, but the weight has a bias \(shape \(128,\)\)"
  with pytest.raises(ValueError, match=message):
    Fp8Linear(256, 128, use_bias=False, weight=weight)
  with pytest.raises(ValueError, match=message):
    Fp8Linear.from_weights(w_q, w_s, bias, use_bias=False)
  with pytest.raises(ValueError, match=message):
    Fp8Linear.from_fp8_weight(weight, use_bias=False)
  dense = nnx.Linear(256, 128, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    Fp8Linear.from_linear(dense, use_bias=False)
  # use_bias=True without a bias: a zero bias, as a fresh layer's.
  for layer in (Fp8Linear.from_weights(w_q, w_s, use_bias=True),
                Fp8Linear(256, 128, use_bias=True, weight=dataclasses.replace(weight, bias=None)),
                Fp8Linear.from_linear(nnx.Linear(256, 128, use_bias=False, rngs=nnx.Rngs(0)), use_bias=True)):
    assert layer.bias[...].shape == (128,) and not jnp.any(layer.bias[...])
  kept = Fp8Linear(256, 128, weight=weight)
  np.testing.assert_array_equal(np.asarray(kept.bias[...]), bias)


DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@pytest.mark.parametrize("param_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_output_dtype_follows_nnx_linear(rng, x_dtype, param_dtype):
  # nnx.Linear computes in `dtype`, else in the promotion of the input's and the parameters' dtypes; so does the
  # converted layer (bf16 input, float32 parameters -> float32).
  x = _x(rng, (3, 128), x_dtype)
  for dtype in (None, jnp.bfloat16, jnp.float32):
    dense = nnx.Linear(128, 128, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    dense.bias[...] = jnp.asarray(rng.standard_normal(128), param_dtype)
    layer = Fp8Linear.from_linear(dense)
    expected_dtype = dense(x).dtype
    assert expected_dtype == (dtype or jnp.promote_types(x_dtype, param_dtype))
    out = layer(x)
    assert out.dtype == expected_dtype, (dtype, out.dtype, expected_dtype)
    if dtype is None:
      assert jax.eval_shape(lambda x: layer(x), x).dtype == expected_dtype  # traced, as under nnx.jit
    # Computed as nnx.Linear computes: on x rounded to the computation dtype.
    x_c = np.asarray(x.astype(expected_dtype))
    kernel = np.asarray(dense.kernel[...]).astype(np.float32)
    w_q, w_s = ref.quantize_weight_blockwise(kernel.T)
    expect = ref.cast_output(ref.w8a8_block_fp8_linear(x_c, w_q, w_s, (128, 128),
                                                       bias=np.asarray(dense.bias[...]).astype(np.float32)),
                             expected_dtype)
    assert ref.relative_error(out, expect) <= 5e-3
  fresh = Fp8Linear(128, 64, param_dtype=param_dtype, rngs=nnx.Rngs(1))
  assert fresh(x).dtype == jnp.promote_types(x_dtype, param_dtype)


class _Shared(nnx.Module):
  def __init__(self, rngs):
    self.proj = nnx.Linear(128, 128, rngs=rngs)
    self.tied = self.proj                                      # the same layer under a second name
    self.blocks = nnx.List([self.proj, nnx.Linear(128, 128, rngs=rngs)])  # and a third path, in a list
    self.other = nnx.Linear(128, 128, rngs=rngs)


def test_quantize_linears_converts_a_shared_layer_once_at_every_path(rng):
  model = _Shared(nnx.Rngs(0))
  x = _x(rng, (2, 128), jnp.float32)
  before = model.proj(x)
  paths = quantize_linears(model)
  assert sorted(paths) == [("blocks", 0), ("blocks", 1), ("other",), ("proj",), ("tied",)]
  assert isinstance(model.proj, Fp8Linear) and model.tied is model.proj and model.blocks[0] is model.proj
  assert isinstance(model.blocks[1], Fp8Linear) and model.blocks[1] is not model.proj
  assert model.other is not model.proj
  assert ref.relative_error(model.tied(x), before) <= 0.1
  # The sharing survives split/merge: one layer, one set of weights.
  graphdef, state = nnx.split(model)
  assert len(jax.tree.leaves(nnx.state(model, Fp8Weight))) == 2 * 3
  merged = nnx.merge(graphdef, state)
  assert merged.tied is merged.proj


class _MoeMlp(nnx.Module):
  """The names of a Qwen3-MoE / DeepSeek-V3 MoE block: routers as wide as the hidden size, so a multiple of 128."""

  def __init__(self, rngs):
    self.gate = nnx.Linear(256, 8, use_bias=False, rngs=rngs)       # the router (mlp.gate): stays float
    self.gate_proj = nnx.Linear(256, 384, use_bias=False, rngs=rngs)  # an ordinary projection: quantized
    self.up_proj = nnx.Linear(256, 384, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(384, 256, use_bias=False, rngs=rngs)
    self.shared_router = nnx.Linear(256, 8, rngs=rngs)                # any name containing "router": float
    self.routers = nnx.List([nnx.Linear(256, 8, rngs=rngs)])          # named by the list's attribute: float


def test_default_predicate_keeps_routers_in_float():
  model = _MoeMlp(nnx.Rngs(0))
  paths = quantize_linears(model)
  assert sorted(paths) == [("down_proj",), ("gate_proj",), ("up_proj",)]
  assert all(isinstance(getattr(model, name), Fp8Linear) for name in ("gate_proj", "up_proj", "down_proj"))
  assert isinstance(model.gate, nnx.Linear) and isinstance(model.shared_router, nnx.Linear)
  assert isinstance(model.routers[0], nnx.Linear)
  assert nn_is_router(("layers", 3, "mlp", "gate")) and nn_is_router(("moe", "Router")) and nn_is_router(("routers", 0))
  assert not any(nn_is_router(p) for p in [("mlp", "gate_proj"), ("mlp", "gate_up_proj"), ("mlp", "experts", 0), ()])
  # A predicate of the caller's replaces the default rule entirely.
  assert quantize_linears(model, predicate=lambda path, layer: path == ("gate",)) == [("gate",)]
