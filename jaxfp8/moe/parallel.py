"""Expert parallelism for the MoE layer (docs/CONTRACT.md §8): experts split over a mesh axis, tokens exchanged with
`jax.lax.all_to_all` under `jax.shard_map`.

Every device holds T/P tokens and E/P experts. It quantizes its tokens once, writes each routed row (codes and scales)
into a send buffer slot of the device that holds the row's expert, and one all-to-all delivers them; each device then
runs its experts on the rows it received (the single-device layer's `layer.experts_on_rows`), a second all-to-all
returns the float32 results, and each device combines its tokens' slots. The buffers have room for every routed row
of a device toward every peer, so no row is ever dropped (a capacity limit would be a silent wrong answer); their
size, P x (T/P x k) rows per device, is the price.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxfp8 import _mesh, quant
from jaxfp8 import _transforms as transforms
from jaxfp8.moe import api, combine, layer, planner

_OP = "jaxfp8.moe.expert_parallel_fp8_moe"


def _slot_positions(dst: jax.Array, devices: int) -> jax.Array:
  """Each slot's place in its destination's send buffer: how many earlier slots go to the same device."""
  one_hot = (dst[:, None] == jnp.arange(devices)[None, :]).astype(jnp.int32)
  return jnp.take_along_axis(jnp.cumsum(one_hot, axis=0) - one_hot, jnp.clip(dst, 0, devices - 1)[:, None], 1)[:, 0]


def _per_device(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, *, plan: planner.MoePlan, axis_name: str,
                devices: int):
  """One device's share: x (T_l, H), ids and weights (T_l, k), its E_l experts' weights. Returns (T_l, H)."""
  t, k = topk_ids.shape
  local_experts = plan.experts
  capacity = t * k
  ids = topk_ids.reshape(-1)
  valid = (ids >= 0) & (ids < local_experts * devices)
  dst = jnp.where(valid, ids // local_experts, -1)
  pos = jnp.where(valid, _slot_positions(dst, devices), capacity)  # capacity: out of range, dropped by the scatter
  send_at = (jnp.maximum(dst, 0), pos)

  x_q, x_s = quant.planner.run(x[None], None, plan=plan.quant_x)
  x_q, x_s = x_q[0], x_s[0]
  scales = x_s[:, :t].T if plan.column_major else x_s[:t]  # (T_l, G) row-major for the exchange
  token = jnp.arange(t * k, dtype=jnp.int32) // k
  send_codes = jnp.zeros((devices, capacity, x.shape[1]), x_q.dtype).at[send_at].set(x_q[token], mode="drop")
  send_scales = jnp.ones((devices, capacity, scales.shape[1]), jnp.float32).at[send_at].set(scales[token], mode="drop")
  send_expert = jnp.full((devices, capacity), -1, jnp.int32).at[send_at].set(ids - dst * local_experts, mode="drop")

  exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0, tiled=True)
  codes = exchange(send_codes).reshape(devices * capacity, -1)
  recv_scales = exchange(send_scales).reshape(devices * capacity, -1)
  expert = exchange(send_expert).reshape(-1)

  d = layer.dispatch(expert, local_experts, plan)
  y = layer.experts_on_rows(codes, recv_scales.T if plan.column_major else recv_scales, 1, d, w13_q, w13_s, w2_q,
                            w2_s, plan)
  y = y[d.rank].reshape(devices, capacity, -1)  # back in buffer order; rows of no expert are never read
  back = exchange(y)  # back[d, p]: the result of the row this device put at slot p of device d's buffer
  y_slots = jnp.where(valid[:, None], back[send_at[0], jnp.minimum(pos, capacity - 1)], 0.0)
  return combine.combine_slots(y_slots.reshape(t, k, -1), topk_weights, valid.reshape(t, k), x.dtype)


def expert_parallel_fp8_moe(
    x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size: tuple[int, int] = (128, 128), *,
    mesh: jax.sharding.Mesh, axis_name: str, implementation: str | None = None,
    quant_implementation: str | None = None, interpret: bool | None = None,
) -> jax.Array:
  """`fp8_moe` with the experts split over mesh axis `axis_name` (E/P each, the weights sharded along their expert
  axis) and the tokens too (x (T, H), topk_ids and topk_weights (T, k) sharded along T; T and E multiples of P).
  topk_ids are global expert ids. Returns (T, H), sharded like x; equal to the single-device layer's result on the
  same implementation up to the GEMMs' summation order (docs/CONTRACT.md §8). Works eagerly and under `jax.jit`."""
  block_size, lead = api.validate(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size)
  devices = _mesh.axis_size(mesh, axis_name)
  if len(lead) != 1:
    raise ValueError(f"x must be (T, H) for expert parallelism (its tokens are split over {axis_name!r}), got shape "
                     f"{tuple(x.shape)}")
  tokens, top_k = topk_ids.shape
  experts = w13_q.shape[0]
  for name, size in (("the tokens T", tokens), ("the experts E", experts)):
    if size % devices:
      raise ValueError(f"{name}={size} must split evenly over the {devices} devices of mesh axis {axis_name!r}")
  options = planner.MoeOptions(implementation, quant_implementation, interpret)
  local_tokens = tokens // devices
  plan = planner.plan(local_tokens, top_k, experts // devices, x.shape[1], w2_q.shape[2], block_size, x.dtype,
                      options, routed_rows=devices * local_tokens * top_k)
  split = PartitionSpec(axis_name)
  args = _mesh.with_specs((x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s), mesh, (split,) * 7)
  run = functools.partial(_parallel, plan=plan, mesh=mesh, axis_name=axis_name, devices=devices)
  # As the single-device layer (`api.transformable`): no derivative, no vmap, the same error on every implementation
  # (XLA would otherwise differentiate straight through the quantizers).
  return transforms.untransformable(
      run, _OP, vmap_hint="its tokens are already split over the mesh; put a batch's tokens into T instead",
      derivative_hint="its experts are frozen FP8 codes and its routing is discrete; fine-tune around it (e.g. "
      "adapters)")(*args)


@functools.partial(jax.jit, static_argnames=("plan", "mesh", "axis_name", "devices"))
def _parallel(*args, plan, mesh, axis_name, devices):
  per_device = functools.partial(_per_device, plan=plan, axis_name=axis_name, devices=devices)
  # check_vma=False: the Pallas launchers declare their outputs with plain ShapeDtypeStructs (no varying-axes type).
  split = PartitionSpec(axis_name)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(split,) * len(args), out_specs=split, check_vma=False)(*args)
