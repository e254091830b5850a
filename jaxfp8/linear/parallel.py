"""Tensor-parallel linears under JAX's own SPMD: `column_parallel_linear` (N split over a mesh axis: every device
multiplies replicated activations by its N/P weight rows) and `row_parallel_linear` (K split: every device quantizes
and multiplies its K/P slice of the activations, the float32 partial outputs are summed with `psum`, the bias is
added once), both through `jax.shard_map`; `weight_sharding` gives the matching NamedSharding of each weight array.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import _mesh
from jaxfp8 import _transforms as transforms
from jaxfp8.linear import api, backward, eager, planner


PARALLEL_MODES = ("column", "row")


def weight_spec(parallel: str, axis_name: str, field: str) -> PartitionSpec:
  """The PartitionSpec of a weight array ("w_q", "w_s" or "bias") for column- or row-parallel use."""
  if parallel not in PARALLEL_MODES:
    raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
  if field not in ("w_q", "w_s", "bias"):
    raise ValueError(f"field must be 'w_q', 'w_s' or 'bias', got {field!r}")
  if parallel == "column":  # N split: weight rows, scale rows, bias entries
    return PartitionSpec(axis_name) if field == "bias" else PartitionSpec(axis_name, None)
  return PartitionSpec() if field == "bias" else PartitionSpec(None, axis_name)  # K split; the bias is added once


def weight_sharding(mesh, axis_name: str, parallel: str, field: str) -> NamedSharding:
  """NamedSharding of a weight array for `column_parallel_linear` / `row_parallel_linear` (usable as the `sharding`
  callable of `jaxfp8.weights.load_hf_fp8_linears`: `lambda prefix, field, shape: weight_sharding(mesh, "tp",
  "column", field)`)."""
  _mesh.axis_size(mesh, axis_name)
  return NamedSharding(mesh, weight_spec(parallel, axis_name, field))


def shard_linear_weights(w_q, w_s, bias=None, *, mesh, axis_name: str, parallel: str):
  """Places (w_q, w_s, bias) on the mesh as `parallel` ("column" or "row") use wants them; returns the placed arrays."""
  placed = [None if a is None else jax.device_put(a, weight_sharding(mesh, axis_name, parallel, field))
            for field, a in (("w_q", w_q), ("w_s", w_s), ("bias", bias))]
  return tuple(placed)


def _specs(parallel: str, ndim: int, has_bias: bool, axis_name: str):
  """(in_specs, out_spec) of the shard_map-ped linear for x of `ndim` dimensions."""
  lead = (None,) * (ndim - 1)
  if parallel == "column":
    x_spec, out_spec = PartitionSpec(), PartitionSpec(*lead, axis_name)
  else:
    x_spec, out_spec = PartitionSpec(*lead, axis_name), PartitionSpec()
  in_specs = (x_spec, weight_spec(parallel, axis_name, "w_q"), weight_spec(parallel, axis_name, "w_s"))
  if has_bias:
    in_specs += (weight_spec(parallel, axis_name, "bias"),)
  return in_specs, out_spec


def _parallel_fn(parallel: str, ndim: int, has_bias: bool, *, mesh, axis_name: str, block_size, out_dtype,
                 gather_output: bool, options: planner.LinearOptions) -> Callable:
  """The shard_map-ped linear for x of `ndim` dimensions (traceable)."""
  linear_kwargs = dict(implementation=options.implementation, quant_implementation=options.quant_implementation,
                       backward=options.backward,
                       row_alignment=options.row_alignment, config=options.config, interpret=options.interpret)

  if parallel == "column":
    def per_shard(x, w_q, w_s, *bias):
      return api.w8a8_block_fp8_linear(x, w_q, w_s, block_size, *bias, out_dtype=out_dtype, **linear_kwargs)
  else:
    def per_shard(x, w_q, w_s, *bias):
      # float32 partial sums over this device's K slice, summed over the axis, then the bias once and the cast.
      partial = api.w8a8_block_fp8_linear(x, w_q, w_s, block_size, out_dtype=jnp.float32, **linear_kwargs)
      y = jax.lax.psum(partial, axis_name)
      if bias:
        y = y + bias[0].astype(jnp.float32)
      return y.astype(out_dtype)
  in_specs, out_spec = _specs(parallel, ndim, has_bias, axis_name)
  # check_vma=False: the Pallas launchers declare their outputs with plain ShapeDtypeStructs, which carry no
  # varying-manual-axes type; the specs above say how each value varies (the row-parallel output is psum-ed).
  mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
  mapped_dx = _parallel_input_gradient(parallel, ndim, mesh=mesh, axis_name=axis_name, block_size=block_size,
                                       options=options)
  explicit = _mesh.has_explicit_axes(mesh)

  def differentiable(*args):
    """`mapped` with the gradient computed by `mapped_dx`, not by transposing the shard_map: without
    varying-axes types, JAX transposes the row-parallel psum as a psum of dy / P over the devices, which rounds dy
    (a one-code change of its quantization somewhere in dx for a few seeds in a hundred)."""
    transforms.refuse_forward_mode(f"jaxfp8.linear.{parallel}_parallel_linear", backward.FORWARD_MODE_HINT, *args)
    x_dtype, bias_dtype = args[0].dtype, (args[3].dtype if has_bias else None)

    @jax.custom_vjp
    def fn(*args):
      return mapped(*args)

    def fwd(*args):
      y = transforms.not_differentiable(mapped, *backward.SECOND_ORDER)(*args)
      return y, (args[1], args[2])

    def bwd(residuals, dy):
      w_q, w_s = residuals

      def grads(dy):
        dx = mapped_dx(dy, w_q, w_s).astype(x_dtype)
        return (dx, None, None) + ((backward.bias_gradient(dy, bias_dtype),) if has_bias else ())

      return transforms.not_differentiable(grads, *backward.SECOND_ORDER)(dy)

    fn.defvjp(fwd, bwd)
    return fn(*args)

  def call(*args):
    if explicit:  # arrays typed with Explicit mesh axes must already have the specs shard_map is given
      args = [jax.reshard(a, NamedSharding(mesh, spec)) for a, spec in zip(args, in_specs)]
    y = differentiable(*args)
    if gather_output:  # replicating the N-sharded output: an all-gather
      replicated = NamedSharding(mesh, PartitionSpec())
      y = jax.reshard(y, replicated) if explicit else jax.lax.with_sharding_constraint(y, replicated)
    return y

  return call


def _parallel_input_gradient(parallel: str, ndim: int, *, mesh, axis_name: str, block_size,
                             options: planner.LinearOptions) -> Callable:
  """dx = dy @ W of the shard_map-ped linear, sharded as its forward is (docs/CONTRACT.md §6), float32.

  Column: every device multiplies its N/P columns of dy by its weight rows; the float32 partial dx are summed with
  psum (the transpose of the forward's replicated x). Row: every device multiplies the whole (replicated) dy by its
  K/P weight columns, giving its K/P slice of dx, exactly the unsharded dx's slice (same dy groups, same blocks).
  """
  lead = (None,) * (ndim - 1)
  w_specs = (weight_spec(parallel, axis_name, "w_q"), weight_spec(parallel, axis_name, "w_s"))

  def per_shard(dy, w_q, w_s):
    x_shape = dy.shape[:-1] + (w_q.shape[1],)
    dx = backward.input_gradient(dy, x_shape, jnp.float32, w_q, w_s, None, block_size, options, options.backward)
    return jax.lax.psum(dx, axis_name) if parallel == "column" else dx

  if parallel == "column":
    dy_spec, dx_spec = PartitionSpec(*lead, axis_name), PartitionSpec()
  else:
    dy_spec, dx_spec = PartitionSpec(), PartitionSpec(*lead, axis_name)
  mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=(dy_spec,) + w_specs, out_specs=dx_spec, check_vma=False)
  # dy comes as the caller's cotangent, sharded however it is: placed as the specs say (Explicit axes require it).
  return lambda dy, w_q, w_s: mapped(*_mesh.with_specs((dy, w_q, w_s), mesh, (dy_spec,) + w_specs))


def _parallel_linear(parallel: str, x, w_q, w_s, block_size, bias, *, mesh, axis_name, gather_output, out_dtype,
                     options: planner.LinearOptions):
  block_size, out_dtype = api.validate(x, w_q, w_s, bias, block_size, out_dtype)
  devices = _mesh.axis_size(mesh, axis_name)
  n, k = w_q.shape
  gn, gk = block_size
  if parallel == "column" and (n % devices or (n // devices) % gn):
    raise ValueError(f"column-parallel use splits N={n} over the {devices} devices of mesh axis {axis_name!r}: each "
                     f"share must be whole weight-scale blocks (a multiple of gn={gn}), but N / {devices} = "
                     f"{n / devices:g}")
  if parallel == "row" and (k % devices or (k // devices) % gk):
    raise ValueError(f"row-parallel use splits K={k} over the {devices} devices of mesh axis {axis_name!r}: each "
                     f"share must be whole scale groups (a multiple of gk={gk}), but K / {devices} = {k / devices:g}")
  fn_kwargs = dict(mesh=mesh, axis_name=axis_name, block_size=block_size, out_dtype=out_dtype,
                   gather_output=gather_output, options=options)
  if api.is_traced(x, w_q, w_s, bias):
    rest = tuple(api.as_device_array(a) for a in (w_q, w_s, bias) if a is not None)
    return _parallel_fn(parallel, len(x.shape), bias is not None, **fn_kwargs)(x, *rest)

  # Eager: every operand goes to the mesh with the sharding the shard_map wants (a transfer, or nothing when it is
  # there already), so that the executable of a bucket always sees the same input shardings.
  in_specs, _ = _specs(parallel, 2, bias is not None, axis_name)
  rest = tuple(jax.device_put(a, NamedSharding(mesh, spec))
               for a, spec in zip([w_q, w_s] + ([bias] if bias is not None else []), in_specs[1:]))
  if not isinstance(x, (np.ndarray, jax.Array)):
    x = np.asarray(x)
  x_sharding = NamedSharding(mesh, in_specs[0])

  def make_body(bucket: int):
    del bucket  # each device plans its own shard when the body is traced
    return eager.named(_parallel_fn(parallel, 2, bias is not None, **fn_kwargs), f"jaxfp8_{parallel}_parallel_bucket")

  key = (mesh, axis_name, gather_output, block_size, out_dtype.name, options)
  return eager.run_eager(f"{parallel}_parallel_linear", key, make_body, x, rest, n, out_dtype,
                    place_rows=lambda x_rows: jax.device_put(x_rows, x_sharding))


def column_parallel_linear(
    x, w_q, w_s, block_size: tuple[int, int], bias=None, *, mesh: jax.sharding.Mesh, axis_name: str,
    gather_output: bool = False, out_dtype=None, implementation: str | None = None,
    quant_implementation: str | None = None, row_alignment: int | None = None, config=None,
    interpret: bool | None = None, backward: str = "fp8",
) -> jax.Array:
  """The linear with N split over mesh axis `axis_name` (`jax.shard_map`).

  Every device quantizes the whole (replicated) x and multiplies it by its N/P rows of the weight (w_q, w_s and bias
  sharded along N: `weight_sharding(mesh, axis_name, "column", field)`); N/P must be a multiple of gn. The output
  (..., N) is sharded along its last axis, or all-gathered with gather_output=True. Other arguments as in
  `w8a8_block_fp8_linear`; results equal the unsharded call's bit for bit when every shard runs the same kernels.
  """
  options = planner.LinearOptions(implementation, quant_implementation, row_alignment, config, interpret, backward)
  return _parallel_linear("column", x, w_q, w_s, block_size, bias, mesh=mesh, axis_name=axis_name,
                          gather_output=gather_output, out_dtype=out_dtype, options=options)


def row_parallel_linear(
    x, w_q, w_s, block_size: tuple[int, int], bias=None, *, mesh: jax.sharding.Mesh, axis_name: str,
    out_dtype=None, implementation: str | None = None, quant_implementation: str | None = None,
    row_alignment: int | None = None, config=None, interpret: bool | None = None, backward: str = "fp8",
) -> jax.Array:
  """The linear with K split over mesh axis `axis_name` (`jax.shard_map`), as after a column-parallel layer.

  x (..., K) is sharded along K and w_q, w_s along their K axis (`weight_sharding(mesh, axis_name, "row", field)`);
  K/P must be a multiple of gk, so every device's groups are exactly the unsharded call's groups and its
  quantization is the same. Each device computes float32 partial outputs over its K slice; `psum` adds them, then the
  (replicated) bias is added once and the result cast. The output is replicated. It differs from the unsharded call
  only by the float32 summation order of the K slices.
  """
  options = planner.LinearOptions(implementation, quant_implementation, row_alignment, config, interpret, backward)
  return _parallel_linear("row", x, w_q, w_s, block_size, bias, mesh=mesh, axis_name=axis_name,
                          gather_output=False, out_dtype=out_dtype, options=options)
