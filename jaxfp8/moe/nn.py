"""Flax NNX `Fp8MoE` (optional extra `jaxfp8[nn]`): a DeepSeek-V3 or Qwen3-MoE expert block on block-FP8 weights.

    layer = Fp8MoE.from_hf("/ckpt", "model.layers.3.mlp", router=DeepSeekV3Router())   # experts stacked at load
    y = layer(x)                                     # x (..., H) bf16 -> (..., H), eager or under nnx.jit
    layer.save_hf("/out", "model.layers.3.mlp")      # the Hugging Face naming again

The experts' codes and scales are `Fp8Weight` variables (frozen, not `nnx.Param`); the router's float weight and
DeepSeek-V3's correction bias too (the checkpoint's values; the routing is not differentiable). Shared experts
(DeepSeek-V3) are `jaxfp8.nn.Fp8Linear` layers: down(silu(gate(x)) * up(x)), gate and up as one stacked linear.
With a mesh and an axis name, the routed experts run expert-parallel (`jaxfp8.moe.expert_parallel_fp8_moe`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import _checks, _mesh
from jaxfp8 import nn as fp8_nn
from jaxfp8.moe import api, parallel, planner, routing
from jaxfp8.moe.weights import MoeWeights, check_moe_weights, load_hf_moe, save_hf_moe

nnx = fp8_nn.nnx


class Fp8MoE(nnx.Module):
  """The routed experts (+ shared experts) of an MoE block: y = fp8_moe(x, router(x)) + shared(x).

  Args:
    weights: the block's `MoeWeights` (stacked experts, router, optional shared experts).
    router: a `routing.DeepSeekV3Router` (needs weights.correction_bias) or `routing.Qwen3MoeRouter`.
    implementation, quant_implementation, interpret: as in `jaxfp8.moe.fp8_moe` (and the shared experts' linears);
      combine_implementation: as in `fp8_moe` (the routed experts' combine).
    mesh, axis_name: run the routed experts expert-parallel over this mesh axis (tokens and experts split over it).
  """

  def __init__(self, weights: MoeWeights, router: routing.Router, *, implementation: str | None = None,
               quant_implementation: str | None = None, interpret: bool | None = None,
               mesh: jax.sharding.Mesh | None = None, axis_name: str | None = None,
               combine_implementation: str | None = None):
    check_moe_weights(weights)
    planner.MoeOptions(implementation, quant_implementation, interpret, combine_implementation)  # they check
    if not isinstance(router, (routing.DeepSeekV3Router, routing.Qwen3MoeRouter)):
      raise TypeError(f"router must be a DeepSeekV3Router or Qwen3MoeRouter, got {type(router).__name__}")
    if router.uses_correction_bias != (weights.correction_bias is not None):
      raise ValueError(f"{type(router).__name__} {'needs' if router.uses_correction_bias else 'takes no'} "
                       "correction_bias (DeepSeek-V3's e_score_correction_bias); the weights have "
                       f"{'none' if weights.correction_bias is None else 'one'}")
    if (mesh is None) != (axis_name is None):
      raise ValueError("pass both mesh and axis_name for expert parallelism, or neither")
    experts = weights.gate_weight.shape[0]
    router.validate(experts)
    if not weights.holds_every_expert:
      raise ValueError(f"Fp8MoE needs every expert of its router ({experts}); the weights hold experts "
                       f"[{weights.first_expert}, {weights.first_expert + weights.num_experts}) (with a mesh, "
                       "expert parallelism splits the full set itself)")
    self.router = router
    self.block_size = tuple(weights.block_size)
    self.options = dict(implementation=implementation, quant_implementation=quant_implementation,
                        interpret=interpret)
    if mesh is not None and combine_implementation not in (None, "xla"):
      raise ValueError(f"combine_implementation={combine_implementation!r}: expert parallelism combines each token's "
                       "rows after their exchange back, in XLA; pass None or 'xla' with a mesh")
    self.combine_implementation = combine_implementation
    self.mesh, self.axis_name = mesh, axis_name
    self.w13_q = fp8_nn.Fp8Weight(jnp.asarray(weights.w13_q))
    self.w13_s = fp8_nn.Fp8Weight(jnp.asarray(weights.w13_s))
    self.w2_q = fp8_nn.Fp8Weight(jnp.asarray(weights.w2_q))
    self.w2_s = fp8_nn.Fp8Weight(jnp.asarray(weights.w2_s))
    self.gate_weight = fp8_nn.Fp8Weight(jnp.asarray(weights.gate_weight))
    self.correction_bias = (None if weights.correction_bias is None
                            else fp8_nn.Fp8Weight(jnp.asarray(weights.correction_bias)))
    # Each attribute assigned once: a first None would make it a static field, which a layer may not replace.
    shared = weights.shared_gate_up is not None
    linear_options = {**self.options, "use_bias": False}
    self.shared_gate_up = (fp8_nn.Fp8Linear.from_fp8_weight(weights.shared_gate_up, **linear_options) if shared
                           else None)
    self.shared_down = fp8_nn.Fp8Linear.from_fp8_weight(weights.shared_down, **linear_options) if shared else None

  @classmethod
  def from_hf(cls, path, prefix: str, *, router: routing.Router, **options) -> Fp8MoE:
    """The block at `prefix` of a Hugging Face FP8 checkpoint (`jaxfp8.moe.weights.load_hf_moe`)."""
    return cls(load_hf_moe(path, prefix), router, **options)

  def moe_weights(self) -> MoeWeights:
    shared = {}
    if self.shared_gate_up is not None:
      shared = dict(shared_gate_up=self.shared_gate_up.fp8_weight(), shared_down=self.shared_down.fp8_weight())
    return MoeWeights(self.w13_q[...], self.w13_s[...], self.w2_q[...], self.w2_s[...], self.gate_weight[...],
                      self.block_size, None if self.correction_bias is None else self.correction_bias[...], **shared)

  def save_hf(self, path, prefix: str) -> None:
    """Writes the block in the Hugging Face naming (`jaxfp8.moe.weights.save_hf_moe`)."""
    save_hf_moe(path, prefix, self.moe_weights())

  def __call__(self, x: jax.Array) -> jax.Array:
    """y (..., H) in x's dtype for x (..., H). Eager or under `nnx.jit` / `jax.jit`, the same jitted function of the
    same plans runs (`_block`): the two give the same bits (docs/CONTRACT.md §8)."""
    self._check_call(x)
    return _block(self, x)

  def _check_call(self, x) -> None:
    """x against the experts, and the router's variables (which a caller may have replaced) as at construction."""
    _checks.array("x", x, _checks.FLOAT_DTYPES, ndim=None)
    e, _, h = self.w13_q.shape
    if len(x.shape) < 1 or x.shape[-1] != h:
      raise ValueError(f"x must be (..., H) = (..., {h}) for experts of hidden size H={h}, got shape "
                       f"{tuple(x.shape)}")
    bias = None if self.correction_bias is None else self.correction_bias[...]
    weights = MoeWeights(self.w13_q[...], self.w13_s[...], self.w2_q[...], self.w2_s[...], self.gate_weight[...],
                         self.block_size, bias)
    check_moe_weights(weights, router_experts=e)

  def forward(self, x: jax.Array) -> jax.Array:
    """The block on checked arguments (traced inside `_block`)."""
    lead = x.shape[:-1]
    # The barriers keep the caller's producers and consumers out of the block's fusions, so that XLA compiles the
    # same computation eager and inlined in a caller's jit.
    tokens = lax.optimization_barrier(x.reshape(-1, x.shape[-1]))
    logits = self.router.logits(tokens, self.gate_weight[...])
    bias = None if self.correction_bias is None else self.correction_bias[...]
    ids, weights = self.router(logits, bias)
    experts = (self.w13_q[...], self.w13_s[...], self.w2_q[...], self.w2_s[...])
    if self.mesh is None:
      # the router picks among these same experts: every id is local
      out = api.fp8_moe(tokens, ids, weights, *experts, self.block_size, **self.options,
                        combine_implementation=self.combine_implementation, every_id_local=True)
    else:
      out = parallel.expert_parallel_fp8_moe(tokens, ids, weights, *experts, self.block_size, mesh=self.mesh,
                                             axis_name=self.axis_name, **self.options)
    if self.shared_gate_up is not None:
      # gate and up are rounded to x's dtype (the barrier keeps XLA from folding the rounding into silu's widening).
      gate, up = jnp.split(lax.optimization_barrier(self.shared_gate_up(tokens)), 2, axis=-1)
      out = out + self.shared_down((jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up).astype(x.dtype))
    if self.mesh is not None and len(lead) != 1 and _mesh.has_explicit_axes(self.mesh):
      # The output is split along its flat token axis; under Explicit axes that axis cannot be unflattened into
      # (..., T') as it is: replicated first.
      out = jax.reshard(out, NamedSharding(self.mesh, PartitionSpec()))
    return lax.optimization_barrier(out.reshape(*lead, -1))


@jax.jit
def _block(layer: Fp8MoE, x: jax.Array) -> jax.Array:
  """The block's one computation (an NNX module is a pytree: its arrays are the arguments, its configuration static).
  An eager call runs it compiled once per shape; under a caller's jit it is traced as it is, inlined."""
  return layer.forward(x)


__all__ = ["Fp8MoE", "MoeWeights", "load_hf_moe", "save_hf_moe"]
