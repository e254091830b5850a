"""What the SPMD entry points (tensor-parallel linears, expert-parallel MoE) need alike from a mesh: the size of the
named axis (checked), and the arguments placed with the specs a `jax.shard_map` is given."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec


def axis_size(mesh, axis_name: str) -> int:
  """The number of devices along `axis_name`; a clear error for anything that is not a Mesh with that axis."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; its axes are {mesh.axis_names}")
  return int(mesh.shape[axis_name])


def has_explicit_axes(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def with_specs(args: Sequence, mesh, specs: Sequence[PartitionSpec]) -> list:
  """`args` placed as the shard_map's in_specs say: resharded when traced on a mesh with Explicit axes (whose arrays
  must already have those specs), put on the mesh when concrete, as they are otherwise (the compiler reshards)."""
  if not any(isinstance(a, jax.core.Tracer) for a in args):
    return [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]
  if has_explicit_axes(mesh):
    return [jax.reshard(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]
  return list(args)
