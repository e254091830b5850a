"""Flax NNX layers (optional extra `jaxfp8[nn]`): `Fp8Linear`, a block-FP8 drop-in for `nnx.Linear` at inference.

    dense = nnx.Linear(7168, 1536, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer = Fp8Linear.from_linear(dense)                                          # quantize a float layer
    layer = Fp8Linear.from_weights(w_q, w_s, bias)                                 # or take checkpoint tensors
    y = layer(x)                                   # x (..., 7168) bf16 -> (..., 1536) bf16, eager or under nnx.jit
    quantize_linears(model)                        # every nnx.Linear of a model, in place

The output dtype follows nnx.Linear's rule: `dtype` if set, else the promotion of x's dtype and `param_dtype` (so
bf16 activations with a float32 param_dtype give float32, as they do from the nnx.Linear; `from_weights`, which has no
float layer to copy, defaults param_dtype to bfloat16, the dtype the FP8 checkpoints' models run in).

The layer holds w_q (N, K) float8_e4m3fn and w_s (ceil(N/gn), ceil(K/gk)) float32 as `Fp8Weight` variables (not
`nnx.Param`: an optimizer over nnx.Param leaves them alone; `nnx.state(model, Fp8Weight)` selects them) and the bias
as an `nnx.Param`. Mind the layouts: `nnx.Linear.kernel` is (K, N) (in, out); the FP8 weight is (N, K), the Hugging
Face `weight` layout, so conversion transposes once. With `parallel="column"` or `"row"` and a mesh, the layer runs
`jaxfp8.linear.column_parallel_linear` / `row_parallel_linear`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - exercised only without the extra
  raise ImportError("jaxfp8.nn needs Flax: pip install 'jaxfp8[nn]' (or pip install flax)") from e

from jaxfp8 import _checks, gemm, linear, weights
from jaxfp8.weights import Fp8LinearWeight

DEFAULT_BLOCK_SIZE = weights.DEFAULT_BLOCK_SIZE


def _check_weight(weight, shape: tuple[int, int], block_size: tuple[int, int], use_bias: bool) -> None:
  """`weight` fits a layer of `shape` (N, K) and `block_size`, and `use_bias` keeps its bias."""
  if not isinstance(weight, Fp8LinearWeight):
    raise TypeError(f"weight must be an Fp8LinearWeight, got {type(weight).__name__}")
  if weight.shape != shape or tuple(weight.block_size) != block_size:
    raise ValueError(f"weight has shape {weight.shape} and block_size {weight.block_size}; the layer needs "
                     f"{shape} and {block_size}")
  _checks.array("weight.w_q", weight.w_q, (gemm.FP8,))
  _checks.array("weight.w_s", weight.w_s, (jnp.dtype(jnp.float32),))
  weights._check_scale_shape(shape, tuple(weight.w_s.shape), block_size, "weight.w_s")
  if weight.bias is None:
    return
  if not use_bias:
    raise ValueError(f"use_bias=False, but the weight has a bias (shape {tuple(weight.bias.shape)}): pass "
                     "use_bias=True to keep it, or a weight without a bias")
  _checks.array("weight.bias", weight.bias, _checks.FLOAT_DTYPES, ndim=None)
  if tuple(weight.bias.shape) != (shape[0],):
    raise ValueError(f"weight.bias must have shape (N,) = ({shape[0]},), got {tuple(weight.bias.shape)}")


class Fp8Weight(nnx.Variable):
  """Block-FP8 weight codes or scales: frozen at inference, so not an `nnx.Param`."""


class Fp8Linear(nnx.Module):
  """y = x @ dequantize(w_q, w_s)^T + bias with FP8 activations (quantized per call) and block-FP8 weights.

  Args:
    in_features, out_features: K and N; K must be a multiple of block_size[1] (the activations' group size).
    use_bias: whether the layer has a bias. With `weight`: True keeps its bias, or makes a zero bias if it has none;
      False with a weight that has a bias is refused (a bias is never dropped).
    block_size: (gn, gk) of the weight scales.
    dtype: the computation (and output) dtype, x being cast to it first; None: the promotion of x's dtype and
      param_dtype (`jnp.result_type`), nnx.Linear's rule (bf16 x with float32 parameters gives float32).
    param_dtype: the dtype of the float parameters the layer stands for: of the kernel drawn by kernel_init and the
      bias of a fresh layer, and in the dtype rule above (`from_linear` takes the nnx.Linear's).
    implementation, quant_implementation, interpret, backward: as in `jaxfp8.w8a8_block_fp8_linear` (backward: the
      gradient's mode, docs/CONTRACT.md §6; the FP8 weights themselves are frozen and get no gradient).
    transposed_weight: hold W^T's codes (K, round_up(N, gn)) as well, built once here, which the "fp8" backward
      multiplies by (else it transposes w_q every step). For training through the layer (e.g. a LoRA adapter beside
      it); it costs the weight's codes once more in memory. Not used by the tensor-parallel modes.
    parallel: None, "column" (N split over mesh axis `axis_name`) or "row" (K split, outputs summed).
    mesh, axis_name: the mesh and its tensor-parallel axis, for `parallel`.
    kernel_init, bias_init: initializers of a fresh layer (kernel drawn as (K, N) float, then quantized).
    rngs: random streams for a fresh layer; None makes placeholder weights (zeros, unit scales) to load into.
    weight: an Fp8LinearWeight to hold instead of initializing one (`from_weights` / `from_linear` use it).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool = True,
      block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      implementation: str | None = None,
      quant_implementation: str | None = None,
      interpret: bool | None = None,
      backward: str = "fp8",
      transposed_weight: bool = False,
      parallel: str | None = None,
      mesh: jax.sharding.Mesh | None = None,
      axis_name: str | None = None,
      kernel_init: Callable = nnx.initializers.lecun_normal(),
      bias_init: Callable = nnx.initializers.zeros_init(),
      rngs: nnx.Rngs | None = None,
      weight: Fp8LinearWeight | None = None,
  ):
    gn, gk = _checks.block_size(block_size)
    in_features = _checks.positive_int("in_features", in_features)
    out_features = _checks.positive_int("out_features", out_features)
    # The linear's options check themselves (the one place they are validated).
    linear.planner.LinearOptions(implementation=implementation, quant_implementation=quant_implementation,
                                 interpret=interpret, backward=backward)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if in_features % gk:
      raise ValueError(f"in_features={in_features} must be a multiple of block_size[1]={gk}: activations are "
                       "quantized in groups of gk")
    if parallel not in (None, *linear.PARALLEL_MODES):
      raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
    if parallel is not None and (mesh is None or axis_name is None):
      raise ValueError(f"parallel={parallel!r} needs a mesh and the axis_name to split over")
    self.in_features = in_features
    self.out_features = out_features
    self.block_size = (gn, gk)
    self.dtype = None if dtype is None else _checks.float_dtype("dtype", dtype)
    self.param_dtype = _checks.float_dtype("param_dtype", param_dtype)
    self.implementation = implementation
    self.quant_implementation = quant_implementation
    self.interpret = interpret
    self.backward = backward
    self.parallel = parallel
    self.mesh = mesh
    self.axis_name = axis_name
    scale_shape = (-(-out_features // gn), -(-in_features // gk))
    use_bias = _checks.flag("use_bias", use_bias)
    if weight is not None:
      _check_weight(weight, (out_features, in_features), (gn, gk), use_bias)
      w_q, w_s, bias = weight.w_q, weight.w_s, weight.bias
      if use_bias and bias is None:
        bias = jnp.zeros((out_features,), param_dtype)
    elif rngs is None:
      w_q = jnp.zeros((out_features, in_features), jnp.float8_e4m3fn)
      w_s = jnp.ones(scale_shape, jnp.float32)
      bias = jnp.zeros((out_features,), param_dtype) if use_bias else None
    else:
      kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
      w_q, w_s = weights.quantize_weight_blockwise(kernel.T, (gn, gk))
      bias = bias_init(rngs.params(), (out_features,), param_dtype) if use_bias else None
    self.w_q = Fp8Weight(w_q)
    self.w_s = Fp8Weight(w_s)
    self.bias = nnx.Param(bias) if use_bias else None
    transposed_weight = _checks.flag("transposed_weight", transposed_weight)
    self.w_q_t = Fp8Weight(linear.backward.transposed_codes(jnp.asarray(w_q), (gn, gk))) if transposed_weight else None

  @classmethod
  def from_weights(cls, w_q, w_s, bias=None, *, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
                   **options) -> Fp8Linear:
    """A layer holding checkpoint tensors: w_q (N, K) e4m3fn (`weight`), w_s float32 (`weight_scale_inv`), and an
    optional (N,) bias of any float dtype (kept in float32). `use_bias` defaults to whether a bias is given.

    `param_dtype` defaults to bfloat16 here, the dtype the FP8 checkpoints' models (DeepSeek-V3, Qwen3-FP8) run in:
    bf16 activations give bf16 outputs, as the bf16 `nnx.Linear` of such a model would; pass param_dtype=float32 for
    the float32 promotion of an `nnx.Linear` with float32 parameters."""
    _checks.array("w_q", w_q, (gemm.FP8,))
    _checks.array("w_s", w_s, (jnp.dtype(jnp.float32),))
    weights._check_scale_shape(tuple(w_q.shape), tuple(w_s.shape), _checks.block_size(block_size), "w_s")
    # The bias is kept in float32, the precision the GEMM adds it in: a bf16 bias would cost a convert kernel per call.
    bias = None if bias is None else jnp.asarray(bias).astype(jnp.float32)
    if bias is not None and tuple(bias.shape) != (w_q.shape[0],):
      raise ValueError(f"bias must have shape (N,) = ({w_q.shape[0]},), got {tuple(bias.shape)}")
    weight = Fp8LinearWeight(jnp.asarray(w_q), jnp.asarray(w_s), bias, tuple(block_size))
    n, k = w_q.shape
    # use_bias=True without a bias gives a zero bias; use_bias=False with one is refused (the constructor says so).
    use_bias = options.pop("use_bias", bias is not None)
    options.setdefault("param_dtype", jnp.bfloat16)
    return cls(k, n, use_bias=use_bias, block_size=block_size, weight=weight, **options)

  @classmethod
  def from_fp8_weight(cls, weight: Fp8LinearWeight, **options) -> Fp8Linear:
    """A layer holding an `Fp8LinearWeight` (e.g. from `jaxfp8.weights.load_hf_fp8_linears`)."""
    return cls.from_weights(weight.w_q, weight.w_s, weight.bias, block_size=weight.block_size, **options)

  @classmethod
  def from_linear(cls, layer: nnx.Linear, *, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
                  **options) -> Fp8Linear:
    """Quantizes an `nnx.Linear`: its (K, N) kernel becomes the (N, K) w_q and its block scales; the bias is kept.
    The new layer keeps the old one's `dtype` and, as param_dtype, the promotion of its kernel's and bias' dtypes
    (what nnx.Linear computes in when dtype is None), unless they are given."""
    if not isinstance(layer, nnx.Linear):
      raise TypeError(f"layer must be an nnx.Linear, got {type(layer).__name__}")
    kernel = layer.kernel[...]
    w_q, w_s = weights.quantize_weight_blockwise(kernel.T, block_size)
    bias = None if layer.bias is None else layer.bias[...]
    options.setdefault("dtype", layer.dtype)
    options.setdefault("param_dtype", jnp.result_type(*(a.dtype for a in (kernel, bias) if a is not None)))
    return cls.from_weights(w_q, w_s, bias, block_size=block_size, **options)

  def fp8_weight(self) -> Fp8LinearWeight:
    """The layer's weight as an `Fp8LinearWeight` (for saving with `jaxfp8.weights.save_hf_fp8_linears`)."""
    bias = None if self.bias is None else self.bias[...]
    return Fp8LinearWeight(self.w_q[...], self.w_s[...], bias, self.block_size)

  def dequantized_kernel(self, dtype=jnp.float32) -> jax.Array:
    """The (K, N) float kernel nnx.Linear would hold: dequantize(w_q, w_s)^T."""
    return weights.dequantize_weight_blockwise(self.w_q[...], self.w_s[...], self.block_size, dtype=dtype).T

  def __call__(self, x: jax.Array, *, valid_rows: jax.Array | int | None = None) -> jax.Array:
    """y = x W^T (+ bias) through the FP8 linear; valid_rows: the live rows of x (`w8a8_block_fp8_linear`'s), for
    the unsharded layer."""
    if not hasattr(x, "dtype"):
      x = jnp.asarray(x)
    # nnx.Linear's rule (flax.nnx.nn.dtypes.promote_dtype): compute in `dtype`, else in the promotion of the input's
    # and the parameters' dtypes.
    dtype = self.dtype if self.dtype is not None else jnp.result_type(x.dtype, self.param_dtype)
    if jnp.dtype(x.dtype) not in _checks.FLOAT_DTYPES or jnp.promote_types(x.dtype, dtype) != dtype:
      x = x.astype(dtype)  # a narrowing cast rounds x, as nnx.Linear's does
    # Else x widens to dtype exactly and is left as it is: quantization reads float32(x) either way (§1 of
    # docs/CONTRACT.md), so only the output dtype changes.
    args = (x, self.w_q[...], self.w_s[...], self.block_size, None if self.bias is None else self.bias[...])
    options = dict(out_dtype=dtype, implementation=self.implementation,
                   quant_implementation=self.quant_implementation, interpret=self.interpret, backward=self.backward)
    if valid_rows is not None and self.parallel is not None:
      raise ValueError(f"valid_rows is not supported by the {self.parallel}-parallel layer (got valid_rows="
                       f"{valid_rows!r}): call it with all rows")
    if self.parallel == "column":
      return linear.column_parallel_linear(*args, mesh=self.mesh, axis_name=self.axis_name, **options)
    if self.parallel == "row":
      return linear.row_parallel_linear(*args, mesh=self.mesh, axis_name=self.axis_name, **options)
    w_q_t = None if self.w_q_t is None else self.w_q_t[...]
    return linear.w8a8_block_fp8_linear(*args, w_q_t=w_q_t, valid_rows=valid_rows, **options)


def is_router(path: tuple) -> bool:
  """Whether `path` names the router (gate) of an MoE block: its attribute name (the last name on the path, list
  indices skipped) is `gate` or `router` or contains `router`, in any case. `gate_proj` is no router.

  Routers stay in float: their input is the hidden size (DeepSeek-V3's `mlp.gate` 7168 -> 256 experts, Qwen3-MoE's
  2048 -> 128), a multiple of 128, but their few outputs pick the experts, where FP8's error can flip a choice.
  """
  names = [key for key in path if isinstance(key, str)]
  name = names[-1].lower() if names else ""
  return name in ("gate", "router") or "router" in name


def _set_at(module: nnx.Module, path: tuple, value) -> None:
  parent = module
  for key in path[:-1]:
    parent = parent[key] if isinstance(key, int) else getattr(parent, key)
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def quantize_linears(
    module: nnx.Module,
    *,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    predicate: Callable[[tuple, nnx.Linear], bool] | None = None,
    **options,
) -> list[tuple]:
  """Replaces, in place, every `nnx.Linear` inside `module` with `Fp8Linear.from_linear` of it.

  predicate(path, layer) picks the layers. The default picks those whose in_features is a multiple of block_size[1]
  and that are no MoE router (`is_router(path)`: the attribute name is `gate` or `router` or contains `router`;
  `gate_proj` is an ordinary projection and is picked); routers and narrow layers stay in float. A predicate given
  replaces this rule entirely (combine it with `is_router` to keep routers in float).

  A layer reachable by several paths (shared) is converted once, the predicate seeing one of its paths, and the same
  Fp8Linear goes to every path, so the sharing is kept. Returns the paths of the replaced layers, every path of a
  shared one. `options` go to Fp8Linear.
  """
  gn, gk = _checks.block_size(block_size)
  if predicate is None:
    predicate = lambda path, layer: layer.in_features % gk == 0 and not is_router(path)
  pending = [(path, sub) for path, sub in nnx.iter_modules(module)
             if isinstance(sub, nnx.Linear) and predicate(path, sub)]
  if any(not path for path, _ in pending):
    raise ValueError("module is itself an nnx.Linear: use Fp8Linear.from_linear(module)")
  # id -> (the float layer, kept alive so that its id stays its own; its Fp8Linear). All are converted before the
  # model changes, so that an error leaves it as it was.
  converted = {id(sub): (sub, Fp8Linear.from_linear(sub, block_size=(gn, gk), **options)) for _, sub in pending}
  done: dict[tuple, None] = {}  # the replaced paths, in order
  while pending:
    for path, sub in pending:
      if path in done:
        raise ValueError(f"the nnx.Linear at {path} cannot be replaced (in a container that cannot be assigned to?)")
      _set_at(module, path, converted[id(sub)][1])
      done[path] = None
    # nnx.iter_modules visits a shared layer once, at one of its paths: its other paths show only once that one
    # holds the Fp8Linear, so look again until no path holds a converted layer.
    pending = [(path, sub) for path, sub in nnx.iter_modules(module)
               if id(sub) in converted and converted[id(sub)][0] is sub]
  return list(done)

__all__ = ["Fp8Linear", "Fp8Weight", "quantize_linears", "is_router"]
