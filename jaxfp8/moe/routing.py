"""The routers of the two block-FP8 MoE families (docs/CONTRACT.md §8), as frozen configs that map router logits to
(topk_ids, topk_weights): `DeepSeekV3Router` and `Qwen3MoeRouter`. Routers stay in float32 (the checkpoints' routers
are float layers; `quantize_linears` leaves them so)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8 import _checks


def _top_k(values: jax.Array, k: int) -> jax.Array:
  """Indices of the k largest values of the last axis, ties to the lower index (`lax.top_k`'s order)."""
  return lax.top_k(values, k)[1]


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Router:
  """DeepSeek-V3 / R1: sigmoid scores, a score-correction bias for the choice only, grouped top-k (the topk_group
  groups of n_group whose two best biased scores sum highest), normalized weights times routed_scaling_factor.
  Defaults are DeepSeek-V3's config.json."""
  top_k: int = 8
  n_group: int = 8
  topk_group: int = 4
  routed_scaling_factor: float = 2.5
  norm_topk_prob: bool = True

  def validate(self, num_experts: int) -> None:
    for name in ("top_k", "n_group", "topk_group"):
      _checks.positive_int(name, getattr(self, name))
    if num_experts % self.n_group:
      raise ValueError(f"n_group={self.n_group} must divide the number of experts {num_experts}")
    per_group = num_experts // self.n_group
    if per_group < 2:
      raise ValueError(f"each of the n_group={self.n_group} groups needs 2 or more of the {num_experts} experts "
                       "(a group's score is its two best experts')")
    if self.topk_group > self.n_group or self.top_k > self.topk_group * per_group:
      raise ValueError(f"top_k={self.top_k} experts must fit in topk_group={self.topk_group} of the "
                       f"n_group={self.n_group} groups of {per_group} experts")

  uses_correction_bias = True

  @staticmethod
  def logits(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """The router logits (..., E) from x (..., H) and the gate's weight (E, H): in float32, as DeepSeek-V3's model
    computes them."""
    return jnp.einsum("...h,eh->...e", x.astype(jnp.float32), gate_weight.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)

  def __call__(self, logits: jax.Array, correction_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits (T, E), correction_bias (E,) -> (ids int32 (T, top_k), weights float32 (T, top_k))."""
    t, e = logits.shape
    self.validate(e)
    if tuple(correction_bias.shape) != (e,):
      raise ValueError(f"correction_bias must have shape (E,) = ({e},), got {tuple(correction_bias.shape)}")
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)[None, :]
    grouped = choice.reshape(t, self.n_group, e // self.n_group)
    group_scores = lax.top_k(grouped, 2)[0].sum(-1)
    allowed = jnp.zeros((t, self.n_group), bool).at[
        jnp.arange(t)[:, None], _top_k(group_scores, self.topk_group)].set(True)
    masked = jnp.where(jnp.repeat(allowed, e // self.n_group, axis=1), choice, -jnp.inf)
    ids = _top_k(masked, self.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if self.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * jnp.float32(self.routed_scaling_factor)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeRouter:
  """Qwen3-MoE: softmax over the experts, the top_k, renormalized with norm_topk_prob. Defaults are
  Qwen3-30B-A3B's config.json."""
  top_k: int = 8
  norm_topk_prob: bool = True

  def validate(self, num_experts: int) -> None:
    _checks.positive_int("top_k", self.top_k)
    if self.top_k > num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds the number of experts {num_experts}")

  uses_correction_bias = False

  @staticmethod
  def logits(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """The router logits (..., E) from x (..., H) and the gate's weight (E, H): a linear in x's dtype (float32
    accumulation, rounded to x's dtype), as Qwen3-MoE's model computes them."""
    return jnp.einsum("...h,eh->...e", x, gate_weight.astype(x.dtype), preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST).astype(x.dtype)

  def __call__(self, logits: jax.Array, correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """logits (T, E) -> (ids int32 (T, top_k), weights float32 (T, top_k)). Qwen3 has no correction bias."""
    if correction_bias is not None:
      raise ValueError("Qwen3MoeRouter takes no correction_bias (that is DeepSeek-V3's router)")
    self.validate(logits.shape[-1])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, self.top_k)
    if self.norm_topk_prob:
      weights = weights / weights.sum(-1, keepdims=True)
    return ids.astype(jnp.int32), weights


Router = DeepSeekV3Router | Qwen3MoeRouter
