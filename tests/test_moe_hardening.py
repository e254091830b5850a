"""The MoE layer's hardening (docs/CONTRACT.md §8, §4, §7): each test covers a class of input, generated.

- Routers: §8's NaN rule (a token whose routing values hold a NaN gets NaN weights, as transformers' torch.topk
  gives) against the float64 reference on logits with NaN, -NaN and +-inf in random places; logits of any leading
  shape; the errors naming the argument.
- Checkpoints: generated blocks round-trip; `save_hf_moe` refuses exactly what `load_hf_moe` refuses (one check);
  `experts=` validated; malformed checkpoints (an expert of other shapes, fused expert tensors, a missing expert or
  projection) refused naming the tensor and the expert.
- `Fp8MoE` checks its router weight and x at construction and at call.
- `moe.explain` and `grouped.plan_for` raise what the calls raise, and plan for a named device.
- Eager and jitted calls of `fp8_moe` / `Fp8MoE` run one computation: bit-identical, one compilation per shape.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import checkpoints, grouped, moe
from jaxfp8 import reference as ref
from jaxfp8.moe import weights as moe_weights
from jaxfp8.moe.weights import MoeWeights, load_hf_moe, save_hf_moe
from jaxfp8.weights import Fp8LinearWeight

import helpers
from test_moe import NEAR_TIE, TOL, _deepseek_margin, _experts, _margins, _moe_weights, _routing, _stacked

F8 = jnp.float8_e4m3fn
F32 = jnp.float32
NEG_NAN = np.copysign(np.float32(np.nan), np.float32(-1))  # sigmoid keeps its sign bit; lax.top_k ranks it last


# ------------------------------------------------------------------------------------------------ NaN and inf logits

def _poisoned_logits(rng, t, e):
  """(T, E) logits with a NaN, -NaN, +inf or -inf in 1..3 random places of about a fifth of the tokens."""
  logits = (rng.standard_normal((t, e)) * 2).astype(np.float32)
  for token in np.flatnonzero(rng.random(t) < 0.2):
    places = rng.choice(e, int(rng.integers(1, 4)), replace=False)
    logits[token, places] = rng.choice(np.array([np.nan, NEG_NAN, np.inf, -np.inf], np.float32), len(places))
  return logits


def _assert_nan_rule(ids, weights, want_ids, want_weights, margin, e):
  """NaN weights on exactly the reference's tokens, all of a token's or none; every row distinct ids in [0, E);
  the other tokens' choice and weights as the reference's where they are clear of near-ties."""
  ids, weights = np.asarray(ids), np.asarray(weights)
  nan_tokens = np.isnan(want_weights).any(-1)
  assert nan_tokens.any() and not nan_tokens.all(), "the generated logits must poison some tokens, not all"
  np.testing.assert_array_equal(np.isnan(weights).any(-1), nan_tokens)
  np.testing.assert_array_equal(np.isnan(weights).all(-1), nan_tokens)
  assert ((ids >= 0) & (ids < e)).all() and all(len(set(row)) == ids.shape[1] for row in ids)
  clear = ~nan_tokens & (margin > NEAR_TIE)
  assert clear.sum() >= 0.9 * (~nan_tokens).sum(), "too many near-ties: the test checks little"
  np.testing.assert_array_equal(ids[clear], want_ids[clear])
  np.testing.assert_allclose(weights[clear], want_weights[clear], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("e,n_group,topk_group,top_k,norm", [(256, 8, 4, 8, True), (64, 8, 3, 6, False),
                                                            (16, 4, 2, 3, True)])
def test_deepseek_router_nan_rule_matches_reference(rng, e, n_group, topk_group, top_k, norm):
  router = moe.DeepSeekV3Router(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
  logits = _poisoned_logits(rng, 211, e)
  bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
  ids, weights = jax.jit(router)(jnp.asarray(logits), jnp.asarray(bias))
  want = ref.deepseek_v3_route(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                               routed_scaling_factor=router.routed_scaling_factor, norm_topk_prob=norm)
  with np.errstate(invalid="ignore", over="ignore"):
    margin = _deepseek_margin(logits, bias, router)
  _assert_nan_rule(ids, weights, *want, margin, e)
  # Every token with a NaN logit, whatever its sign, is one of them (sigmoid keeps it; +-inf gives 0 or 1).
  np.testing.assert_array_equal(np.isnan(want[1]).any(-1), np.isnan(logits).any(-1))
  # A NaN correction-bias entry is a NaN in every token's choice: every weight NaN.
  bias[int(rng.integers(e))] = np.nan
  _, weights = router(jnp.asarray(logits), jnp.asarray(bias))
  assert np.isnan(np.asarray(weights)).all()


@pytest.mark.parametrize("e,top_k,norm", [(128, 8, True), (60, 4, False), (8, 8, True)])
def test_qwen3_router_nan_rule_matches_reference(rng, e, top_k, norm):
  router = moe.Qwen3MoeRouter(top_k=top_k, norm_topk_prob=norm)
  logits = _poisoned_logits(rng, 211, e)
  ids, weights = jax.jit(router)(jnp.asarray(logits))
  want = ref.qwen3_moe_route(logits, top_k=top_k, norm_topk_prob=norm)
  with np.errstate(invalid="ignore", over="ignore"):
    probs = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    margin = _margins(probs / probs.sum(-1, keepdims=True), top_k)
  _assert_nan_rule(ids, weights, *want, margin, e)
  # The softmax makes a NaN of a NaN logit and of +inf (inf / inf); -inf is probability 0.
  np.testing.assert_array_equal(np.isnan(want[1]).any(-1), (np.isnan(logits) | (logits == np.inf)).any(-1))


def test_a_nan_token_s_layer_output_is_nan(rng):
  """Through the layer: a token the router gives NaN weights comes out NaN (every slot's id is one of the experts);
  the others come out finite and within §8's bound of the reference."""
  experts = tuple(map(jnp.asarray, _experts(rng, e=16)))
  x = jnp.asarray(rng.standard_normal((37, 256)), jnp.bfloat16)
  logits = _poisoned_logits(rng, 37, 16)
  bias = (rng.random(16) * 0.1).astype(np.float32)
  for router, b, poisoned in (
      (moe.DeepSeekV3Router(top_k=4, n_group=4, topk_group=2), jnp.asarray(bias), np.isnan(logits).any(-1)),
      (moe.Qwen3MoeRouter(top_k=4), None, (np.isnan(logits) | (logits == np.inf)).any(-1))):
    out = np.asarray(moe.fp8_moe_from_logits(x, jnp.asarray(logits), *experts, router=router, correction_bias=b),
                     np.float32)
    ids, weights = (np.asarray(a) for a in router(jnp.asarray(logits), b))
    nan_tokens = np.isnan(weights).any(-1)
    assert poisoned.any()
    np.testing.assert_array_equal(nan_tokens, poisoned)  # §8's rule, as transformers gives it
    assert np.isnan(out[nan_tokens]).all() and np.isfinite(out[~nan_tokens]).all()
    want = ref.cast_output(ref.fp8_moe(np.asarray(x)[~nan_tokens], ids[~nan_tokens], weights[~nan_tokens],
                                       *experts, (128, 128)), jnp.bfloat16).astype(np.float32)
    assert ref.relative_error(out[~nan_tokens], want) <= TOL


# ----------------------------------------------------------------------------------------- router shapes and errors

_ROUTERS = {"deepseek_v3": lambda: (moe.DeepSeekV3Router(top_k=3, n_group=4, topk_group=2), True),
            "qwen3": lambda: (moe.Qwen3MoeRouter(top_k=3), False)}


@pytest.mark.parametrize("family", list(_ROUTERS))
def test_routers_take_any_leading_shape(rng, family):
  """logits (..., E) of generated leading shapes (none included) route as their flattened tokens do: the same ids,
  the weights to float32 rounding (docs/CONTRACT.md §8: XLA's compiler fuses the scores and the normalizing sum per shape), eager
  and under jit."""
  router, uses_bias = _ROUTERS[family]()
  bias = jnp.asarray(rng.standard_normal(16) * 0.1, F32) if uses_bias else None
  for _ in range(4):
    lead = tuple(int(d) for d in rng.integers(1, 5, int(rng.integers(0, 4))))
    logits = jnp.asarray(rng.standard_normal((*lead, 16)) * 2, F32)
    flat_ids, flat_weights = router(logits.reshape(-1, 16), bias)
    for call in (router, jax.jit(router)):
      ids, weights = call(logits, bias)
      assert ids.shape == weights.shape == (*lead, 3) and ids.dtype == jnp.int32 and weights.dtype == F32
      np.testing.assert_array_equal(np.asarray(ids).reshape(-1, 3), np.asarray(flat_ids))
      # a few float32 ulps: the scores' exp and the normalizing sum are evaluated inside each shape's own fusion
      np.testing.assert_allclose(np.asarray(weights).reshape(-1, 3), np.asarray(flat_weights), rtol=8 * 2.0**-24,
                                 atol=0)


@pytest.mark.parametrize("family", list(_ROUTERS))
def test_router_errors_name_the_argument(rng, family):
  router, uses_bias = _ROUTERS[family]()
  name = type(router).__name__
  e = 4 * int(rng.integers(2, 6))
  bias = jnp.zeros(e, F32) if uses_bias else None
  with pytest.raises(ValueError, match=rf"{name}: logits must be \(..., E\).*got shape \(\)"):
    router(jnp.float32(1.0), bias)
  with pytest.raises(TypeError, match="logits must have dtype .* got int32"):
    router(jnp.zeros((5, e), jnp.int32), bias)
  if not uses_bias:
    with pytest.raises(ValueError, match=r"Qwen3MoeRouter takes no correction_bias .* shape \(%d,\)" % e):
      router(jnp.zeros((5, e), F32), jnp.zeros(e, F32))
    return
  with pytest.raises(ValueError, match=rf"DeepSeekV3Router needs correction_bias .*\(E,\) = \({e},\)\), got None"):
    router(jnp.zeros((2, 5, e), F32), None)
  for shape in [(e + int(rng.integers(1, 4)),), (1, e), (), (e - 1,)]:
    with pytest.raises(ValueError, match=rf"correction_bias must have shape \(E,\) = \({e},\), one per expert .*"
                                         rf"got {re.escape(str(shape))}"):
      router(jnp.zeros((2, 5, e), F32), jnp.zeros(shape, F32))
  with pytest.raises(TypeError, match="correction_bias must have dtype .* got int32"):
    router(jnp.zeros((5, e), F32), jnp.zeros(e, jnp.int32))


# ----------------------------------------------------------------------------------------------------- checkpoints

PREFIX = "model.layers.7.mlp"


def _random_block(rng) -> MoeWeights:
  """A generated block: 1..5 experts of I in {128, 256} (whole gn blocks), H in {128, 256, 384}, one of three block
  sizes, with or without the correction bias and shared experts, sometimes one device's share of a larger router."""
  block = [(128, 128), (64, 128), (128, 64)][int(rng.integers(3))]
  e, h, i = int(rng.integers(1, 6)), 128 * int(rng.integers(1, 4)), 128 * int(rng.integers(1, 3))
  w13_q, w13_s, w2_q, w2_s = _experts(rng, e, h, i, block)
  first = int(rng.integers(0, 3))
  router_experts = first + e + int(rng.integers(0, 3))
  shared = {}
  if rng.random() < 0.5:
    gq, gs = _stacked(rng, 1, 2 * i, h, block)
    dq, ds = _stacked(rng, 1, h, i, block)
    shared = dict(shared_gate_up=Fp8LinearWeight(gq[0], gs[0], None, block),
                  shared_down=Fp8LinearWeight(dq[0], ds[0], None, block))
  gate = (rng.standard_normal((router_experts, h)) * 0.1).astype(rng.choice([np.float32, np.float16]))
  bias = (rng.random(router_experts) * 0.1).astype(np.float32) if rng.random() < 0.5 else None
  return MoeWeights(w13_q, w13_s, w2_q, w2_s, gate, block, bias, first_expert=first, **shared)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same_block(read: MoeWeights, want: MoeWeights, experts=slice(None)):
  for name in ("w13_q", "w13_s", "w2_q", "w2_s"):
    np.testing.assert_array_equal(_bits(getattr(read, name)), _bits(np.asarray(getattr(want, name))[experts]))
  np.testing.assert_array_equal(np.asarray(read.gate_weight), np.asarray(want.gate_weight))
  assert read.gate_weight.dtype == want.gate_weight.dtype and tuple(read.block_size) == tuple(want.block_size)
  assert (read.correction_bias is None) == (want.correction_bias is None)
  if want.correction_bias is not None:
    np.testing.assert_array_equal(read.correction_bias, want.correction_bias)
  assert (read.shared_gate_up is None) == (want.shared_gate_up is None)
  if want.shared_gate_up is not None:
    for got, expected in ((read.shared_gate_up, want.shared_gate_up), (read.shared_down, want.shared_down)):
      np.testing.assert_array_equal(_bits(got.w_q), _bits(expected.w_q))
      np.testing.assert_array_equal(got.w_s, expected.w_s)


def test_generated_blocks_round_trip(rng, tmp_path):
  for n in range(6):
    block = _random_block(rng)
    path = tmp_path / f"block{n}"
    path.mkdir()
    save_hf_moe(path, PREFIX, block)
    read = load_hf_moe(path, PREFIX, as_numpy=True)
    _assert_same_block(read, block)
    assert read.first_expert == block.first_expert and read.num_experts == block.num_experts
    # A consecutive share of the held experts, by their global ids.
    start = int(rng.integers(0, block.num_experts))
    stop = int(rng.integers(start + 1, block.num_experts + 1))
    ids = list(range(block.first_expert + start, block.first_expert + stop))
    share = load_hf_moe(path, PREFIX, experts=np.array(ids), as_numpy=True)
    _assert_same_block(share, block, slice(start, stop))
    assert share.first_expert == ids[0]


def _corruptions(rng, block: MoeWeights):
  """Blocks that break one rule of `check_moe_weights` each, the rule named."""
  e_all, h = block.gate_weight.shape
  held = block.first_expert + block.num_experts
  replace = lambda **kw: MoeWeights(**{**{f: getattr(block, f) for f in block.__dataclass_fields__}, **kw})
  yield "fp8 router", replace(gate_weight=np.asarray(block.gate_weight).astype(ref.FP8))
  yield "router of another H", replace(gate_weight=np.zeros((e_all, h + 128), np.float32))
  yield "router of fewer experts", replace(gate_weight=np.zeros((held - 1, h), np.float32), correction_bias=None)
  yield "bias of another length", replace(correction_bias=np.zeros(e_all + int(rng.integers(1, 4)), np.float32))
  yield "int bias", replace(correction_bias=np.zeros(e_all, np.int32))
  if block.shared_gate_up is not None:
    down = block.shared_down
    yield "shared down of another H", replace(shared_down=Fp8LinearWeight(
        np.zeros((h + 128, down.shape[1]), ref.FP8), np.ones((-(-(h + 128) // block.block_size[0]),
                                                                down.w_s.shape[1]), np.float32), None,
        block.block_size))


def test_save_refuses_exactly_what_load_refuses(rng, tmp_path, monkeypatch):
  """Each corruption of a generated block: save_hf_moe refuses it and writes nothing; written without the check,
  load_hf_moe refuses it with the same error (one check, `check_moe_weights`)."""
  checked = []
  for n in range(3):
    block = _random_block(rng)
    for what, bad in _corruptions(rng, block):
      path = tmp_path / f"{n}-{what.replace(' ', '_')}"
      path.mkdir()
      with pytest.raises((TypeError, ValueError)) as saved:
        save_hf_moe(path, PREFIX, bad)
      assert not list(path.iterdir()), f"{what}: a refused block wrote {list(path.iterdir())}"
      with monkeypatch.context() as patched:
        patched.setattr(moe_weights, "check_moe_weights", lambda *args, **kwargs: None)
        save_hf_moe(path, PREFIX, bad)
      with pytest.raises((TypeError, ValueError)) as loaded:
        load_hf_moe(path, PREFIX)
      assert (type(loaded.value), str(loaded.value)) == (type(saved.value), str(saved.value)), what
      assert PREFIX in str(saved.value), f"{what}: {saved.value} names no tensor"
      checked.append(what)
  assert {"fp8 router", "router of fewer experts", "bias of another length"} <= set(checked)


def _saved(rng, tmp_path, name) -> tuple[Path, MoeWeights, dict[str, np.ndarray]]:
  """A saved generated block of at least 3 experts, and its tensors by name."""
  block = _random_block(rng)
  while block.num_experts < 3:
    block = _random_block(rng)
  path = tmp_path / name
  path.mkdir()
  save_hf_moe(path, PREFIX, block)
  from safetensors import safe_open
  with safe_open(str(path / checkpoints.DEFAULT_FILE_NAME), framework="numpy") as f:
    names = list(f.keys())
  return path, block, checkpoints.read_tensors(path, names)


def _rewrite(path: Path, tensors: dict[str, np.ndarray]) -> None:
  from safetensors import numpy as safetensors_numpy
  safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                              str(path / checkpoints.DEFAULT_FILE_NAME), metadata={"format": "pt"})


def test_malformed_checkpoints_name_the_tensor_and_the_expert(rng, tmp_path):
  for n in range(3):
    # One expert's projection of another shape (its scales to match, so that only the block's rule is broken).
    path, block, tensors = _saved(rng, tmp_path, f"shape{n}")
    e = block.first_expert + int(rng.integers(1, block.num_experts))
    proj = str(rng.choice(moe_weights.PROJECTIONS))
    name = f"{PREFIX}.experts.{e}.{proj}"
    rows, cols = tensors[f"{name}.weight"].shape
    gn, gk = block.block_size
    tensors[f"{name}.weight"] = np.zeros((rows + gn, cols), ref.FP8)
    tensors[f"{name}.weight_scale_inv"] = np.ones((-(-(rows + gn) // gn), -(-cols // gk)), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}\.weight of expert {e} has shape \({rows + gn}, "):
      load_hf_moe(path, PREFIX)
    # transformers' fused layout beside the per-expert tensors.
    path, block, tensors = _saved(rng, tmp_path, f"fused{n}")
    fused = f"{PREFIX}.experts.{rng.choice(['gate_up_proj', 'down_proj'])}"
    tensors[fused] = np.zeros((block.num_experts, 4, 8), np.float32)
    _rewrite(path, tensors)
    with pytest.raises(ValueError, match=rf"{re.escape(fused)}' is not one expert's tensor.*fused"):
      load_hf_moe(path, PREFIX)
    # A missing expert in the middle of the run, and one expert's missing projection.
    path, block, tensors = _saved(rng, tmp_path, f"missing{n}")
    e = block.first_expert + int(rng.integers(1, block.num_experts - 1))
    _rewrite(path, {k: v for k, v in tensors.items() if not k.startswith(f"{PREFIX}.experts.{e}.")})
    with pytest.raises(ValueError, match=rf"lacks expert\(s\) \[{e}\]"):
      load_hf_moe(path, PREFIX)
    proj = str(rng.choice(moe_weights.PROJECTIONS))
    _rewrite(path, {k: v for k, v in tensors.items() if not k.startswith(f"{PREFIX}.experts.{e}.{proj}.")})
    with pytest.raises(ValueError, match=rf"expert {e} of '{re.escape(PREFIX)}' lacks .*{e}\.{proj}"):
      load_hf_moe(path, PREFIX)


def test_experts_argument_is_validated(rng, tmp_path):
  path, block, _ = _saved(rng, tmp_path, "block")
  first, last = block.first_expert, block.first_expert + block.num_experts - 1
  for experts, error, match in [
      ([first + 0.5], TypeError, r"experts must hold int expert ids, got %s \(float\)" % re.escape(str(first + 0.5))),
      ([np.float32(first)], TypeError, "experts must hold int expert ids, got .* \\(float32\\)"),
      ([True], TypeError, r"experts must hold int expert ids, got True \(bool\)"),
      (str(first) + str(first + 1), TypeError, "experts must be a sequence of int expert ids .* got '"),
      (first, TypeError, f"experts must be a sequence of int expert ids .* got {first}"),
      ([], ValueError, r"non-empty ascending run of consecutive ids .* got \[\]"),
      ([first, first + 2], ValueError, r"consecutive ids .* got \[%d, %d\]" % (first, first + 2)),
      ([last + 1], ValueError, rf"experts=\[{last + 1}\] reaches outside the experts {first}..{last}"),
      ([first - 1] if first else [-1], ValueError, "reaches outside the experts"),
  ]:
    with pytest.raises(error, match=match):
      load_hf_moe(path, PREFIX, experts=experts)
  assert load_hf_moe(path, PREFIX, experts=(np.int64(last),), as_numpy=True).first_expert == last


# -------------------------------------------------------------------------------------------- Fp8MoE's own checks

def test_nnx_block_checks_its_router_weight_and_x(rng):
  pytest.importorskip("flax.nnx")
  from jaxfp8.moe.nn import Fp8MoE
  from jaxfp8.nn import Fp8Weight
  for family in ("deepseek_v3", "qwen3"):
    weights = _moe_weights(rng, deepseek=family == "deepseek_v3", e=8, h=256)
    router = (moe.DeepSeekV3Router(top_k=2, n_group=4, topk_group=2) if family == "deepseek_v3"
              else moe.Qwen3MoeRouter(top_k=2))
    e, h = weights.gate_weight.shape
    wrong = lambda **kw: MoeWeights(**{**{f: getattr(weights, f) for f in weights.__dataclass_fields__}, **kw})
    for gate, error, match in [
        (np.zeros((e, h), ref.FP8), TypeError, "weights.gate_weight must have dtype .* got float8_e4m3fn"),
        (np.zeros((e, h), np.int32), TypeError, "weights.gate_weight must have dtype .* got int32"),
        (np.zeros((e, h + 128 * int(rng.integers(1, 3))), np.float32), ValueError,
         rf"weights.gate_weight must have shape \(E, H\) with H={h}"),
        (np.zeros((e * h,), np.float32), ValueError, r"weights.gate_weight must have shape \(E, H\)"),
        (np.zeros((e, h, 1), np.float32), ValueError, r"weights.gate_weight must have shape \(E, H\)"),
        (np.zeros((e - 1, h), np.float32), ValueError, rf"E >= {e}"),
    ]:
      with pytest.raises(error, match=match):
        Fp8MoE(wrong(gate_weight=gate, correction_bias=None if weights.correction_bias is None else
                     np.zeros(gate.shape[:1], np.float32)), router)
    if weights.correction_bias is not None:
      with pytest.raises(ValueError, match=rf"weights.correction_bias must have shape \(E,\) = \({e},\)"):
        Fp8MoE(wrong(correction_bias=np.zeros(e + 1, np.float32)), router)
    layer = Fp8MoE(weights, router)
    other_h = h + 128 * int(rng.integers(1, 3))
    with pytest.raises(ValueError, match=rf"x must be \(..., H\) = \(..., {h}\) .* got shape \(3, {other_h}\)"):
      layer(jnp.zeros((3, other_h), jnp.bfloat16))
    with pytest.raises(TypeError, match="x must have dtype .* got int32"):
      layer(jnp.zeros((3, h), jnp.int32))
    with pytest.raises(ValueError, match=r"x must be \(..., H\)"):
      layer(jnp.zeros((), jnp.bfloat16))
    # A router variable replaced after construction is checked at the call (before the einsum could fail on it).
    layer.gate_weight = Fp8Weight(jnp.zeros((e, h + 128), F32))
    with pytest.raises(ValueError, match=rf"weights.gate_weight must have shape \(E, H\) with H={h}"):
      layer(jnp.zeros((3, h), jnp.bfloat16))


# --------------------------------------------------------------------------------- explain and plan_for: one check

def _moe_case(rng):
  e, h, i = int(rng.integers(2, 6)), 128 * int(rng.integers(1, 4)), 128 * int(rng.integers(1, 3))
  t, k = int(rng.integers(1, 9)), int(rng.integers(1, 4))
  return dict(x=((t, h), jnp.bfloat16), topk_ids=((t, k), jnp.int32), topk_weights=((t, k), F32),
              w13_q=((e, 2 * i, h), F8), w13_s=((e, 2 * i // 128, -(-h // 128)), F32), w2_q=((e, h, i), F8),
              w2_s=((e, -(-h // 128), i // 128), F32))


def _moe_breakages(rng, case):
  (t, h), (e, two_i, _) = case["x"][0], case["w13_q"][0]
  other_h = h + 128 * int(rng.integers(1, 3))
  yield "x of another H", dict(x=((t, other_h), jnp.bfloat16))
  yield "H no multiple of gk", dict(x=((t, h - 64), jnp.bfloat16), w13_q=((e, two_i, h - 64), F8),
                                    w2_q=((e, h - 64, two_i // 2), F8))
  yield "2-D w13_q", dict(w13_q=((two_i, h), F8))
  yield "2-D w2_q", dict(w2_q=((h, two_i // 2), F8))
  yield "w2_q of another I", dict(w2_q=((e, h, two_i // 2 + 128), F8))
  yield "w2_q of other experts", dict(w2_q=((e + 1, h, two_i // 2), F8))
  yield "bf16 w13_q", dict(w13_q=((e, two_i, h), jnp.bfloat16))
  yield "int x", dict(x=((t, h), jnp.int32))
  yield "0-D x", dict(x=((), jnp.bfloat16))


def _raised(f):
  try:
    f()
  except (TypeError, ValueError) as e:
    return type(e), str(e)
  return None


def test_moe_explain_raises_what_the_call_raises(rng):
  for _ in range(3):
    case = _moe_case(rng)
    top_k = case["topk_ids"][0][-1]
    for what, change in _moe_breakages(rng, case):
      shapes = {**case, **change}
      arrays = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
      structs = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}
      called = _raised(lambda: moe.fp8_moe(**arrays))
      assert called is not None, f"{what}: the call took it"
      explained = _raised(lambda: moe.explain(structs["x"], structs["w13_q"], structs["w2_q"], top_k))
      assert explained == called, what
    structs = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in case.items()}
    plan = moe.explain(structs["x"], structs["w13_q"], structs["w2_q"], top_k)
    assert (plan.tokens, plan.top_k, plan.hidden) == (case["x"][0][0], top_k, case["x"][0][1])
  with pytest.raises(ValueError, match="top_k must be a non-negative int .* got -1"):
    moe.explain(structs["x"], structs["w13_q"], structs["w2_q"], -1)
  with pytest.raises(TypeError, match="device must be a jaxfp8._platform.Device or None, got str"):
    moe.explain(structs["x"], structs["w13_q"], structs["w2_q"], 2, device="h200")


def _grouped_breakages(rng, e, m, n, k):
  yield "K mismatch", dict(b_q=((e, n, k + 128), F8))
  yield "2-D b_q", dict(b_q=((n, k), F8))
  yield "bf16 a_q", dict(a_q=((m, k), jnp.bfloat16))
  yield "bf16 b_q", dict(b_q=((e, n, k), jnp.bfloat16))
  yield "bad block_size", dict(block_size=(128, 0))


def test_grouped_plan_for_raises_what_the_call_raises(rng):
  for _ in range(3):
    e, m, n, k = int(rng.integers(1, 6)), int(rng.integers(1, 40)), 128 * int(rng.integers(1, 3)), 128 * int(
        rng.integers(1, 4))
    for layout in ("ragged", "masked"):
      a = ((m, k), F8) if layout == "ragged" else ((e, m, k), F8)
      for what, change in _grouped_breakages(rng, e, m, n, k):
        if layout == "masked" and "a_q" in change:
          change = {"a_q": ((e, *change["a_q"][0]), change["a_q"][1])}
        shapes = {"a_q": a, "b_q": ((e, n, k), F8), **change}
        block = shapes.pop("block_size", (128, 128))
        groups = -(-k // 128)
        a_s = (m, groups) if layout == "ragged" else (e, m, groups)
        args = [jnp.zeros(*shapes["a_q"]), jnp.zeros(*shapes["b_q"]), jnp.ones(a_s, F32),
                jnp.ones((e, -(-n // 128), groups), F32), jnp.zeros((e,), jnp.int32), block]
        call = grouped.ragged_w8a8_block_fp8_matmul if layout == "ragged" else grouped.masked_w8a8_block_fp8_matmul
        called = _raised(lambda: call(*args))
        assert called is not None, f"{layout}, {what}: the call took it"
        planned = _raised(lambda: grouped.plan_for(jax.ShapeDtypeStruct(*shapes["a_q"]),
                                                   jax.ShapeDtypeStruct(*shapes["b_q"]), block))
        assert planned == called, (layout, what)
    # The masked layout's buffers must be one per expert.
    with pytest.raises(ValueError, match="one buffer per expert"):
      grouped.plan_for(jax.ShapeDtypeStruct((e + 1, m, k), F8), jax.ShapeDtypeStruct((e, n, k), F8), (128, 128))
  for shape in [(k,), (2, 3, 4, 5)]:
    with pytest.raises(ValueError, match=rf"a_q must be 2-D .* or 3-D .* got shape {re.escape(str(shape))}"):
      grouped.plan_for(jax.ShapeDtypeStruct(shape, F8), jax.ShapeDtypeStruct((e, n, k), F8), (128, 128))


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="the Mosaic GPU kernel does not import here")
def test_plans_for_a_named_device():
  """`device=` plans for that device wherever the test runs: a CPU's plan, and an H200's (not interpreted)."""
  a, b = jax.ShapeDtypeStruct((4096, 7168), F8), jax.ShapeDtypeStruct((32, 4096, 7168), F8)
  cpu, h200 = helpers.fake_device(None), helpers.fake_device((9, 0))
  assert grouped.plan_for(a, b, (128, 128), device=cpu).implementation == "xla"
  plan = grouped.plan_for(a, b, (128, 128), device=h200, interpret=False)
  assert plan.implementation == "mosaic" and plan.device == h200 and "'NVIDIA H200'" in plan.reason
  with pytest.raises(TypeError, match="device must be a jaxfp8._platform.Device or None, got tuple"):
    grouped.plan_for(a, b, (128, 128), device=(9, 0))
  x, w2 = jax.ShapeDtypeStruct((64, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((32, 7168, 2048), F8)
  assert moe.explain(x, b, w2, 8, device=cpu).gate_up.implementation == "xla"
  gpu = moe.explain(x, b, w2, 8, device=h200, interpret=False)
  assert gpu.gate_up.implementation == gpu.down.implementation == "mosaic" and gpu.gate_up.device == h200


# ---------------------------------------------------------------------------------- eager and jit: one computation


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_eager_and_jitted_block_are_one_computation(rng, family):
  """The NNX block eager, under nnx.jit, under jax.jit and inside a caller's jit with other ops around it: the same
  bits, for generated token shapes; an eager call of a new shape compiles one executable, the block's."""
  nnx = pytest.importorskip("flax.nnx")
  from jaxfp8.moe.nn import Fp8MoE
  deepseek = family == "deepseek_v3"
  weights = _moe_weights(rng, deepseek=deepseek, e=8)
  router = moe.DeepSeekV3Router(top_k=3, n_group=4, topk_group=2) if deepseek else moe.Qwen3MoeRouter(top_k=3)
  layer = Fp8MoE(weights, router)
  for n in range(2):
    lead = (int(rng.integers(1, 3)), 7 + 4 * n)  # a new token count each time
    x = jnp.asarray(rng.standard_normal((*lead, 256)), jnp.bfloat16)
    with helpers.count_compilations() as compiled:
      eager = np.asarray(layer(x), np.float32)
    assert compiled == ["jit(_block)"], compiled
    with helpers.count_compilations() as compiled:
      np.testing.assert_array_equal(np.asarray(layer(x), np.float32), eager)
    assert not compiled, compiled
    if n:
      continue  # the second shape checks the eager compile count only: the jitted forms compile as they did
    for jitted in (nnx.jit(lambda m, x: m(x))(layer, x), jax.jit(lambda m, x: m(x))(layer, x),
                   # the caller's ops around the block (exact ones: x and the output are what they were)
                   jax.jit(lambda m, x: (m((x.astype(F32) * 1.0).astype(x.dtype)).astype(F32) + 0.0))(layer, x)):
      np.testing.assert_array_equal(np.asarray(jitted, np.float32), eager)


def test_eager_and_jitted_layer_are_one_computation(rng):
  """fp8_moe eager, under jax.jit, and inside a caller's jit that computes its routing weights: the same bits."""
  experts = tuple(map(jnp.asarray, _experts(rng, e=8)))
  x = jnp.asarray(rng.standard_normal((29, 256)), jnp.bfloat16)
  ids, raw = _routing(rng, 29, 8, 3, empty=[2])
  raw = jnp.asarray(np.where(np.isfinite(raw), raw, 0.5), F32)
  normalize = lambda w: w / w.sum(-1, keepdims=True)
  eager = np.asarray(moe.fp8_moe(x, jnp.asarray(ids), normalize(raw), *experts), np.float32)
  jitted = jax.jit(lambda x, w: moe.fp8_moe(x, jnp.asarray(ids), normalize(w), *experts))(x, raw)
  np.testing.assert_array_equal(np.asarray(jitted, np.float32), eager)
  text = jax.jit(lambda x, w: moe.fp8_moe(x, jnp.asarray(ids), normalize(w), *experts)).lower(x, raw).as_text()
  # The layer's inputs and output pass optimization barriers: no caller's op fuses into its computation.
  barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
  assert len(barriers) >= 2 and any("x256xbf16>" in line and "xf8E4M3FN>" in line for line in barriers), barriers
