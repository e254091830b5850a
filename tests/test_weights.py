"""jaxfp8.weights and jaxfp8.checkpoints (docs/CONTRACT.md §4): blockwise weight quantization against the reference,
its inverse, and Hugging Face FP8 checkpoints in safetensors files that the tests write themselves."""

from __future__ import annotations

import dataclasses
import json
import os
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxfp8 import checkpoints, linear, weights
from jaxfp8 import reference as ref



@pytest.fixture
def safetensors_numpy():
  """The safetensors NumPy API (the checkpoint tests skip where the optional extra is not installed)."""
  return pytest.importorskip("safetensors.numpy")


def random_weight(rng, n, k, dtype=np.float32, block_size=(128, 128)) -> np.ndarray:
  """Normal values whose blocks span several octaves (so block scales differ), never all zeros."""
  gn, gk = block_size
  w = rng.standard_normal((n, k)).astype(np.float32)
  factors = np.exp2(rng.integers(-8, 8, (ref.ceil_div(n, gn), ref.ceil_div(k, gk))))
  w *= np.repeat(np.repeat(factors, gn, 0), gk, 1)[:n, :k].astype(np.float32)
  return w.astype(dtype)


def assert_matches_reference(w, block_size, w_q, w_s):
  ref_q, ref_s = ref.quantize_weight_blockwise(w, block_size)
  w_q, w_s = np.asarray(w_q), np.asarray(w_s)
  assert w_q.dtype == ref.FP8 and w_q.shape == ref_q.shape
  assert w_s.dtype == np.float32 and w_s.shape == ref_s.shape
  same_nan = np.isnan(w_s) & np.isnan(ref_s)
  assert ((w_s.view(np.uint32) == ref_s.view(np.uint32)) | same_nan).all(), "scales must be bit-exact"
  dist = ref.fp8_code_distance(w_q, ref_q)
  assert dist.max(initial=0) <= 1, f"codes differ by up to {dist.max()} fp8 steps"
  assert np.count_nonzero(dist) <= math.ceil(1e-4 * dist.size), f"{np.count_nonzero(dist)} codes off by one step"


@pytest.mark.parametrize("n, k, block_size, dtype", [
    (200, 300, (128, 128), np.float32),       # partial edge blocks in both dimensions
    (256, 384, (128, 128), ml_dtypes.bfloat16),
    (130, 96, (64, 64), np.float16),
    (64, 200, (128, 64), np.float32),         # one partial row block only
    (1, 1, (128, 128), np.float32),
    (576, 7168, (128, 128), ml_dtypes.bfloat16),  # DeepSeek-V3 kv_a_proj_with_mqa: N = 4.5 blocks
])
def test_quantize_matches_reference(rng, n, k, block_size, dtype):
  w = random_weight(rng, n, k, dtype, block_size)
  w_q, w_s = weights.quantize_weight_blockwise(w, block_size)
  assert_matches_reference(w, block_size, w_q, w_s)


def test_edge_blocks_use_only_their_valid_elements(rng):
  # The partial last blocks hold tiny values: a scale computed over anything but those would be far off.
  w = random_weight(rng, 200, 300)
  w[128:, :] *= 1e-6
  w[:, 256:] *= 1e-6
  w_q, w_s = weights.quantize_weight_blockwise(w)
  assert_matches_reference(w, (128, 128), w_q, w_s)
  assert np.asarray(w_s)[1, 2] < 1e-6 * np.asarray(w_s)[0, 0]


def test_nan_makes_its_block_nan_and_zeros_use_eps(rng):
  w = random_weight(rng, 200, 300)
  w[5, 260] = np.nan        # block (0, 2)
  w[128:, :128] = 0.0       # block (1, 0): all zeros -> scale eps * R, codes 0
  w_q, w_s = weights.quantize_weight_blockwise(w)
  assert_matches_reference(w, (128, 128), w_q, w_s)
  w_s = np.asarray(w_s)
  assert np.isnan(w_s[0, 2]) and np.isnan(np.asarray(w_q).astype(np.float32)[:128, 256:]).all()
  assert w_s[1, 0] == np.float32(1e-10) * ref.R and not np.asarray(w_q).astype(np.float32)[128:, :128].any()
  assert np.isfinite(np.delete(w_s.ravel(), 2)).all()


def test_dequantize_is_the_inverse(rng):
  w = random_weight(rng, 200, 300)
  w_q, w_s = weights.quantize_weight_blockwise(w, (64, 128))
  back = np.asarray(weights.dequantize_weight_blockwise(w_q, w_s, (64, 128)))
  # q * s of an fp8 code and a float32 scale is one float32 rounding of the exact product.
  np.testing.assert_array_equal(back, ref.dequantize_weight_blockwise(w_q, w_s, (64, 128)).astype(np.float32))
  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in the normal range of their block.
  big = np.abs(w) > np.repeat(np.repeat(np.asarray(w_s), 64, 0), 128, 1)[:200, :300] * 2.0**-6
  assert (np.abs(back - w)[big] <= 2.0**-4 * np.abs(w)[big]).all()
  bf16 = weights.dequantize_weight_blockwise(w_q, w_s, (64, 128), dtype=jnp.bfloat16)
  assert bf16.dtype == jnp.bfloat16 and bf16.shape == (200, 300)


def test_weight_validation():
  with pytest.raises(TypeError, match="w must be bfloat16, float16 or float32, got dtype int32"):
    weights.quantize_weight_blockwise(np.ones((4, 4), np.int32))
  with pytest.raises(ValueError, match=r"w must be 2-D \(N, K\)"):
    weights.quantize_weight_blockwise(np.ones((4,), np.float32))
  with pytest.raises(ValueError, match="gk=0"):
    weights.quantize_weight_blockwise(np.ones((4, 4), np.float32), (128, 0))
  with pytest.raises(ValueError, match="eps must be a positive finite number"):
    weights.quantize_weight_blockwise(np.ones((4, 4), np.float32), eps=0.0)
  with pytest.raises(ValueError, match=r"w_s must have shape \(ceil\(N/gn\), ceil\(K/gk\)\) = \(2, 3\)"):
    weights.dequantize_weight_blockwise(np.ones((200, 300), ref.FP8), np.ones((2, 2), np.float32))


def test_fp8_linear_weight_is_a_pytree(rng):
  weight = weights.fp8_linear_weight(random_weight(rng, 200, 256), np.ones(200, np.float32), (128, 128))
  leaves, treedef = jax.tree.flatten(weight)
  assert len(leaves) == 3 and weight.shape == (200, 256)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  f = jax.jit(lambda x, w: linear.w8a8_block_fp8_linear(x, w.w_q, w.w_s, w.block_size, w.bias))
  out = f(x, weight)
  expect = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), weight.w_q, weight.w_s, (128, 128),
                                                     bias=np.ones(200, np.float32)), jnp.bfloat16)
  assert ref.relative_error(out, expect) <= 5e-3
  assert jax.tree.unflatten(treedef, leaves).block_size == (128, 128)


# ---- Hugging Face FP8 checkpoints ------------------------------------------------------------------------------------

def test_checkpoint_functions_are_importable_from_weights():
  import jaxfp8
  from jaxfp8.weights import checkpoint_files, load_hf_fp8_linears, read_block_size, save_hf_fp8_linears
  assert load_hf_fp8_linears is checkpoints.load_hf_fp8_linears is jaxfp8.load_hf_fp8_linears
  assert save_hf_fp8_linears is checkpoints.save_hf_fp8_linears is jaxfp8.save_hf_fp8_linears
  assert checkpoint_files is checkpoints.checkpoint_files and read_block_size is checkpoints.read_block_size
  with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
    weights.nothing  # noqa: B018



def _hf_layer(rng, n, k, block_size=(128, 128), bias_dtype=None):
  q, s = ref.quantize_weight_blockwise(random_weight(rng, n, k, block_size=block_size), block_size)
  bias = None if bias_dtype is None else rng.standard_normal(n).astype(bias_dtype)
  return q, s, bias


def _write_checkpoint(safetensors_numpy, rng, directory, block_size=(128, 128)):
  """A two-file checkpoint in the DeepSeek-V3 layout: fp8 linears (one with its scales in the other file, one with a
  bf16 bias), a bf16 norm and a bf16 (unquantized) linear, an index and a config.json."""
  layers = {
      "model.layers.0.self_attn.q_a_proj": _hf_layer(rng, 200, 256, block_size),
      "model.layers.0.mlp.down_proj": _hf_layer(rng, 256, 384, block_size, bias_dtype=ml_dtypes.bfloat16),
      "model.layers.1.self_attn.o_proj": _hf_layer(rng, 130, 128, block_size),
  }
  first, second = {}, {}
  for i, (prefix, (q, s, b)) in enumerate(layers.items()):
    first[prefix + ".weight"] = q
    (second if i == 2 else first)[prefix + ".weight_scale_inv"] = s  # scales of layer 2 live in the other file
    if b is not None:
      first[prefix + ".bias"] = b
  first["model.layers.0.input_layernorm.weight"] = np.ones(256, ml_dtypes.bfloat16)
  second["lm_head.weight"] = rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16)
  safetensors_numpy.save_file(first, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
  safetensors_numpy.save_file(second, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
  weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
  weight_map.update({name: "model-00002-of-00002.safetensors" for name in second})
  (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (directory / "config.json").write_text(json.dumps({"quantization_config": {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block_size)}}))
  return layers


@pytest.mark.parametrize("block_size", [(128, 128), (64, 64)])
def test_load_hf_checkpoint_directory(safetensors_numpy, rng, tmp_path, block_size):
  layers = _write_checkpoint(safetensors_numpy, rng, tmp_path, block_size)
  loaded = weights.load_hf_fp8_linears(tmp_path)  # block size from config.json
  assert list(loaded) == sorted(layers)
  for prefix, (q, s, b) in layers.items():
    weight = loaded[prefix]
    assert isinstance(weight.w_q, jax.Array) and weight.block_size == block_size
    np.testing.assert_array_equal(np.asarray(weight.w_q).view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(weight.w_s), s)
    assert (weight.bias is None) == (b is None)
    if b is not None:
      assert weight.bias.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(weight.bias).view(np.uint16), b.view(np.uint16))
  # The loaded weights drive the linear.
  weight = loaded["model.layers.0.mlp.down_proj"]
  x = jnp.asarray(rng.standard_normal((3, 384)), jnp.float32)
  out = linear.w8a8_block_fp8_linear(x, weight.w_q, weight.w_s, weight.block_size, weight.bias)
  q, s, b = layers["model.layers.0.mlp.down_proj"]
  expect = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), q, s, block_size, bias=b.astype(np.float32)),
                           np.float32)
  assert ref.relative_error(out, expect) <= 2e-4


def test_load_files_select_numpy_and_placement(safetensors_numpy, rng, tmp_path):
  layers = _write_checkpoint(safetensors_numpy, rng, tmp_path)
  files = weights.checkpoint_files(tmp_path)
  assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  only = weights.load_hf_fp8_linears(files, select=lambda p: "self_attn" in p, as_numpy=True)
  assert list(only) == ["model.layers.0.self_attn.q_a_proj", "model.layers.1.self_attn.o_proj"]
  assert all(isinstance(w.w_q, np.ndarray) and w.w_q.dtype == ref.FP8 for w in only.values())
  one = weights.load_hf_fp8_linears(files[0], select=["model.layers.0.mlp.down_proj"])
  assert list(one) == ["model.layers.0.mlp.down_proj"]
  device = jax.devices()[0]
  placed = weights.load_hf_fp8_linears(
      tmp_path, select=["model.layers.0.self_attn.q_a_proj"], sharding=lambda prefix, field, shape: device)
  assert placed["model.layers.0.self_attn.q_a_proj"].w_q.devices() == {device}
  # A single file of a sharded checkpoint may lack a layer's scales.
  with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj.weight' is float8_e4m3fn but has no "
                                       r"'model.layers.1.self_attn.o_proj.weight_scale_inv'"):
    weights.load_hf_fp8_linears(files[0])
  del layers


def test_load_errors(safetensors_numpy, rng, tmp_path):
  q, s, _ = _hf_layer(rng, 200, 256)
  path = tmp_path / "one.safetensors"
  safetensors_numpy.save_file({"a.weight": q, "a.weight_scale_inv": s}, str(path))
  with pytest.raises(ValueError, match=r"'a.weight_scale_inv' must have shape .* = \(4, 4\).*pass the checkpoint's"):
    weights.load_hf_fp8_linears(path, block_size=(64, 64))
  per_tensor = tmp_path / "per_tensor.safetensors"
  safetensors_numpy.save_file({"a.weight": q, "a.weight_scale": np.ones((), np.float32)}, str(per_tensor))
  with pytest.raises(ValueError, match="Only the blockwise Hugging Face FP8 convention"):
    weights.load_hf_fp8_linears(per_tensor)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    weights.load_hf_fp8_linears(tmp_path / "missing.safetensors")
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
    weights.load_hf_fp8_linears(empty)


def test_save_and_load_round_trip(safetensors_numpy, rng, tmp_path):
  block_size = (128, 64)
  saved = {
      "layer.a": weights.fp8_linear_weight(random_weight(rng, 200, 192), rng.standard_normal(200).astype(np.float32),
                                           block_size),
      "layer.b": weights.fp8_linear_weight(random_weight(rng, 64, 64), None, block_size),
  }
  path = tmp_path / "model.safetensors"
  weights.save_hf_fp8_linears(path, saved, extra={"norm.weight": np.ones(8, np.float32)})
  loaded = weights.load_hf_fp8_linears(path, block_size=block_size)
  assert list(loaded) == sorted(saved)
  for prefix, weight in saved.items():
    for field in ("w_q", "w_s", "bias"):
      a, b = getattr(weight, field), getattr(loaded[prefix], field)
      if a is None:
        assert b is None
      else:
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  with pytest.raises(ValueError, match="collides"):
    weights.save_hf_fp8_linears(path, saved, extra={"layer.a.weight": np.ones(2)})


def test_file_replaced_with_its_mtime_kept_is_read_afresh(safetensors_numpy, rng, tmp_path):
  # `cp -p`, `rsync -t` and tar keep a file's mtime: a replaced file must not be read with the old file's offsets.
  path = tmp_path / "model.safetensors"
  old_q, old_s, _ = _hf_layer(rng, 128, 256)
  safetensors_numpy.save_file({"a.weight": old_q, "a.weight_scale_inv": old_s}, str(path), metadata={"format": "pt"})
  first = checkpoints.load_hf_fp8_linears(path, as_numpy=True)
  np.testing.assert_array_equal(first["a"].w_q.view(np.uint8), old_q.view(np.uint8))
  stat = path.stat()
  new_q, new_s, _ = _hf_layer(rng, 128, 256)
  # A longer header and one more fp8 tensor ahead of a.weight: every offset moves.
  safetensors_numpy.save_file({"a.weight": new_q, "a.weight_scale_inv": new_s, "0.codes": new_q[:1]}, str(path),
                              metadata={"format": "pt", "note": "x" * 100})
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert path.stat().st_mtime_ns == stat.st_mtime_ns
  again = checkpoints.load_hf_fp8_linears(path, as_numpy=True)
  np.testing.assert_array_equal(again["a"].w_q.view(np.uint8), new_q.view(np.uint8))
  np.testing.assert_array_equal(again["a"].w_s, new_s)


@pytest.mark.parametrize("dtype, name", [(ml_dtypes.float8_e5m2, "F8_E5M2"), (np.uint8, "U8"),
                                         (ml_dtypes.bfloat16, "BF16")])
def test_a_weight_with_block_scales_must_be_e4m3(safetensors_numpy, rng, tmp_path, dtype, name):
  # A weight_scale_inv promises a block-FP8 e4m3 weight (docs/CONTRACT.md §4): any other type is refused, not skipped.
  q, s, _ = _hf_layer(rng, 128, 256)
  path = tmp_path / "model.safetensors"
  safetensors_numpy.save_file({"ok.weight": q, "ok.weight_scale_inv": s,
                               "bad.weight": q.astype(np.float32).astype(dtype), "bad.weight_scale_inv": s}, str(path))
  with pytest.raises(ValueError, match=rf"'bad.weight' has dtype {name} .*'bad.weight_scale_inv'.*float8_e4m3fn"):
    checkpoints.load_hf_fp8_linears(path)
  # A layer left out by select is not read, so it cannot be refused.
  assert list(checkpoints.load_hf_fp8_linears(path, select=["ok"])) == ["ok"]


def test_block_scales_without_their_weight_are_refused(safetensors_numpy, rng, tmp_path):
  q, s, _ = _hf_layer(rng, 128, 256)
  path = tmp_path / "model.safetensors"
  safetensors_numpy.save_file({"a.weight": q, "a.weight_scale_inv": s, "b.weight_scale_inv": s}, str(path))
  with pytest.raises(ValueError, match=r"'b.weight_scale_inv' has no weight 'b.weight'"):
    checkpoints.load_hf_fp8_linears(path)


@pytest.mark.parametrize("block", [[128], "128", [0, 128], [128.5, 128], [True, 128], [128, 128, 128], {"gn": 128}])
def test_malformed_block_size_in_config_names_the_file(safetensors_numpy, rng, tmp_path, block):
  q, s, _ = _hf_layer(rng, 128, 256)
  safetensors_numpy.save_file({"a.weight": q, "a.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
  config = tmp_path / "config.json"
  config.write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}))
  message = rf"{config}.*weight_block_size.*{re.escape(repr(block))}"
  with pytest.raises(ValueError, match=message):
    checkpoints.read_block_size(tmp_path)
  with pytest.raises(ValueError, match=message):
    checkpoints.load_hf_fp8_linears(tmp_path)
  # An explicit block_size does not need the config's.
  assert list(checkpoints.load_hf_fp8_linears(tmp_path, block_size=(128, 128))) == ["a"]


@pytest.mark.parametrize("text, message", [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object"),
                                           ('{"quantization_config": 3}', "quantization_config must be a JSON object")])
def test_malformed_config_names_the_file(tmp_path, text, message):
  config = tmp_path / "config.json"
  config.write_text(text)
  with pytest.raises(ValueError, match=rf"{config}.*{message}"):
    checkpoints.read_block_size(tmp_path)


def test_save_refuses_a_bias_or_scales_the_loader_would_refuse(safetensors_numpy, rng, tmp_path):
  path = tmp_path / "model.safetensors"
  good = weights.fp8_linear_weight(random_weight(rng, 200, 256), np.ones(200, np.float32))
  cases = [
      (dataclasses.replace(good, bias=np.ones(256, np.float32)), ValueError,
       r"weights\['layer.a'\].bias must have shape \(N,\) = \(200,\) for its \(200, 256\) weight, got \(256,\)"),
      (dataclasses.replace(good, bias=np.ones((1, 200), np.float32)), ValueError, r"got \(1, 200\)"),
      (dataclasses.replace(good, w_s=np.asarray(good.w_s, np.float64)), TypeError,
       r"weights\['layer.a'\].w_s must have dtype float32, got float64"),
      (dataclasses.replace(good, w_s=jnp.asarray(good.w_s, jnp.bfloat16)), TypeError,
       r"weights\['layer.a'\].w_s must have dtype float32, got bfloat16"),
      (dataclasses.replace(good, bias=np.ones(200, np.int32)), TypeError,
       r"weights\['layer.a'\].bias must have dtype bfloat16 or float16 or float32, got int32"),
      (dataclasses.replace(good, w_q=np.asarray(good.w_q)[None]), ValueError, r"weights\['layer.a'\].w_q must be 2-D"),
  ]
  for weight, error, message in cases:
    with pytest.raises(error, match=message):
      checkpoints.save_hf_fp8_linears(path, {"layer.b": good, "layer.a": weight})
    assert not path.exists()  # nothing is written
  with pytest.raises(TypeError, match=r"weights\['layer.a'\] must be an Fp8LinearWeight, got tuple"):
    checkpoints.save_hf_fp8_linears(path, {"layer.a": (good.w_q, good.w_s)})
  checkpoints.save_hf_fp8_linears(path, {"layer.a": good})
  assert list(checkpoints.load_hf_fp8_linears(path)) == ["layer.a"]


def _quantization_config(block_size):
  return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block_size)}


@pytest.mark.parametrize("into_directory", [False, True])
def test_save_writes_the_config_the_loader_reads_back(safetensors_numpy, rng, tmp_path, into_directory):
  block_size = (128, 64)
  saved = {"a": weights.fp8_linear_weight(random_weight(rng, 200, 192), None, block_size),
           "b": weights.fp8_linear_weight(random_weight(rng, 64, 128), np.ones(64, np.float32), block_size)}
  checkpoints.save_hf_fp8_linears(tmp_path if into_directory else tmp_path / "model.safetensors", saved)
  assert (tmp_path / "model.safetensors").is_file()
  config = json.loads((tmp_path / "config.json").read_text())
  assert config == {"quantization_config": _quantization_config(block_size)}
  assert checkpoints.read_block_size(tmp_path) == block_size
  # No block_size given: the loader takes it from config.json (the default (128, 128) would not fit the scales).
  for source in (tmp_path, tmp_path / "model.safetensors"):
    loaded = checkpoints.load_hf_fp8_linears(source, as_numpy=True)
    assert list(loaded) == ["a", "b"] and all(w.block_size == block_size for w in loaded.values())
    np.testing.assert_array_equal(loaded["a"].w_s, np.asarray(saved["a"].w_s))


def test_save_merges_an_existing_config(safetensors_numpy, rng, tmp_path):
  existing = {"model_type": "deepseek_v3", "hidden_size": 7168,
              "quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}}
  (tmp_path / "config.json").write_text(json.dumps(existing))
  saved = {"a": weights.fp8_linear_weight(random_weight(rng, 128, 128))}
  checkpoints.save_hf_fp8_linears(tmp_path / "model.safetensors", saved)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config == {"model_type": "deepseek_v3", "hidden_size": 7168,
                    "quantization_config": {**_quantization_config((128, 128)), "modules_to_not_convert": ["lm_head"]}}
  # A config that says another block size describes other files of this directory: refused, nothing written.
  other = {"a": weights.fp8_linear_weight(random_weight(rng, 128, 128), None, (64, 64))}
  with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}.*weight_block_size = \[128, 128\].*\[64, 64\]"):
    checkpoints.save_hf_fp8_linears(tmp_path / "other.safetensors", other)
  assert not (tmp_path / "other.safetensors").exists()
  assert json.loads((tmp_path / "config.json").read_text()) == config
  checkpoints.save_hf_fp8_linears(tmp_path / "other.safetensors", other, config=False)  # the caller's choice
  assert json.loads((tmp_path / "config.json").read_text()) == config


def test_save_refuses_mixed_block_sizes(safetensors_numpy, rng, tmp_path):
  mixed = {"a": weights.fp8_linear_weight(random_weight(rng, 128, 128), None, (128, 128)),
           "b": weights.fp8_linear_weight(random_weight(rng, 128, 128), None, (64, 64))}
  with pytest.raises(ValueError,
                     match=r"one block size.*weights\['a'\] has \(128, 128\) and weights\['b'\] has \(64, 64\)"):
    checkpoints.save_hf_fp8_linears(tmp_path / "model.safetensors", mixed)
  assert not list(tmp_path.iterdir())
