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
