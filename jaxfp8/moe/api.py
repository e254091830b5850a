"""The FP8 mixture-of-experts layer (docs/CONTRACT.md §8): `fp8_moe`, `fp8_moe_from_logits`, `explain`.

Validation happens once here; `planner.plan` makes every decision and `layer.forward` runs its steps.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8 import _checks, _platform
from jaxfp8 import _transforms as transforms
from jaxfp8.gemm.api import FP8
from jaxfp8.moe import layer, planner, routing

F32 = jnp.dtype(jnp.float32)
I32 = jnp.dtype(jnp.int32)
_OP = "jaxfp8.moe.fp8_moe"


def fp8_moe(
    x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13_q: jax.Array, w13_s: jax.Array,
    w2_q: jax.Array, w2_s: jax.Array, block_size: tuple[int, int] = (128, 128), *,
    implementation: str | None = None, quant_implementation: str | None = None, interpret: bool | None = None,
    combine_implementation: str | None = None, silu_quant_in_gate_up: bool | None = None,
    permute_in_quantize: bool | None = None, every_id_local: bool = False,
    dispatch_implementation: str | None = None,
) -> jax.Array:
  """The routed experts of an MoE block on block-FP8 weights (docs/CONTRACT.md §8).

  Args:
    x: (..., H) bfloat16, float16 or float32 tokens.
    topk_ids: (..., k) int32, each token's experts; an id outside [0, E) contributes nothing.
    topk_weights: (..., k) float weights of those experts (a router's output: `routing`).
    w13_q: (E, 2I, H) float8_e4m3fn, each expert's gate_proj and up_proj weights stacked [gate | up].
    w13_s: (E, ceil(2I/gn), ceil(H/gk)) float32 block scales of w13_q.
    w2_q: (E, H, I) float8_e4m3fn down_proj weights; w2_s: (E, ceil(H/gn), ceil(I/gk)) float32.
    block_size: (gn, gk); H and I must be multiples of gk (the activations' groups).
    implementation: the grouped GEMMs' ("mosaic", "xla" or None for the best here); quant_implementation: the
      quantizers' (None: the GEMM family's own); interpret: run Pallas kernels interpreted (None: when no GPU);
      combine_implementation: the combine's ("mosaic", "xla" or None: the Mosaic one from
      combine.MOSAIC_MIN_TOKENS tokens on Hopper); silu_quant_in_gate_up: None or True runs the SiLU-and-mul
      quantizer in gate_up's epilogue where the plan allows it (aligned expert rows on the Mosaic prefill schedule),
      so h never reaches memory; False: its own step. permute_in_quantize: None or True quantizes each live
      routed row straight from its token into expert order where the plan allows it (the Mosaic quantizer, one
      device), so the tokens' codes never reach memory; False: quantize, then permute. every_id_local: True
      promises every id is in [0, E) (a router over these experts, as `fp8_moe_from_logits` and the NNX layer on
      one device call it), so that every slot is a live row: the plan then keeps the quantizer and the permute
      apart where the fused one would read much more, and takes XLA's combine. Speed only: the result is the same.
      dispatch_implementation: the decode dispatch's ("mosaic": one Mosaic GPU kernel for up to 64 routed slots,
      "xla", or None: the planner's); the same rows, order and tables either way.

  Returns:
    (..., H) in x's dtype. `explain(...)` says which kernels run and why.
  """
  block_size, lead = validate(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size)
  p = _plan(x, topk_ids, w13_q, w2_q, block_size, implementation, quant_implementation, interpret,
            combine_implementation=combine_implementation, silu_quant_in_gate_up=silu_quant_in_gate_up,
            permute_in_quantize=permute_in_quantize, every_id_local=every_id_local,
            dispatch_implementation=dispatch_implementation)
  t, h, k = math.prod(lead), x.shape[-1], topk_ids.shape[-1]
  if t == 0 or k == 0:  # no routed row: nothing to launch
    return jnp.zeros((*lead, h), x.dtype)
  out = transformable(p)(x.reshape(t, h), topk_ids.reshape(t, k), topk_weights.reshape(t, k), w13_q, w13_s, w2_q,
                         w2_s)
  return out.reshape(*lead, h)


def fp8_moe_from_logits(
    x: jax.Array, router_logits: jax.Array, w13_q: jax.Array, w13_s: jax.Array, w2_q: jax.Array, w2_s: jax.Array,
    block_size: tuple[int, int] = (128, 128), *, router: routing.Router, correction_bias: jax.Array | None = None,
    **options,
) -> jax.Array:
  """`fp8_moe` on the experts `router` (a `routing.DeepSeekV3Router` or `routing.Qwen3MoeRouter`) picks from
  router_logits (..., E) (with DeepSeek-V3's `correction_bias` (E,)): every id is one of these experts
  (`every_id_local`)."""
  if not isinstance(router, (routing.DeepSeekV3Router, routing.Qwen3MoeRouter)):
    raise TypeError(f"router must be a DeepSeekV3Router or Qwen3MoeRouter, got {type(router).__name__}")
  # x's and w13_q's checks as `validate` makes them, before their shapes are read here.
  _checks.array("x", x, _checks.FLOAT_DTYPES, ndim=None)
  _checks.array("w13_q", w13_q, (FP8,), ndim=3)
  _checks.array("router_logits", router_logits, _checks.FLOAT_DTYPES, ndim=None)
  if tuple(router_logits.shape) != (*x.shape[:-1], w13_q.shape[0]):
    raise ValueError(f"router_logits must have shape (..., E) = {(*x.shape[:-1], w13_q.shape[0])} for x of shape "
                     f"{tuple(x.shape)} and {w13_q.shape[0]} experts, got {tuple(router_logits.shape)}")
  ids, weights = router(router_logits, correction_bias)  # the router checks correction_bias
  return fp8_moe(x, ids, weights, w13_q, w13_s, w2_q, w2_s, block_size, **{"every_id_local": True, **options})


def explain(x, w13_q, w2_q, top_k: int, block_size: tuple[int, int] = (128, 128), *,
            implementation: str | None = None, quant_implementation: str | None = None,
            interpret: bool | None = None, device: _platform.Device | None = None,
            combine_implementation: str | None = None, silu_quant_in_gate_up: bool | None = None,
            permute_in_quantize: bool | None = None, every_id_local: bool = False,
            dispatch_implementation: str | None = None) -> planner.MoePlan:
  """The plan `fp8_moe` runs for these shapes (arrays or `jax.ShapeDtypeStruct`s) and why (`print(plan)`), on
  `device` (default: the device programs are built for here). Raises what `fp8_moe` raises for these shapes: the
  same `validate`, on stand-ins for the arrays explain does not take (ids and weights (..., top_k), the scales).
  `fp8_moe_from_logits` and the NNX layer on one device call it with every_id_local=True: pass it to see theirs."""
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
    raise ValueError(f"top_k must be a non-negative int (the slots per token, topk_ids.shape[-1]), got {top_k!r}")
  block_size = _checks.block_size(block_size)
  lead = tuple(x.shape[:-1]) if hasattr(x, "shape") else ()
  ids = jax.ShapeDtypeStruct((*lead, int(top_k)), I32)
  scales = [jax.ShapeDtypeStruct(_scale_shape(w, block_size), F32) for w in (w13_q, w2_q)]
  block_size, _ = validate(x, ids, jax.ShapeDtypeStruct(ids.shape, F32), w13_q, scales[0], w2_q, scales[1],
                           block_size)
  return _plan(x, ids, w13_q, w2_q, block_size, implementation, quant_implementation, interpret, device,
               combine_implementation, silu_quant_in_gate_up, permute_in_quantize, every_id_local,
               dispatch_implementation)


def _scale_shape(w, block_size) -> tuple[int, ...]:
  """The block scales' shape (E, ceil(N/gn), ceil(K/gk)) of an (E, N, K) weight; () for anything else (whose own
  check fails first)."""
  shape = tuple(getattr(w, "shape", ()))
  if len(shape) != 3:
    return ()
  return (shape[0], -(-shape[1] // block_size[0]), -(-shape[2] // block_size[1]))


def _plan(x, topk_ids, w13_q, w2_q, block_size, implementation, quant_implementation, interpret, device=None,
          combine_implementation=None, silu_quant_in_gate_up=None, permute_in_quantize=None, every_id_local=False,
          dispatch_implementation=None):
  options = planner.MoeOptions(implementation, quant_implementation, interpret, combine_implementation,
                               silu_quant_in_gate_up, permute_in_quantize, every_id_local, dispatch_implementation)
  device = _checks.device(device)
  tokens = math.prod(x.shape[:-1])
  return planner.plan(tokens, topk_ids.shape[-1], w13_q.shape[0], x.shape[-1], w2_q.shape[2], block_size, x.dtype,
                      options, device=device)


def transformable(plan: planner.MoePlan):
  """The layer of `plan` as a function of its arrays: not differentiable (its weights are frozen codes and the
  routing is discrete), `jax.vmap` refused alike on every implementation."""
  def run(*args):
    return _forward(*args, plan=plan)

  return transforms.untransformable(
      run, _OP, vmap_hint="give the tokens a leading batch shape instead (x (..., H), topk_ids and topk_weights "
      "(..., k)): they are folded into one call",
      derivative_hint="its experts are frozen FP8 codes and its routing is discrete; fine-tune around it (e.g. "
      "adapters)")


@functools.partial(jax.jit, static_argnames=("plan",))
def _forward(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, *, plan: planner.MoePlan):
  # One jitted function of the plan, eager or under an outer jax.jit. The barriers keep XLA from fusing the caller's
  # producers and consumers into the layer's ops (which changes their fusions, and on a GPU folds a caller's
  # narrowing convert into our widening one): the layer compiles to the same computation either way.
  args = lax.optimization_barrier((x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s))
  return lax.optimization_barrier(layer.forward(*args, plan))


def validate(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size):
  """Checks every array against the others (the call's and `explain`'s one check); returns (block_size, the tokens'
  leading shape)."""
  gn, gk = _checks.block_size(block_size)
  _checks.array("x", x, _checks.FLOAT_DTYPES, ndim=None)
  _checks.array("topk_ids", topk_ids, (I32,), ndim=None)
  _checks.array("topk_weights", topk_weights, _checks.FLOAT_DTYPES, ndim=None)
  for name, w in (("w13_q", w13_q), ("w2_q", w2_q)):
    _checks.array(name, w, (FP8,), ndim=3)
  for name, s in (("w13_s", w13_s), ("w2_s", w2_s)):
    _checks.array(name, s, (F32,), ndim=3)
  if x.ndim < 1:
    raise ValueError(f"x must be (..., H), got shape {tuple(x.shape)}")
  lead, h = tuple(x.shape[:-1]), x.shape[-1]
  if topk_ids.ndim < 1 or tuple(topk_ids.shape[:-1]) != lead:
    raise ValueError(f"topk_ids must be (..., k) with x's leading shape {lead}, got {tuple(topk_ids.shape)}")
  if tuple(topk_weights.shape) != tuple(topk_ids.shape):
    raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                     f"{tuple(topk_weights.shape)}")
  experts, two_i, h13 = w13_q.shape
  if two_i % 2 or h13 != h:
    raise ValueError(f"w13_q must be (E, 2I, H) = (E, 2I, {h}) for x of shape {tuple(x.shape)} (gate and up stacked), "
                     f"got {tuple(w13_q.shape)}")
  i = two_i // 2
  if tuple(w2_q.shape) != (experts, h, i):
    raise ValueError(f"w2_q must be (E, H, I) = {(experts, h, i)} for w13_q of shape {tuple(w13_q.shape)}, got "
                     f"{tuple(w2_q.shape)}")
  for name, s, (n, k) in (("w13_s", w13_s, (two_i, h)), ("w2_s", w2_s, (h, i))):
    want = (experts, -(-n // gn), -(-k // gk))
    if tuple(s.shape) != want:
      raise ValueError(f"{name} must have shape (E, ceil(N/gn), ceil(K/gk)) = {want} for block_size={(gn, gk)}, "
                       f"got {tuple(s.shape)}")
  for name, k in (("H", h), ("I", i)):
    if k % gk:
      raise ValueError(f"{name}={k} must be a multiple of block_size[1]={gk} (the activations' quantization groups)")
  return (gn, gk), lead
