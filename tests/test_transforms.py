"""Every public op under JAX's transforms (docs/CONTRACT.md §5), on every implementation: each transform either
gives the untransformed results or raises one `TransformError` naming the op and the transform.

jit, vmap, eval_shape, shard_map and export give the same results as eager calls; grad/vjp/jvp of the quantizer and
the GEMM (functions of quantized codes) are refused; the linear's gradient is tests/test_grad.py's. On CPU the
Pallas kernels run interpreted; exporting an interpreted Mosaic kernel is impossible (its interpreter runs on host
callbacks, which jax.export does not serialize), so Mosaic export is checked by lowering for CUDA instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers
import jaxfp8
from jaxfp8 import _platform
from jaxfp8._transforms import TransformError

IMPLEMENTATIONS = ["xla", "triton", "mosaic"]


def _interpret(implementation):
  return None if implementation == "xla" else not helpers.ON_GPU


@pytest.fixture(scope="module")
def weight():
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
  return jaxfp8.quantize_weight_blockwise(w)


def _ops(implementation, weight):
  """Each op as f(x) -> float32 array, x (5, 256) bfloat16, with its implementation fixed."""
  w_q, w_s = weight
  kw = dict(implementation=implementation, interpret=_interpret(implementation))

  def quant(x):
    q, s = jaxfp8.per_token_group_quant_fp8(x, 128, column_major_scales=True, **kw)
    return jnp.concatenate([q.astype(jnp.float32).reshape(-1), s.reshape(-1)])

  def matmul(x):
    a_q, a_s = jaxfp8.per_token_group_quant_fp8(x, 128, implementation="xla")
    a_q, a_s = jax.lax.stop_gradient((a_q, a_s))
    return jaxfp8.w8a8_block_fp8_matmul(a_q, w_q, a_s, w_s, (128, 128), out_dtype=jnp.float32, **kw)

  def linear(x):
    return jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), out_dtype=jnp.float32, **kw)

  return {"quant": quant, "matmul": matmul, "linear": linear}


def _x(rng, lead=(5,)):
  return jnp.asarray(rng.standard_normal((*lead, 256)) * 3, jnp.bfloat16)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["quant", "matmul", "linear"])
def test_jit_vmap_eval_shape_shard_map_give_the_eager_results(rng, weight, op, implementation):
  helpers.runnable(implementation)
  f = _ops(implementation, weight)[op]
  x = _x(rng)
  eager = np.asarray(f(x))
  # XLA's GPU dot picks its algorithm per row count, and an eager linear runs the executable of its row bucket: there
  # the contract is the GEMM's tolerance (docs/CONTRACT.md §3), everywhere else the same bits.
  same = (np.testing.assert_array_equal if not (implementation == "xla" and helpers.ON_GPU and op == "linear")
          else lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-3 * np.abs(b).max()))
  same(np.asarray(jax.jit(f)(x)), eager)
  shape = jax.eval_shape(f, x)
  assert shape.shape == eager.shape and shape.dtype == eager.dtype
  mesh = jax.make_mesh((1,), ("d",))
  same(np.asarray(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P())(x)), eager)
  # vmap: each entry of the batch equals its own call (the rows fold into one launch of the same kernels).
  xs = jnp.stack([x, _x(rng), _x(rng)])
  batched = np.asarray(jax.vmap(f)(xs))
  for i in range(xs.shape[0]):
    want = np.asarray(f(xs[i]))
    if op == "quant":
      np.testing.assert_array_equal(batched[i], want)
    else:  # another row count may select another schedule: the GEMM's tolerance (docs/CONTRACT.md §3)
      assert jaxfp8.reference.relative_error(batched[i], want) <= 2e-4


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["quant", "matmul"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "jacrev"])
def test_derivatives_of_quantized_ops_are_refused_alike(rng, weight, op, implementation, transform):
  helpers.runnable(implementation)
  f = _ops(implementation, weight)[op]
  name = {"quant": "per_token_group_quant_fp8", "matmul": "w8a8_block_fp8_matmul"}[op]
  x = _x(rng).astype(jnp.float32)
  if op == "matmul":  # differentiate with respect to the scales, which the GEMM multiplies by
    w_q, w_s = weight
    a_q, a_s = jaxfp8.per_token_group_quant_fp8(x, 128)
    kw = dict(implementation=implementation, interpret=_interpret(implementation))
    f = lambda a_s: jaxfp8.w8a8_block_fp8_matmul(a_q, w_q, a_s, w_s, (128, 128), out_dtype=jnp.float32, **kw)
    x = a_s
  run = {"grad": lambda: jax.grad(lambda v: f(v).sum())(x),
         "vjp": lambda: jax.vjp(f, x)[1](f(x)),
         "jvp": lambda: jax.jvp(f, (x,), (jnp.ones_like(x),)),
         "jacrev": lambda: jax.jacrev(f)(x)}[transform]
  with pytest.raises(TransformError, match=rf"jaxfp8\.{name} is not differentiable \(jax\.grad, jax\.vjp, jax\.jvp"):
    run()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_the_weight_is_refused_alike(rng, weight, implementation):
  helpers.runnable(implementation)
  w_q, w_s = weight
  a_q, a_s = jaxfp8.per_token_group_quant_fp8(_x(rng), 128)
  kw = dict(implementation=implementation, interpret=_interpret(implementation))
  f = lambda b_q: jaxfp8.w8a8_block_fp8_matmul(a_q, b_q, a_s, w_s, (128, 128), **kw)
  with pytest.raises(TransformError, match="jax.vmap of jaxfp8.w8a8_block_fp8_matmul over the weight"):
    jax.vmap(f)(jnp.stack([w_q, w_q]))
  g = lambda w_q: jaxfp8.w8a8_block_fp8_linear(_x(rng), w_q, w_s, (128, 128), **kw)
  with pytest.raises(TransformError, match="over the weight"):
    jax.vmap(g)(jnp.stack([w_q, w_q]))


def test_vmap_of_the_masked_quantizer_folds_experts(rng):
  x = jnp.asarray(rng.standard_normal((2, 3, 7, 128)), jnp.bfloat16)   # vmap over 2, then (E=3, T=7, K)
  masked_m = jnp.asarray([[7, 0, 3], [1, 5, 7]], jnp.int32)
  f = lambda x, m: jaxfp8.per_token_group_quant_fp8(x, 64, masked_m=m, column_major_scales=True, row_alignment=4)
  q, s = jax.vmap(f)(x, masked_m)
  for i in range(2):
    qi, si = f(x[i], masked_m[i])
    np.testing.assert_array_equal(np.asarray(q[i]).view(np.uint8), np.asarray(qi).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s[i]), np.asarray(si))


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_export_gives_the_eager_results(rng, weight, implementation):
  helpers.runnable(implementation)
  x = _x(rng)
  # Triton's custom call carries no compatibility guarantee: JAX exports it only when told to (natively, on a GPU).
  from jax.experimental.pallas import triton as plt
  disabled = [jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)]
  for op, f in _ops(implementation, weight).items():
    exported = jax.export.export(jax.jit(f), disabled_checks=disabled)(x)
    want = np.asarray(jax.jit(f)(x))  # the traced program, not the eager linear's row bucket (another XLA algorithm)
    np.testing.assert_array_equal(np.asarray(exported.call(x)), want, err_msg=op)


def test_every_op_exports_for_cuda_with_its_kernels(weight):
  """jax.export for CUDA (here lowered on CPU for an abstract H200): the default plans' Mosaic kernels go in (4096
  rows: above the size where the quantizer's plan prefers its Triton kernel)."""
  w_q, w_s = weight
  x = jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16)
  with _platform.abstract_h200():
    # The quantizer is one Mosaic kernel, the linear two (its quantizer's and its GEMM's).
    for kernels, f in (
        (1, lambda x: jaxfp8.per_token_group_quant_fp8(x, 128, column_major_scales=True, scale_tma_aligned=True)),
        (2, lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128)))):
      text = jax.export.export(jax.jit(f), platforms=["cuda"])(x).mlir_module()
      assert helpers.kernel_calls(text) == ["mosaic_gpu_v2"] * kernels, helpers.kernel_calls(text)


# ---- the MoE layer, expert-parallel, and forward-mode derivatives of the linears -------------------------------------


def _moe_arrays(rng, experts=4, tokens=4, h=256, i=128):
  """Random codes and scales for the MoE layer (refused transforms never run it, and vmap is refused at trace)."""
  codes = lambda *shape: jnp.asarray(np.clip(rng.standard_normal(shape) * 32, -448, 448), jnp.float8_e4m3fn)
  scales = lambda *shape: jnp.asarray(np.exp2(rng.uniform(-9, -6, shape)), jnp.float32)
  ids = jnp.asarray(np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)]), jnp.int32)
  return dict(x=_x(rng, (tokens,)).astype(jnp.float32), topk_ids=ids,
              topk_weights=jnp.asarray(rng.random((tokens, 2)), jnp.float32),
              w13_q=codes(experts, 2 * i, h), w13_s=scales(experts, 2 * i // 128, h // 128),
              w2_q=codes(experts, h, i), w2_s=scales(experts, h // 128, i // 128))


@pytest.mark.parametrize("implementation", ["xla", "mosaic"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "jacrev", "vmap"])
def test_expert_parallel_moe_refuses_derivatives_and_vmap_alike(rng, implementation, transform):
  """As fp8_moe does (tests/test_moe.py): every derivative, with respect to the tokens, the routing weights or the
  weight scales, and vmap are one TransformError naming the op; XLA alone would differentiate through the
  quantizers, and vmap met ragged_dot's batching rule."""
  helpers.runnable(implementation)
  if implementation == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("the Mosaic GPU kernel does not import here")
  arrays = _moe_arrays(rng)
  mesh = jax.make_mesh((1,), ("ep",))
  kw = dict(mesh=mesh, axis_name="ep", implementation=implementation, interpret=_interpret(implementation))
  for name in ("x", "topk_weights", "w13_s"):
    f = lambda v: jaxfp8.moe.expert_parallel_fp8_moe(**{**arrays, name: v}, **kw).astype(jnp.float32)
    v = arrays[name]
    run = {"grad": lambda: jax.grad(lambda v: f(v).sum())(v),
           "vjp": lambda: jax.vjp(f, v),
           "jvp": lambda: jax.jvp(f, (v,), (jnp.ones_like(v),)),
           "jacrev": lambda: jax.jacrev(f)(v),
           "vmap": lambda: jax.vmap(f)(jnp.stack([v, v]))}[transform]
    message = ("jax.vmap of jaxfp8.moe.expert_parallel_fp8_moe" if transform == "vmap" else
               r"jaxfp8\.moe\.expert_parallel_fp8_moe is not differentiable \(jax\.grad, jax\.vjp, jax\.jvp")
    with pytest.raises(TransformError, match=message):
      run()


def test_the_moe_block_with_a_mesh_refuses_derivatives(rng):
  pytest.importorskip("flax.nnx")
  import test_moe
  from jaxfp8.moe.nn import Fp8MoE
  mesh = jax.make_mesh((1,), ("ep",))
  layer = Fp8MoE(test_moe._moe_weights(rng, deepseek=False, e=4), jaxfp8.moe.Qwen3MoeRouter(top_k=2), mesh=mesh,
                 axis_name="ep")
  x = _x(rng, (4,)).astype(jnp.float32)
  with pytest.raises(TransformError, match="jaxfp8.moe.expert_parallel_fp8_moe is not differentiable"):
    jax.grad(lambda x: layer(x).astype(jnp.float32).sum())(x)
  with pytest.raises(TransformError, match="jaxfp8.moe.expert_parallel_fp8_moe is not differentiable"):
    jax.jvp(layer, (x,), (x,))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_forward_mode_derivatives_of_the_linear_are_refused_alike(rng, weight, implementation):
  """jax.jvp and jax.jacfwd of the linear (whose gradient is a custom_vjp) are one TransformError naming it, eager
  and under jit or vmap, with respect to x, the weight scales or the bias, with and without valid_rows (JAX would
  raise its generic custom_vjp TypeError, under jit only at lowering); reverse mode still gives the gradient, with
  or without JAX's direct linearization. (jax.jvp of a function jitted before the jvp traces the linear without
  its tangents: JAX's own error, docs/CONTRACT.md §5.)"""
  helpers.runnable(implementation)
  w_q, w_s = weight
  bias = jnp.asarray(rng.standard_normal(256), jnp.float32)
  x = _x(rng).astype(jnp.float32)
  kw = dict(implementation=implementation, interpret=_interpret(implementation))
  call = lambda x=x, w_s=w_s, bias=bias, **more: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128), bias,
                                                                             **kw, **more)
  cases = {
      "jvp": lambda: jax.jvp(call, (x,), (x,)),
      "jit_jvp": lambda: jax.jit(lambda x: jax.jvp(call, (x,), (x,)))(x),
      "jacfwd": lambda: jax.jacfwd(call)(x[:1]),
      "vmap_jvp": lambda: jax.vmap(lambda x: jax.jvp(call, (x,), (x,)))(jnp.stack([x, x])),
      "jvp_vmap": lambda: jax.jvp(jax.vmap(call), (x[None],), (x[None],)),
      "scales": lambda: jax.jvp(lambda s: call(w_s=s), (w_s,), (w_s,)),
      "bias": lambda: jax.jvp(lambda b: call(bias=b), (bias,), (bias,)),
      "valid_rows": lambda: jax.jvp(lambda x: call(x, valid_rows=jnp.int32(3)), (x,), (x,)),
  }
  for name, run in cases.items():
    with pytest.raises(TransformError, match=r"jaxfp8\.w8a8_block_fp8_linear has no forward-mode derivative"):
      run()
  loss = lambda x: (call(x) ** 2).sum()
  want = np.asarray(jax.grad(loss)(x))
  previous = jax.config.jax_use_direct_linearize
  try:
    jax.config.update("jax_use_direct_linearize", not previous)
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), want)
  finally:
    jax.config.update("jax_use_direct_linearize", previous)


def test_forward_mode_of_the_parallel_linears_and_the_nnx_layer_is_refused(rng, weight):
  w_q, w_s = weight
  mesh = jax.make_mesh((1,), ("tp",))
  x = _x(rng).astype(jnp.float32)
  for parallel in ("column", "row"):
    f = lambda x: getattr(jaxfp8.linear, f"{parallel}_parallel_linear")(x, w_q, w_s, (128, 128), mesh=mesh,
                                                                          axis_name="tp")
    with pytest.raises(TransformError, match=rf"jaxfp8\.linear\.{parallel}_parallel_linear has no forward-mode"):
      jax.jvp(f, (x,), (x,))
    assert jax.grad(lambda x: f(x).sum())(x).shape == x.shape
  pytest.importorskip("flax.nnx")
  from jaxfp8.nn import Fp8Linear
  from flax import nnx
  layer = Fp8Linear.from_linear(nnx.Linear(256, 128, rngs=nnx.Rngs(0)))
  with pytest.raises(TransformError, match=r"jaxfp8\.w8a8_block_fp8_linear has no forward-mode derivative"):
    jax.jvp(layer, (x,), (x,))
