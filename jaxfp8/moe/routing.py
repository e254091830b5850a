"""The routers of the two block-FP8 MoE families (docs/CONTRACT.md §8), as frozen configs that map router logits to
(topk_ids, topk_weights): `DeepSeekV3Router` and `Qwen3MoeRouter`. Routers stay in float32 (the checkpoints' routers
are float layers; `quantize_linears` leaves them so).

Both take logits (..., E), any leading shape (the tokens, as the layer takes them), and follow one NaN rule: a token
whose routing values hold a NaN gets NaN for every one of its weights (§8).

Three implementations of the choice after the logits (`plan` picks, `Router.explain` says which and why): "xla", the
compare-and-count top-k below (a chain of small fused reductions: five kernels for DeepSeek-V3's choice at decode,
three for Qwen3-MoE's, as XLA's GPU compiler builds them for sm_90; scripts/xla_gpu_kernels.py), "xla_merge", each
row's best entries as one reduction whose state is a sorted list (`topk.best_lists`; the groups' lists merged after
it), and "mosaic", one Mosaic GPU kernel for the whole chain
(pallas_kernels/route_topk_mosaic.py), the default on Hopper from MOSAIC_MIN_TOKENS tokens where it takes the
problem (Qwen3's softmax router; DeepSeek-V3's is slower than XLA's); the merged form is Hopper's default within
MERGED_TOKENS. All give `lax.top_k`'s ids on the same values
(Qwen3's merged form on the logits, whose order the probabilities keep but where two round to one);
the weights may differ by the rounding of each one's exp and k-term sum (§8: weights to float32 rounding). All are
differentiable in the logits, each through the XLA weights of the ids it chose (`weights_of`: the XLA forms pick
their weights as bits, which carry no derivative), and take `jax.vmap`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfp8 import _checks, _planning, _platform
from jaxfp8 import _transforms as transforms
from jaxfp8.moe import topk

KERNEL_MODULE = "pallas_kernels.route_topk_mosaic"
IMPLEMENTATIONS = ("mosaic", "xla", "xla_merge")
# Off Hopper, XLA's choice in this form: "xla", the compare-and-count top-k (a chain of fused reductions, a kernel
# each), or "xla_merge", each row's k best as one reduction over sorted lists (`topk.best_lists`).
XLA_DEFAULT = {"sigmoid": "xla", "softmax": "xla"}  # per scoring: DeepSeek-V3's sigmoid, Qwen3-MoE's softmax
# On Hopper, per scoring, the token counts (inclusive) where the merged form runs by default; outside them
# DeepSeek-V3's choice is XLA_DEFAULT's form and Qwen3-MoE's the Mosaic router from MOSAIC_MIN_TOKENS (else XLA's).
# H100, CUPTI, scripts/ab_router_kernel.py (the routers alone, same logits, same ids), us at 1 / 8 / 64 / 512 / 4096
# tokens: DeepSeek-V3 "xla" 5.95 / 6.29 / 11.3 / 17.9 / 33.8, "xla_merge" 8.74 / 9.66 / 9.95 / 15.4 / 70.8;
# Qwen3-MoE "xla" 4.90 / 6.45 / 10.6 / 16.4 / 23.8, "xla_merge" 5.31 / 4.93 / 5.12 / 5.22 / 11.1, the Mosaic router
# 5.68 / 5.66 / 5.68 / 6.02 / 7.33. The bands end at the last measured point each form led.
MERGED_TOKENS = {"sigmoid": (64, 512), "softmax": (8, 512)}
# From this many tokens the Mosaic router runs by default on Hopper, past the merged band, per scoring (None: never
# by default). Qwen3's softmax over 128 experts: 7.3 us at 4096 tokens against the merged form's 11.1 (above).
# DeepSeek-V3's sigmoid over 256 experts (two 128-column chunks in a loop) takes 33-36 us at every T alone, and
# inside the MoE layer loses at every T, 4096 tokens included (36 / 39 / 97 us against XLA's 13 / 22 / 73 at 1 / 64 /
# 4096 tokens, H100): off.
MOSAIC_MIN_TOKENS = {"sigmoid": None, "softmax": 513}


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


class RoutePlan(_planning.StepPlan):
  STEP = "router top-k"


_XLA_FORMS = {"xla": "XLA's compare-and-count top-k", "xla_merge": "XLA's top-k as one reduction over sorted lists"}


def plan(router, tokens: int, experts: int, dtype, implementation: str | None = None, interpret: bool | None = None,
         device: _platform.Device | None = None) -> RoutePlan:
  """The plan of `router` on logits (tokens, experts) of dtype: on Hopper the merged form within MERGED_TOKENS, the
  Mosaic kernel from MOSAIC_MIN_TOKENS where it takes the problem; else XLA's choice in the form XLA_DEFAULT names.
  `implementation` overrides (a ValueError says why the Mosaic one cannot run here)."""
  _checks.one_of("implementation", implementation, IMPLEMENTATIONS)
  interpret = _platform.resolve_interpret(_checks.interpret(interpret))
  device = device or _platform.device()
  if implementation in _XLA_FORMS:
    return RoutePlan(implementation, None, interpret, f"implementation={implementation!r} was asked for")

  def xla(why: str) -> RoutePlan:
    form = XLA_DEFAULT[router.SCORING]
    return RoutePlan(form, None, interpret, f"{_XLA_FORMS[form]} ({why})")

  why = _platform.unavailable_reason("the Mosaic GPU router", device, interpret, hopper=True, module=KERNEL_MODULE)
  spec = None if why else router.kernel_routing()
  if not why and (problems := _kernel().problems(experts, dtype, spec)):
    why = "; ".join(problems)
  if implementation is None:
    if device.capability is None or (interpret and not device.is_hopper):
      return xla(f"no Hopper GPU (device {device.describe()}); name implementation='mosaic' to interpret the kernel")
    lo, hi = MERGED_TOKENS[router.SCORING]
    if device.is_hopper and lo <= tokens <= hi:
      return RoutePlan("xla_merge", None, interpret, f"{_XLA_FORMS['xla_merge']} ({tokens} tokens in [{lo}, {hi}]: "
                       "measured ahead of the other forms there on Hopper)")
    if why:
      return xla(f"the Mosaic router cannot run: {why}")
    least = MOSAIC_MIN_TOKENS[spec.scoring]
    if least is None:
      return xla(f"the Mosaic router's {spec.scoring} scoring measured slower than XLA's inside the MoE layer at "
                 "every token count; implementation='mosaic' runs it")
    if tokens < least:
      return xla(f"{tokens} tokens < {least}: its few kernels measured ahead of the Mosaic router's one")
    return RoutePlan("mosaic", spec, interpret, f"Hopper GPU {device.describe()}: one Mosaic GPU kernel for the "
                     f"whole choice of {tokens} tokens (XLA runs it as a chain of small reductions, a kernel each)")
  if why:
    raise ValueError(f"implementation='mosaic' cannot run here: {why}; use implementation='xla'")
  return RoutePlan("mosaic", spec, interpret, "implementation='mosaic' was asked for")


def _route(router, p: RoutePlan, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(ids, weights) of logits (T, E) by `p`'s implementation."""

  def kernel(logits, bias):
    return _kernel().route_topk(logits, bias if router.uses_correction_bias else None, routing=p.config,
                                interpret=p.interpret)

  def vmap_rule(axis_size, in_batched, logits, bias):
    if not in_batched[0]:
      logits = jnp.broadcast_to(logits, (axis_size, *logits.shape))
    if in_batched[1]:  # a bias per batch entry: one kernel call cannot take them; XLA's choice, the same contract
      return jax.vmap(router.choose)(logits, bias), (True, True)
    ids, weights = kernel(logits.reshape(-1, logits.shape[-1]), bias)
    return (ids.reshape(axis_size, -1, ids.shape[-1]), weights.reshape(axis_size, -1, weights.shape[-1])), (True, True)

  # XLA's forms batch as they are; they pick the weights as bits in a variadic reduction (no derivative), so every
  # form takes the weights' derivative from the gather below
  xla = {"xla": router.choose, "xla_merge": router.choose_merged}
  chosen = xla.get(p.implementation) or transforms.batched(kernel, vmap_rule)

  @jax.custom_jvp
  def route(logits, bias):
    return chosen(logits, bias)

  @route.defjvp
  def route_jvp(primals, tangents):
    # The weights' derivative is that of the chosen experts' XLA weights (the ids are discrete: no tangent).
    ids, weights = route(*primals)
    _, weights_dot = jax.jvp(lambda l, b: router.weights_of(l, b, ids), primals, tangents)
    return (ids, weights), (np.zeros(ids.shape, jax.dtypes.float0), weights_dot)

  return route(logits, jnp.zeros((logits.shape[-1],), jnp.float32) if bias is None else bias)


def _in_order_sum(weights: jax.Array) -> jax.Array:
  """(..., 1): the k weights of each token summed in slot order, as elementwise adds (no reduction kernel: they
  fuse with the choice's last pass)."""
  return functools.reduce(jnp.add, [weights[..., j:j + 1] for j in range(weights.shape[-1])])


def _token_rows(router: str, logits) -> tuple[tuple[int, ...], int]:
  """(the tokens' leading shape, E) of logits (..., E), checked."""
  _checks.array("logits", logits, _checks.FLOAT_DTYPES, ndim=None)
  if len(logits.shape) < 1:
    raise ValueError(f"{router}: logits must be (..., E), one row of E expert logits per token, got shape "
                     f"{tuple(logits.shape)}")
  return tuple(logits.shape[:-1]), logits.shape[-1]


def _nan_tokens_get_nan(nan: jax.Array, weights: jax.Array) -> jax.Array:
  """§8's NaN rule: the weights (T, k) of a token whose routing values (the values its experts are ranked by) hold a
  NaN (`nan`, (T,)) are all NaN. `lax.top_k` ranks a NaN by its sign bit (a negative NaN below -inf), so a NaN would
  otherwise be ranked out of the choice and the token routed on finite weights; transformers' torch.topk ranks NaN
  first, which makes that token's output NaN."""
  return jnp.where(nan[:, None], jnp.float32(jnp.nan), weights)


def _rounded(x: jax.Array) -> jax.Array:
  """x as it is stored: XLA's GPU compiler folds a narrowing convert followed by a widening one (simplify-fp-
  conversions), which would route on values the contract rounds; an optimization barrier keeps the rounding."""
  return x if jnp.dtype(x.dtype) == jnp.float32 else lax.optimization_barrier(x)


class _Routed:
  """What both routers do alike around their own choice: plan it, run it on (T, E) logits, reshape back."""

  def explain(self, logits, *, implementation: str | None = None, interpret: bool | None = None,
              device: _platform.Device | None = None) -> RoutePlan:
    """The plan a call on logits of this shape and dtype (an array or `jax.ShapeDtypeStruct`) runs, and why."""
    lead, e = _token_rows(type(self).__name__, logits)
    self.validate(e)
    return plan(self, math.prod(lead), e, logits.dtype, implementation, interpret, device)

  def _run(self, logits, correction_bias, implementation, interpret) -> tuple[jax.Array, jax.Array]:
    """(ids, weights) of checked logits (..., E) in their leading shape."""
    lead, e = tuple(logits.shape[:-1]), logits.shape[-1]
    p = plan(self, math.prod(lead), e, logits.dtype, implementation, interpret)
    ids, weights = _route(self, p, logits.reshape(-1, e), correction_bias)
    return ids.reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Router(_Routed):
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
  SCORING = "sigmoid"

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

  def kernel_routing(self):
    return _kernel().TopkRouting("sigmoid", self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                                 float(self.routed_scaling_factor))

  def __call__(self, logits: jax.Array, correction_bias: jax.Array | None, *, implementation: str | None = None,
               interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """logits (..., E), correction_bias (E,) -> (ids int32 (..., top_k), weights float32 (..., top_k)).
    implementation: "mosaic", "xla", "xla_merge" or None (`explain` says which runs and why)."""
    lead, e = _token_rows("DeepSeekV3Router", logits)
    self.validate(e)
    if correction_bias is None:
      raise ValueError(f"DeepSeekV3Router needs correction_bias (the checkpoint's e_score_correction_bias, (E,) = "
                       f"({e},)), got None")
    _checks.array("correction_bias", correction_bias, _checks.FLOAT_DTYPES, ndim=None)
    if tuple(correction_bias.shape) != (e,):
      raise ValueError(f"correction_bias must have shape (E,) = ({e},), one per expert of logits of shape "
                       f"{tuple(logits.shape)}, got {tuple(correction_bias.shape)}")
    return self._run(logits, correction_bias.astype(jnp.float32), implementation, interpret)

  def choose(self, logits: jax.Array, correction_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """XLA's choice on checked logits (T, E) and correction_bias (E,), compare-and-count: at decode three
    reductions and five kernels for sm_90 (scripts/xla_gpu_kernels.py): the group scores with each group's NaN flag
    (one pass over each group's entries, the sigmoid scores fused in), the masked biased scores' keys (each group's
    rank among the groups a sum of n_group elementwise compares inside them), the experts' ranks, the ids and
    weights picked together, the weights normalized."""
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)[None, :]
    group_scores, group_nan = topk.two_best_summed(choice.reshape(t, self.n_group, e // self.n_group))
    allowed = topk.in_top_k(group_scores, self.topk_group)  # the topk_group best groups
    masked = jnp.where(jnp.repeat(allowed, e // self.n_group, axis=1), choice, -jnp.inf)
    # the masked keys apart: else XLA's GPU compiler materializes the (E, E) compares of the ranks, recomputing the
    # sigmoid scores and the groups' choice in them, in a kernel of their own (7 kernels at one token, 5 so)
    ids, weights = topk.top_k(masked, self.top_k, scores, apart=True)
    return ids, _nan_tokens_get_nan(topk.any_along(group_nan), self._normalized(weights))

  def choose_merged(self, logits: jax.Array, correction_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """XLA's choice in the merged form: each group's best entries in one reduction (its first two summed are the
    group's score), the groups ranked, and the lists (the other groups' at -inf) merged by a second reduction over
    the groups: `choose`'s ids bit for bit on every token without a NaN (§8 leaves a NaN token's ids open), its
    weights to float32 rounding."""
    t, e = logits.shape
    g, n = self.n_group, e // self.n_group
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)[None, :]
    p = topk.list_length(max(self.top_k, 2))
    index = (lax.broadcasted_iota(jnp.int32, (t, g, n), 2) + n * lax.broadcasted_iota(jnp.int32, (t, g, n), 1))
    best, nan = topk.best_lists(topk.order_keys(choice).reshape(t, g, n), p, index,
                                (topk.bits(scores).reshape(t, g, n),), jnp.isnan(choice).reshape(t, g, n))
    two = topk.key_value(best[0][0]) + topk.key_value(best[1][0])  # each group's two best summed (n >= 2: both real)
    group_key = topk.order_keys(jnp.where(jnp.isnan(two), -jnp.inf, two))  # a NaN sum (inf + -inf) ranks last
    # a group's rank: the groups that beat it (a higher score, or an equal one at a lower index)
    h, j = lax.broadcasted_iota(jnp.int32, (g, g), 1), lax.broadcasted_iota(jnp.int32, (g, g), 0)
    beats = jnp.where(h < j, group_key[:, None, :] >= group_key[:, :, None],
                      group_key[:, None, :] > group_key[:, :, None]) & (h != j)
    chosen = jnp.sum(beats, axis=-1) < self.topk_group  # (t, g)
    # outside the chosen groups every biased score is -inf: the group's best are then its lowest indices
    group = lax.broadcasted_iota(jnp.int32, (t, g), 1)
    masked_key = topk.order_keys(jnp.float32(-jnp.inf))
    lists = []
    for i in range(p):
      masked = ((jnp.full((t, g), masked_key), group * n + i, topk.bits(scores.reshape(t, g, n)[:, :, i])) if i < n
                else tuple(jnp.full((t, g), v, jnp.int32) for v in (*topk.NO_ENTRY, np.int32(0))))
      lists.append(topk.either(chosen, best[i], masked))
    # the groups' lists merged by a second reduction over the groups (unrolled, XLA's compilers copy the merges'
    # shared compares into every consumer: a program hundreds of times larger)
    merged, any_nan = topk.merged_along(lists, 1, nan)
    ids, weights = topk.ids_and_weights(merged, self.top_k)
    return ids, _nan_tokens_get_nan(any_nan, self._normalized(weights))

  def _normalized(self, weights: jax.Array) -> jax.Array:
    """The chosen scores normalized (with norm_topk_prob) and scaled."""
    if self.norm_topk_prob:
      weights = weights / (_in_order_sum(weights) + 1e-20)
    return weights * jnp.float32(self.routed_scaling_factor)

  def weights_of(self, logits: jax.Array, correction_bias: jax.Array, ids: jax.Array) -> jax.Array:
    """The weights of the experts `ids` (T, k) chose from logits (T, E): their scores, gathered (differentiable in
    the logits, exact values), normalized."""
    del correction_bias  # it moves the choice only
    return self._normalized(jnp.take_along_axis(jax.nn.sigmoid(logits.astype(jnp.float32)), ids, axis=-1))


@dataclasses.dataclass(frozen=True)
class Qwen3MoeRouter(_Routed):
  """Qwen3-MoE: softmax over the experts, the top_k, renormalized with norm_topk_prob. Defaults are
  Qwen3-30B-A3B's config.json."""
  top_k: int = 8
  norm_topk_prob: bool = True

  def validate(self, num_experts: int) -> None:
    _checks.positive_int("top_k", self.top_k)
    if self.top_k > num_experts:
      raise ValueError(f"top_k={self.top_k} exceeds the number of experts {num_experts}")

  uses_correction_bias = False
  SCORING = "softmax"

  @staticmethod
  def logits(x: jax.Array, gate_weight: jax.Array) -> jax.Array:
    """The router logits (..., E) from x (..., H) and the gate's weight (E, H): a linear in x's dtype (float32
    accumulation, rounded to x's dtype), as Qwen3-MoE's model computes them."""
    return _rounded(jnp.einsum("...h,eh->...e", x, gate_weight.astype(x.dtype), preferred_element_type=jnp.float32,
                               precision=lax.Precision.HIGHEST).astype(x.dtype))

  def kernel_routing(self):
    return _kernel().TopkRouting("softmax", self.top_k, norm_topk_prob=self.norm_topk_prob)

  def __call__(self, logits: jax.Array, correction_bias: jax.Array | None = None, *,
               implementation: str | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """logits (..., E) -> (ids int32 (..., top_k), weights float32 (..., top_k)). Qwen3 has no correction bias.
    implementation: "mosaic", "xla", "xla_merge" or None (`explain` says which runs and why)."""
    lead, e = _token_rows("Qwen3MoeRouter", logits)
    if correction_bias is not None:
      raise ValueError("Qwen3MoeRouter takes no correction_bias (that is DeepSeek-V3's router), got an array of "
                       f"shape {tuple(getattr(correction_bias, 'shape', ()))}")
    self.validate(e)
    return self._run(logits, None, implementation, interpret)

  def choose(self, logits: jax.Array, correction_bias=None) -> tuple[jax.Array, jax.Array]:
    """XLA's choice on checked logits (T, E), compare-and-count (`topk.top_k_weighed`: the picks as sibling
    reductions, which XLA's GPU compiler fuses with the softmax)."""
    del correction_bias
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    ids, weights = topk.top_k_weighed(probs, self.top_k, probs)
    return ids, _nan_tokens_get_nan(jnp.isnan(probs).any(-1), self._normalized(weights))

  def choose_merged(self, logits: jax.Array, correction_bias=None) -> tuple[jax.Array, jax.Array]:
    """XLA's choice in the merged form: with norm_topk_prob, the top_k of each token's logits in one reduction and
    their softmax over the k alone (exp(l - max) / its k-term sum: the full softmax's denominator cancels, so no
    softmax kernel runs); the softmax's order is the logits' (ties to the lower index either way: the ids differ from
    `choose`'s only where two distinct logits round to one probability, a tie to float32 rounding), the weights to
    float32 rounding. Without it, the top_k of the probabilities (`choose`'s ids bit for bit)."""
    del correction_bias
    values = logits.astype(jnp.float32)
    if self.norm_topk_prob:
      # the probabilities hold a NaN where a logit is NaN or +inf (inf / inf)
      # -0.0 and +0.0 are one probability: one key (then the lower index wins, as among equal probabilities)
      best, nan = topk.best_lists(topk.order_keys(jnp.where(values == 0, 0.0, values)), topk.list_length(self.top_k),
                                  flag=jnp.isnan(values) | (values == jnp.inf))
      ids = jnp.stack([e[1] for e in best[:self.top_k]], axis=-1)
      top = jnp.stack([topk.key_value(e[0]) for e in best[:self.top_k]], axis=-1)
      weights = jnp.exp(top - top[..., :1])  # the first is the row's largest logit
      return ids, _nan_tokens_get_nan(nan, weights / _in_order_sum(weights))
    probs = jax.nn.softmax(values, axis=-1)
    best, nan = topk.best_lists(topk.order_keys(probs), topk.list_length(self.top_k), payloads=(topk.bits(probs),),
                                flag=jnp.isnan(probs))
    ids, weights = topk.ids_and_weights(best, self.top_k)
    return ids, _nan_tokens_get_nan(nan, weights)

  def _normalized(self, weights: jax.Array) -> jax.Array:
    """The chosen probabilities renormalized (with norm_topk_prob)."""
    return weights / _in_order_sum(weights) if self.norm_topk_prob else weights

  def weights_of(self, logits: jax.Array, correction_bias, ids: jax.Array) -> jax.Array:
    """The weights of the experts `ids` (T, k) chose from logits (T, E) (differentiable in the logits)."""
    del correction_bias
    return self._normalized(jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), ids, axis=-1))


Router = DeepSeekV3Router | Qwen3MoeRouter
