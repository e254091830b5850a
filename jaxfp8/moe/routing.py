"""The routers of the two block-FP8 MoE families (docs/CONTRACT.md §8), as frozen configs that map router logits to
(topk_ids, topk_weights): `DeepSeekV3Router` and `Qwen3MoeRouter`. Routers stay in float32 (the checkpoints' routers
are float layers; `quantize_linears` leaves them so).

Both take logits (..., E), any leading shape (the tokens, as the layer takes them), and follow one NaN rule: a token
whose routing values hold a NaN gets NaN for every one of its weights (§8)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8 import _checks


# The most comparisons a compare-and-count choice (`_top_k` here, the layer's dispatch) makes in one call: the largest
# measured to compile and run on the H200 (the DeepSeek-V3 router at 64 tokens: 64 x 256 x 256). XLA's GPU compiler
# did not finish the DeepSeek-V3 router's at 4096 tokens in 45 s.
PAIRWISE_MAX_COMPARES = 1 << 22
# Past PAIRWISE_MAX_COMPARES, a top-k with k up to this many runs as k rounds of one fused argmax each; a larger k
# runs `lax.top_k` (a sort on the GPU).
ROUNDS_MAX_K = 8


def _order_keys(values: jax.Array) -> jax.Array:
  """int32 keys of float32 values in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < inf < +NaN), the order
  `lax.top_k` ranks floats by."""
  bits = lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _top_k(values: jax.Array, k: int, *also: jax.Array) -> tuple[jax.Array, ...]:
  """`lax.top_k(values, k)` over the last axis (the k largest, in order, ties to the lower index, NaN by its sign),
  as (ids, then the chosen entries of each array of `also`, same shape as values), bit for bit, in one of three
  forms. Up to PAIRWISE_MAX_COMPARES, each entry's rank is the count of entries that beat it, so the whole choice is
  a few fused compare-and-count reductions over (..., n, n): at decode a handful of small kernels where a sort-based
  top-k launches many. Past it, with k up to ROUNDS_MAX_K, k rounds of one argmax each over the entries not yet
  taken (a reduction of (free, key, index) triples: one kernel a round, where XLA's GPU top-k sorts every row);
  else `lax.top_k` itself."""
  n = values.shape[-1]
  if values.size * n > PAIRWISE_MAX_COMPARES:
    ids = _top_k_rounds(values, k) if k <= ROUNDS_MAX_K else lax.top_k(values, k)[1]
    return (ids, *(jnp.take_along_axis(a, ids, axis=-1) for a in also))
  key = _order_keys(values)
  index = lax.broadcasted_iota(jnp.int32, (n, n), 1) < lax.broadcasted_iota(jnp.int32, (n, n), 0)
  beats = (key[..., None, :] > key[..., :, None]) | ((key[..., None, :] == key[..., :, None]) & index)
  rank = jnp.sum(beats, axis=-1, dtype=jnp.int32)  # (..., n): 0 for the largest
  chosen = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # (..., k, n): one True per row
  pick = lambda a: jnp.sum(jnp.where(chosen, a[..., None, :], 0), axis=-1)  # the one chosen entry, exactly
  # float entries are picked as their bits: every value comes back as it was (-0.0 and a NaN's sign included)
  picked = tuple(lax.bitcast_convert_type(pick(lax.bitcast_convert_type(a, jnp.int32)), a.dtype) for a in also)
  return (pick(jnp.arange(n, dtype=jnp.int32)), *picked)


def _better(a, b):
  """The lexicographic max of two (free, key, index) triples: a free entry, then the larger key, then the lower
  index (lax.top_k's tie rule). Associative and commutative, so XLA may reduce in any order."""
  a_free, a_key, a_index = a
  b_free, b_key, b_index = b
  a_wins = (a_free > b_free) | ((a_free == b_free) & ((a_key > b_key) | ((a_key == b_key) & (a_index < b_index))))
  return tuple(jnp.where(a_wins, x, y) for x, y in zip(a, b))


def _top_k_rounds(values: jax.Array, k: int) -> jax.Array:
  """The ids of `lax.top_k(values, k)`: round j takes the best entry not yet taken. The taken flag is part of the
  reduced triple (not a sentinel key), so every key, the least included, ranks as in lax.top_k."""
  n = values.shape[-1]
  key = _order_keys(values)
  index = lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
  taken = jnp.zeros(values.shape, bool)
  ids = []
  for _ in range(k):
    free = jnp.where(taken, 0, 1).astype(jnp.int32)
    best = lax.reduce((free, key, index), (jnp.int32(-1), jnp.int32(jnp.iinfo(jnp.int32).min), jnp.int32(n)),
                      _better, (values.ndim - 1,))[2]
    ids.append(best)
    taken = taken | (index == best[..., None])
  return jnp.stack(ids, axis=-1)


def _token_rows(router: str, logits) -> tuple[tuple[int, ...], int]:
  """(the tokens' leading shape, E) of logits (..., E), checked."""
  _checks.array("logits", logits, _checks.FLOAT_DTYPES, ndim=None)
  if len(logits.shape) < 1:
    raise ValueError(f"{router}: logits must be (..., E), one row of E expert logits per token, got shape "
                     f"{tuple(logits.shape)}")
  return tuple(logits.shape[:-1]), logits.shape[-1]


def _nan_tokens_get_nan(values: jax.Array, weights: jax.Array) -> jax.Array:
  """§8's NaN rule: the weights of a token (a row of `values`, the values its experts are ranked by) holding a NaN
  are all NaN. `lax.top_k` ranks a NaN by its sign bit (a negative NaN below -inf), so a NaN would otherwise be
  ranked out of the choice and the token routed on finite weights; transformers' torch.topk ranks NaN first, which
  makes that token's output NaN."""
  return jnp.where(jnp.isnan(values).any(-1, keepdims=True), jnp.float32(jnp.nan), weights)


def _rounded(x: jax.Array) -> jax.Array:
  """x as it is stored: XLA's GPU compiler folds a narrowing convert followed by a widening one (simplify-fp-
  conversions), which would route on values the contract rounds; an optimization barrier keeps the rounding."""
  return x if jnp.dtype(x.dtype) == jnp.float32 else lax.optimization_barrier(x)


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
    """The router logits (..., E) from x (..., H) and the gate's weight (E, H): float32 sums of the exact products,
    as DeepSeek-V3's model computes them in float32. Where both operands are 16-bit floats (the checkpoints' bfloat16
    gate and activations) every product of two of them is exact in float32, so the dot runs on their own dtype with
    float32 accumulation (tensor cores) and gives the same products as a float32 dot; only the summation order is
    the dot's own (docs/CONTRACT.md §8)."""
    x = _rounded(x)
    common = jnp.promote_types(x.dtype, gate_weight.dtype)
    if common in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      return jnp.einsum("...h,eh->...e", x.astype(common), gate_weight.astype(common),
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...h,eh->...e", x.astype(jnp.float32), gate_weight.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)

  def __call__(self, logits: jax.Array, correction_bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """logits (..., E), correction_bias (E,) -> (ids int32 (..., top_k), weights float32 (..., top_k))."""
    lead, e = _token_rows("DeepSeekV3Router", logits)
    self.validate(e)
    if correction_bias is None:
      raise ValueError(f"DeepSeekV3Router needs correction_bias (the checkpoint's e_score_correction_bias, (E,) = "
                       f"({e},)), got None")
    _checks.array("correction_bias", correction_bias, _checks.FLOAT_DTYPES, ndim=None)
    if tuple(correction_bias.shape) != (e,):
      raise ValueError(f"correction_bias must have shape (E,) = ({e},), one per expert of logits of shape "
                       f"{tuple(logits.shape)}, got {tuple(correction_bias.shape)}")
    scores = jax.nn.sigmoid(logits.reshape(-1, e).astype(jnp.float32))
    t = scores.shape[0]
    choice = scores + correction_bias.astype(jnp.float32)[None, :]
    grouped = choice.reshape(t, self.n_group, e // self.n_group)
    group_scores = _top_k(grouped, 2, grouped)[1].sum(-1)
    # inf + (-inf) (bias entries of both signs) ranks last on every platform, not by the sign of the NaN it makes.
    group_scores = jnp.where(jnp.isnan(group_scores), -jnp.inf, group_scores)
    group_ids = _top_k(group_scores, self.topk_group)[0]
    allowed = jnp.any(group_ids[:, :, None] == jnp.arange(self.n_group, dtype=jnp.int32), axis=1)
    masked = jnp.where(jnp.repeat(allowed, e // self.n_group, axis=1), choice, -jnp.inf)
    ids, weights = _top_k(masked, self.top_k, scores)
    if self.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = _nan_tokens_get_nan(choice, weights * jnp.float32(self.routed_scaling_factor))
    return ids.astype(jnp.int32).reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)


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
    return _rounded(jnp.einsum("...h,eh->...e", x, gate_weight.astype(x.dtype), preferred_element_type=jnp.float32,
                               precision=lax.Precision.HIGHEST).astype(x.dtype))

  def __call__(self, logits: jax.Array, correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """logits (..., E) -> (ids int32 (..., top_k), weights float32 (..., top_k)). Qwen3 has no correction bias."""
    lead, e = _token_rows("Qwen3MoeRouter", logits)
    if correction_bias is not None:
      raise ValueError("Qwen3MoeRouter takes no correction_bias (that is DeepSeek-V3's router), got an array of "
                       f"shape {tuple(getattr(correction_bias, 'shape', ()))}")
    self.validate(e)
    probs = jax.nn.softmax(logits.reshape(-1, e).astype(jnp.float32), axis=-1)
    ids, weights = _top_k(probs, self.top_k, probs)
    if self.norm_topk_prob:
      weights = weights / weights.sum(-1, keepdims=True)
    weights = _nan_tokens_get_nan(probs, weights)
    return ids.astype(jnp.int32).reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)


Router = DeepSeekV3Router | Qwen3MoeRouter
