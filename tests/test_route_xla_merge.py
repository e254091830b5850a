"""The routers' implementation="xla_merge" (jaxfp8/moe/routing.py): each row's k best as one reduction over sorted
lists, DeepSeek-V3's group choice merged elementwise after it.

On CPU: the list reduction against `lax.top_k` bit for bit (ids, values and carried payloads; ties, infinities,
NaN of both signs, the least key), each router's ids against implementation="xla" bit for bit (Qwen3-MoE's ranked by
its logits: equal but where two logits round to one probability) and its weights to float32 rounding (ties, signed
zeros and infinities in logits and bias), the float64 reference, §8's NaN rule, gradients and vmap
as the other implementations give them, and the plan's reasons.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxfp8 import moe
from jaxfp8 import reference as ref
from jaxfp8.moe import routing, topk

from test_moe import _assert_routes, _deepseek_margin, _margins, top_k_values
from test_moe_hardening import _assert_nan_rule, _poisoned_logits

@pytest.mark.parametrize("shape, k", [((300, 256), 8), ((5, 8, 32), 2), ((7, 8), 4), ((1, 256), 8), ((3, 2), 2),
                                      ((4, 5), 5), ((6, 3), 1), ((9, 128), 3)])
@pytest.mark.parametrize("kind", ["normal", "ties", "specials"])
def test_best_lists_are_lax_top_k_bit_for_bit(rng, shape, k, kind):
  v = top_k_values(rng, shape, kind)
  other = rng.standard_normal(shape).astype(np.float32)
  flag = rng.random(shape) < 0.05
  want_v, want_i = (np.asarray(a) for a in lax.top_k(jnp.asarray(v), k))
  p = topk.list_length(k)
  assert p >= k and p & (p - 1) == 0
  best, any_flag = jax.jit(lambda v, o, f: topk.best_lists(topk.order_keys(v), p,
                                                               payloads=(topk.bits(v), topk.bits(o)),
                                                               flag=f))(jnp.asarray(v), jnp.asarray(other), flag)
  assert len(best) == p
  ids = np.stack([np.asarray(e[1]) for e in best[:k]], -1)
  np.testing.assert_array_equal(ids, want_i)
  assert np.stack([np.asarray(topk.as_float(e[2])) for e in best[:k]], -1).tobytes() == want_v.tobytes()
  assert (np.stack([np.asarray(topk.as_float(e[3])) for e in best[:k]], -1).tobytes()
          == np.take_along_axis(other, want_i, -1).tobytes())
  # the keys come back as they went in, and past the row's length the entries rank after every real one
  assert (np.stack([np.asarray(topk.key_value(e[0])) for e in best[:k]], -1).tobytes() == want_v.tobytes())
  for e in best[shape[-1]:]:
    assert (np.asarray(e[1]) == np.iinfo(np.int32).max).all()
  np.testing.assert_array_equal(np.asarray(any_flag), flag.any(-1))


DEEPSEEK_CONFIGS = [(256, 8, 4, 8), (64, 8, 3, 6), (16, 4, 2, 3), (12, 6, 3, 3), (8, 4, 4, 1), (8, 1, 1, 2)]


def _deepseek_inputs(rng, e, kind):
  logits = (rng.standard_normal((97, e)) * 2).astype(np.float32)
  bias = (rng.standard_normal(e) * 0.5).astype(np.float32)
  if kind == "ties":
    logits, bias = np.round(logits), np.round(bias * 2) / 2
  if kind == "infinities":  # sigmoid(+-inf) = 1 or 0; a group of +inf and -inf biases sums to NaN and ranks last
    flat = logits.reshape(-1)
    where = rng.choice(flat.size, flat.size // 6, replace=False)
    flat[where] = rng.choice(np.array([np.inf, -np.inf, 0.0, -0.0, 30, -30], np.float32), where.size)
    bias[rng.choice(e, 2, replace=False)] = [np.inf, -np.inf]
  return jnp.asarray(logits), jnp.asarray(bias)


@pytest.mark.parametrize("e,n_group,topk_group,top_k", DEEPSEEK_CONFIGS)
@pytest.mark.parametrize("kind", ["normal", "ties", "infinities"])
def test_deepseek_v3_merge_chooses_as_xla_does(rng, e, n_group, topk_group, top_k, kind):
  router = moe.DeepSeekV3Router(top_k=top_k, n_group=n_group, topk_group=topk_group)
  logits, bias = _deepseek_inputs(rng, e, kind)
  want_ids, want_weights = jax.jit(lambda l, b: router(l, b, implementation="xla"))(logits, bias)
  ids, weights = jax.jit(lambda l, b: router(l, b, implementation="xla_merge"))(logits, bias)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=8 * 2.0**-24, atol=0)


@pytest.mark.parametrize("e,top_k", [(128, 8), (60, 4), (8, 2), (5, 5), (3, 1)])
@pytest.mark.parametrize("kind", ["normal", "ties", "bfloat16", "infinities"])
@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_merge_chooses_as_xla_does(rng, e, top_k, kind, norm):
  """Ties (integers, signed zeros, bfloat16 logits as the model rounds them) go to the lower index in both forms;
  -inf is probability 0; a token with +inf gets NaN weights in both (its ids are then any k distinct experts)."""
  router = moe.Qwen3MoeRouter(top_k=top_k, norm_topk_prob=norm)
  logits = (rng.standard_normal((97, e)) * 2).astype(np.float32)
  if kind == "ties":
    logits = np.round(logits)
  if kind == "infinities":
    flat = logits.reshape(-1)
    where = rng.choice(flat.size, flat.size // 10, replace=False)
    flat[where] = rng.choice(np.array([np.inf, -np.inf, -np.inf, -np.inf], np.float32), where.size)
  logits = jnp.asarray(logits, jnp.bfloat16 if kind == "bfloat16" else jnp.float32)
  want_ids, want_weights = (np.asarray(a) for a in router(logits, implementation="xla"))
  ids, weights = (np.asarray(a) for a in router(logits, implementation="xla_merge"))
  nan = np.isnan(want_weights).any(-1)
  np.testing.assert_array_equal(np.isnan(weights).any(-1), nan)
  np.testing.assert_array_equal(np.isnan(weights).all(-1), nan)
  np.testing.assert_array_equal(ids[~nan], want_ids[~nan])
  np.testing.assert_allclose(weights[~nan], want_weights[~nan], rtol=8 * 2.0**-24, atol=0)
  assert all(len(set(row)) == top_k and 0 <= row.min() and row.max() < e for row in ids)


@pytest.mark.parametrize("e,n_group,topk_group,top_k,norm", [(256, 8, 4, 8, True), (64, 8, 3, 6, False)])
def test_deepseek_v3_merge_matches_reference(rng, e, n_group, topk_group, top_k, norm):
  router = moe.DeepSeekV3Router(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
  logits = (rng.standard_normal((97, e)) * 2).astype(np.float32)
  bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
  ids, weights = router(jnp.asarray(logits), jnp.asarray(bias), implementation="xla_merge")
  want = ref.deepseek_v3_route(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                               routed_scaling_factor=router.routed_scaling_factor, norm_topk_prob=norm)
  _assert_routes(ids, weights, *want, _deepseek_margin(logits, bias, router))


def test_qwen3_merge_matches_reference(rng):
  router = moe.Qwen3MoeRouter(top_k=8)
  logits = (rng.standard_normal((97, 128)) * 2).astype(np.float32)
  ids, weights = router(jnp.asarray(logits), implementation="xla_merge")
  probs = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
  _assert_routes(ids, weights, *ref.qwen3_moe_route(logits, top_k=8), _margins(probs / probs.sum(-1, keepdims=True), 8))


def test_merge_follows_the_nan_rule(rng):
  deepseek = moe.DeepSeekV3Router()
  logits = _poisoned_logits(rng, 211, 256)
  bias = (rng.standard_normal(256) * 0.1).astype(np.float32)
  ids, weights = router_out = deepseek(jnp.asarray(logits), jnp.asarray(bias), implementation="xla_merge")
  want = ref.deepseek_v3_route(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
  with np.errstate(invalid="ignore", over="ignore"):
    margin = _deepseek_margin(logits, bias, deepseek)
  _assert_nan_rule(*router_out, *want, margin, 256)
  bias[3] = np.nan  # a NaN bias entry is in every token's choice
  assert np.isnan(np.asarray(deepseek(jnp.asarray(logits), jnp.asarray(bias), implementation="xla_merge")[1])).all()
  qwen3 = moe.Qwen3MoeRouter()
  logits = _poisoned_logits(rng, 211, 128)
  with np.errstate(invalid="ignore", over="ignore"):
    probs = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    margin = _margins(probs / probs.sum(-1, keepdims=True), 8)
  _assert_nan_rule(*qwen3(jnp.asarray(logits), implementation="xla_merge"), *ref.qwen3_moe_route(logits, top_k=8),
                   margin, 128)
  del ids, weights


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_merge_gradients_and_vmap_are_xla_s(rng, family):
  """The weights' derivative in the logits (through the chosen experts' gathered scores) and vmap over a batch of
  token sets, against implementation="xla"."""
  if family == "deepseek_v3":
    router, e = moe.DeepSeekV3Router(top_k=4, n_group=4, topk_group=2), 32
    bias = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32)
  else:
    router, e, bias = moe.Qwen3MoeRouter(top_k=4), 32, None
  logits = jnp.asarray(rng.standard_normal((3, 11, e)) * 2, jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((11, 4)), jnp.float32)

  def loss(implementation):
    return lambda l: jnp.sum(router(l, bias, implementation=implementation)[1] * cotangent)

  for one in logits:
    np.testing.assert_allclose(np.asarray(jax.grad(loss("xla_merge"))(one)), np.asarray(jax.grad(loss("xla"))(one)),
                               rtol=1e-5, atol=1e-7)
  batched = jax.vmap(lambda l: router(l, bias, implementation="xla_merge"))(logits)
  for i, one in enumerate(logits):
    ids, weights = router(one, bias, implementation="xla")
    np.testing.assert_array_equal(np.asarray(batched[0][i]), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(batched[1][i]), np.asarray(weights), rtol=8 * 2.0**-24, atol=0)


def test_plan_names_the_xla_form(monkeypatch):
  logits = jax.ShapeDtypeStruct((4, 256), jnp.float32)
  router = moe.DeepSeekV3Router()
  named = router.explain(logits, implementation="xla_merge")
  assert named.implementation == "xla_merge" and "asked for" in named.reason
  for form, words in (("xla", "compare-and-count"), ("xla_merge", "one reduction over sorted lists")):
    monkeypatch.setitem(routing.XLA_DEFAULT, "sigmoid", form)
    chosen = router.explain(logits)
    assert chosen.implementation == form and words in chosen.reason, chosen
  # each family's default is its own: Qwen3-MoE's softmax scoring takes the merged form, DeepSeek-V3 stays
  monkeypatch.setitem(routing.XLA_DEFAULT, "sigmoid", "xla")
  monkeypatch.setitem(routing.XLA_DEFAULT, "softmax", "xla_merge")
  assert moe.Qwen3MoeRouter().explain(jax.ShapeDtypeStruct((4, 128), jnp.float32)).implementation == "xla_merge"
  assert router.explain(logits).implementation == "xla"
  for each in (router, moe.Qwen3MoeRouter()):
    assert each.kernel_routing().scoring == each.SCORING
  with pytest.raises(ValueError, match="implementation must be one of"):
    router.explain(logits, implementation="xla_sorted")


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_merged_choice_is_one_reduction(tokens):
  """The merged form's reductions at every token count: DeepSeek-V3 three (the groups' lists, the groups' ranks, the
  lists merged over the groups with the NaN flag's OR; an unrolled merge made XLA's program hundreds of
  times larger), Qwen3-MoE with norm_topk_prob one (the logits' list, the softmax over the k alone; without it the
  softmax's two come first); the compare-and-count form takes as many at decode (test_moe), more past
  PAIRWISE_MAX_COMPARES."""
  deepseek, qwen3 = moe.DeepSeekV3Router(), moe.Qwen3MoeRouter()

  def reductions(router, e, implementation):
    bias = jnp.zeros((e,), jnp.float32) if router.uses_correction_bias else None
    text = jax.jit(lambda l: router(l, bias, implementation=implementation)).lower(
        jax.ShapeDtypeStruct((tokens, e), jnp.float32)).as_text()
    return text.count("stablehlo.reduce")

  assert reductions(deepseek, 256, "xla_merge") == 3 and reductions(qwen3, 128, "xla_merge") == 1
  assert reductions(moe.Qwen3MoeRouter(norm_topk_prob=False), 128, "xla_merge") == 3
  assert reductions(deepseek, 256, "xla") >= 3
