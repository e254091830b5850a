"""The Mosaic GPU router top-k (pallas_kernels/route_topk_mosaic.py) behind the routers' implementation="mosaic":
interpreted on CPU against XLA's choice (the same ids, bit for bit, as `lax.top_k` on the same values) and the
float64 reference on fresh random logits, ties, NaN and infinities, odd token counts, every option; lowered for an
H200 at the models' sizes; natively on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import _platform, reference
from jaxfp8.moe import routing, topk
from helpers import backend_importable, fake_device, kernel_calls

IMPORTABLE = backend_importable(routing.KERNEL_MODULE)
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason=f"{routing.KERNEL_MODULE} does not import here")

DEEPSEEK = routing.DeepSeekV3Router()
QWEN3 = routing.Qwen3MoeRouter()


def _logits(rng, t, e, dtype=np.float32, scale=2.0):
  return jnp.asarray((rng.standard_normal((t, e)) * scale).astype(np.float32)).astype(dtype)


def _bias(rng, e):
  return jnp.asarray((rng.standard_normal(e) * 0.1).astype(np.float32))


def _both(router, logits, bias, interpret=True):
  mosaic = router(logits, bias, implementation="mosaic", interpret=interpret)
  xla = router(logits, bias, implementation="xla")
  return [tuple(np.asarray(a) for a in pair) for pair in (mosaic, xla)]


def _assert_same_choice(router, logits, bias, interpret=True):
  (ids, weights), (xla_ids, xla_weights) = _both(router, logits, bias, interpret)
  np.testing.assert_array_equal(ids, xla_ids)
  np.testing.assert_allclose(weights, xla_weights, rtol=4e-7, atol=1e-7)
  return ids, weights


@pytest.mark.parametrize("t", [1, 9, 64, 70])  # one token, a partial tile, one whole tile, a second tile
def test_deepseek_v3_matches_xla_and_the_reference(rng, t):
  logits, bias = _logits(rng, t, 256), _bias(rng, 256)
  ids, weights = _assert_same_choice(DEEPSEEK, logits, bias)
  ref_ids, ref_weights = reference.deepseek_v3_route(np.asarray(logits), np.asarray(bias), top_k=8, n_group=8,
                                                     topk_group=4, routed_scaling_factor=2.5)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(weights, ref_weights, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("t", [1, 5, 65])
def test_qwen3_matches_xla_and_the_reference(rng, t, dtype):
  logits = _logits(rng, t, 128, dtype)
  ids, weights = _assert_same_choice(QWEN3, logits, None)
  ref_ids, ref_weights = reference.qwen3_moe_route(np.asarray(logits.astype(jnp.float32)), top_k=8)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_allclose(weights, ref_weights, rtol=2e-6)


@pytest.mark.parametrize("router, e", [
    (routing.DeepSeekV3Router(top_k=6, n_group=4, topk_group=2, routed_scaling_factor=1.5), 64),
    (routing.DeepSeekV3Router(top_k=1, n_group=1, topk_group=1, norm_topk_prob=False), 32),
    (routing.DeepSeekV3Router(top_k=10, n_group=2, topk_group=1), 192),
    (routing.Qwen3MoeRouter(top_k=3, norm_topk_prob=False), 40),
    (routing.Qwen3MoeRouter(top_k=12), 256),
])
def test_every_option(rng, router, e):
  bias = _bias(rng, e) if router.uses_correction_bias else None
  _assert_same_choice(router, _logits(rng, 11, e), bias)


def test_ties_go_to_the_lower_expert(rng):
  """Logits from a handful of values: every row is full of ties, at every rank and in the group scores."""
  values = np.array([-1.0, 0.0, 0.5, 2.0], np.float32)
  logits = jnp.asarray(values[rng.integers(0, 4, (70, 256))])
  bias = jnp.asarray(values[rng.integers(0, 4, 256)] * 0.25)
  _assert_same_choice(DEEPSEEK, logits, bias)
  _assert_same_choice(QWEN3, logits[:, :128], None)
  _assert_same_choice(DEEPSEEK, jnp.zeros((3, 256), jnp.float32), jnp.zeros((256,), jnp.float32))


def test_nan_tokens_get_nan_weights_and_distinct_ids(rng):
  logits = np.array(_logits(rng, 9, 256))
  logits[2, 17] = np.nan
  logits[5, :] = np.nan
  logits[7, 3] = -np.nan
  for router, e, bias in ((DEEPSEEK, 256, _bias(rng, 256)), (QWEN3, 128, None)):
    ids, weights = (np.asarray(a) for a in router(jnp.asarray(logits[:, :e]), bias, implementation="mosaic",
                                                     interpret=True))
    poisoned = np.isnan(logits[:, :e]).any(-1)
    assert np.isnan(weights[poisoned]).all() and np.isfinite(weights[~poisoned]).all()
    assert all(len(set(row)) == router.top_k and row.min() >= 0 and row.max() < e for row in ids)
    _, (xla_ids, xla_weights) = _both(router, jnp.asarray(logits[:, :e]), bias)
    np.testing.assert_array_equal(ids[~poisoned], xla_ids[~poisoned])


def test_infinities_and_a_group_whose_sum_is_nan(rng):
  """sigmoid(+-inf) = 1 or 0; a bias of +inf and -inf in one group makes its two best sum to NaN: it ranks last."""
  logits = np.array(_logits(rng, 6, 256))
  logits[0, :4] = [np.inf, -np.inf, np.inf, -np.inf]
  bias = np.array(_bias(rng, 256))
  bias[32:34] = [np.inf, -np.inf]
  bias[64:66] = [np.inf, np.inf]
  _assert_same_choice(DEEPSEEK, jnp.asarray(logits), jnp.asarray(bias))
  _assert_same_choice(QWEN3, jnp.asarray(logits[:, :128]).at[1, 5].set(-jnp.inf), None)


def test_leading_shapes_vmap_and_gradient(rng):
  logits, bias = _logits(rng, 12, 256).reshape(3, 4, 256), _bias(rng, 256)
  mosaic = lambda l, b: DEEPSEEK(l, b, implementation="mosaic", interpret=True)
  xla = lambda l, b: DEEPSEEK(l, b, implementation="xla")
  for a, b in zip(mosaic(logits, bias), xla(logits, bias)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7)
  for a, b in zip(jax.vmap(mosaic, (0, None))(logits, bias), xla(logits, bias)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7)
  biases = jnp.stack([bias, -bias, bias * 2])  # a bias per batch entry: XLA's choice, the same result
  for a, b in zip(jax.vmap(mosaic)(logits, biases), jax.vmap(xla)(logits, biases)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7)
  loss = lambda f: (lambda l: jnp.sum(f(l, bias)[1] * jnp.arange(8.0)))
  grad = np.asarray(jax.grad(loss(xla))(logits))
  assert np.abs(grad).max() > 1e-3, "the weights must carry the logits' gradient"
  np.testing.assert_allclose(np.asarray(jax.grad(loss(mosaic))(logits)), grad, rtol=1e-5, atol=1e-7)


def test_the_plan_says_which_runs_and_why():
  logits = jax.ShapeDtypeStruct((4096, 256), jnp.float32)
  hopper = fake_device((9, 0))
  for router in (DEEPSEEK, QWEN3):
    least = routing.MOSAIC_MIN_TOKENS[router.kernel_routing().scoring]
    lo, hi = routing.MERGED_TOKENS[router.kernel_routing().scoring]
    for tokens in sorted({1, 7, 8, 63, 64, 512, 513, 4096, lo - 1, lo, hi, hi + 1}):
      chosen = router.explain(jax.ShapeDtypeStruct((tokens, 256), jnp.float32), device=hopper, interpret=False)
      if lo <= tokens <= hi:
        assert chosen.implementation == "xla_merge" and f"in [{lo}, {hi}]" in chosen.reason, chosen
      elif least is not None and tokens >= least:
        assert chosen.implementation == "mosaic" and "one Mosaic GPU kernel" in str(chosen)
      else:
        assert chosen.implementation == "xla" and ("tokens <" in chosen.reason or "slower than XLA's" in chosen.reason)
  # off Hopper the merged band does not apply: XLA_DEFAULT's form at every token count
  assert DEEPSEEK.explain(jax.ShapeDtypeStruct((64, 256), jnp.float32), device=fake_device((8, 9)),
                          interpret=False).implementation == "xla"
  assert DEEPSEEK.explain(logits, device=fake_device(None)).implementation == "xla"
  assert DEEPSEEK.explain(logits, device=fake_device((8, 9)), interpret=False).implementation == "xla"
  too_many = jax.ShapeDtypeStruct((4, 512), jnp.float32)
  plan = routing.Qwen3MoeRouter().explain(too_many, device=hopper, interpret=False)
  assert plan.implementation == "xla" and "up to 256" in plan.reason
  with pytest.raises(ValueError, match="implementation='mosaic' cannot run here: .*up to 256"):
    routing.Qwen3MoeRouter().explain(too_many, implementation="mosaic", device=hopper, interpret=False)
  with pytest.raises(ValueError, match="implementation must be one of"):
    DEEPSEEK.explain(logits, implementation="triton")


def test_problems_name_what_the_kernel_cannot_take():
  from pallas_kernels import route_topk_mosaic as k
  spec = k.TopkRouting("sigmoid", 8, 8, 4)
  assert not k.problems(256, jnp.float32, spec)
  assert any("multiple of 8" in p for p in k.problems(100, jnp.float32, k.TopkRouting("softmax", 8)))
  assert any("groups" in p for p in k.problems(200, jnp.float32, k.TopkRouting("sigmoid", 8, 8, 4)))
  assert any("passes of 128" in p for p in k.problems(200, jnp.float32, k.TopkRouting("softmax", 8)))
  assert any("float32, bfloat16" in p for p in k.problems(128, jnp.int32, k.TopkRouting("softmax", 8)))
  assert any("top_k" in p for p in k.problems(16, jnp.float32, k.TopkRouting("softmax", 17)))


@pytest.mark.parametrize("router, e, dtype, t", [(DEEPSEEK, 256, jnp.float32, 4096), (DEEPSEEK, 256, jnp.float32, 1),
                                                 (QWEN3, 128, jnp.bfloat16, 1), (QWEN3, 128, jnp.bfloat16, 100),
                                                 # odd widths: one chunk of 40 float32 experts, 8 bfloat16 ones
                                                 (routing.Qwen3MoeRouter(top_k=4), 40, jnp.float32, 5),
                                                 (routing.Qwen3MoeRouter(top_k=2), 8, jnp.bfloat16, 3)])
def test_lowers_for_an_h200_as_one_kernel(router, e, dtype, t):
  bias = jnp.zeros((e,), jnp.float32) if router.uses_correction_bias else None
  with _platform.abstract_h200():
    text = jax.export.export(jax.jit(lambda l: router(l, bias, implementation="mosaic")), platforms=["cuda"])(
        jax.ShapeDtypeStruct((t, e), dtype)).mlir_module()
  assert len(kernel_calls(text)) == 1
  assert "stablehlo.reduce" not in text, "the choice must run in the kernel, not in XLA reductions"


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("t", [1, 3, 7, 8, 64, 100, 4096])
def test_gpu_matches_xla(rng, t):
  if not _platform.is_hopper():
    pytest.skip("needs a Hopper GPU")
  logits, bias = _logits(rng, t, 256), _bias(rng, 256)
  _assert_same_choice(DEEPSEEK, logits, bias, interpret=False)
  _assert_same_choice(QWEN3, logits[:, :128].astype(jnp.bfloat16), None, interpret=False)
  assert DEEPSEEK.explain(logits).implementation == routing.plan(DEEPSEEK, t, 256, jnp.float32).implementation


def test_group_scores_are_the_two_best_summed(rng, monkeypatch):
  """XLA's group score: the largest sum over pairs of distinct entries (one fused reduction) equals the two best's
  sum, bit for bit, ties and infinities included (a NaN sum ranks last); past PAIRWISE_MAX_COMPARES, the two best by
  the top-k, then their sum. Beside it, whether the group holds a NaN (in the same reduction)."""
  values = np.array([-np.inf, -1.5, 0.0, 0.25, 0.25, 3.0, np.inf], np.float32)
  grouped = np.concatenate([values[rng.integers(0, 7, (40, 8, 32))],
                            (rng.standard_normal((40, 8, 32)) * 3).astype(np.float32)])
  top2 = -np.sort(-grouped.astype(np.float64), axis=-1)[..., :2].astype(np.float32)
  with np.errstate(invalid="ignore"):
    want = top2[..., 0] + top2[..., 1]
  want = np.where(np.isnan(want), -np.inf, want)
  for limit in (topk.PAIRWISE_MAX_COMPARES, 0):
    monkeypatch.setattr(topk, "PAIRWISE_MAX_COMPARES", limit)
    got, nan = jax.jit(lambda g: topk.two_best_summed(g))(jnp.asarray(grouped))  # traced anew
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), want.view(np.int32))
    assert not np.asarray(nan).any()
    poisoned = grouped.copy()
    poisoned.reshape(-1)[rng.choice(poisoned.size, 50, replace=False)] = np.float32(np.nan) * rng.choice([1, -1], 50)
    nan = np.asarray(jax.jit(lambda g: topk.two_best_summed(g)[1])(jnp.asarray(poisoned)))
    np.testing.assert_array_equal(nan, np.isnan(poisoned).any(-1))
    clean = ~nan  # groups without a NaN score as before
    np.testing.assert_array_equal(np.asarray(topk.two_best_summed(jnp.asarray(poisoned))[0])[clean].view(np.int32),
                                  want[clean].view(np.int32))
