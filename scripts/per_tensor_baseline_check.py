"""GPU: the per-tensor FP8 baseline two ways, CUPTI kernel times and kernel names: a float32 product scaled and cast
(the bench's baseline until session 4) vs `baselines.per_tensor_fp8_matmul_baseline` (the product in bf16 out of
cuBLASLt). Log of its H200 run: benchmarks/archive/per_tensor_baseline_check_h200.log.

  PYTHONPATH=. python3 scripts/per_tensor_baseline_check.py
"""

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8.tools import baselines, timing

CONTRACT_K = (((1,), (1,)), ((), ()))


def float32_product_then_cast(a_q, b_q, scale):
  return (lax.dot_general(a_q, b_q, CONTRACT_K, preferred_element_type=jnp.float32) * scale).astype(jnp.bfloat16)


def bf16_product(a_q, b_q, scale):
  return baselines.per_tensor_fp8_matmul_baseline(a_q, b_q, scale, jnp.float32(1.0))


def _fp8(key, shape):
  return jnp.clip(jax.random.normal(key, shape) * 60, -448, 448).astype(jnp.float8_e4m3fn)


def main():
  for m, n, k in [(4096, 24576, 7168), (64, 24576, 7168), (4096, 7168, 18432)]:
    key_a, key_b = jax.random.split(jax.random.key(m + n))
    # Decode reads the weight once per call: rotate 3 copies so that it comes from HBM, not the 60 MB L2.
    arg_sets = [(_fp8(jax.random.fold_in(key_a, i), (m, k)), _fp8(jax.random.fold_in(key_b, i), (n, k)),
                 jnp.float32(1.0)) for i in range(3 if m <= 64 else 1)]
    outs = []
    for name, f in [("old f32-then-cast", float32_product_then_cast), ("new bf16 out", bf16_product)]:
      fn = jax.jit(f)
      us = timing.median_kernel_us(fn, arg_sets, iterations=10)
      names = timing.kernel_names(fn, arg_sets[0])
      print(f"M={m} N={n} K={k} {name:18s} {us:8.1f} us {2 * m * n * k / us / 1e6:7.1f} TFLOP/s kernels={names}",
            flush=True)
      outs.append(fn(*arg_sets[0]).astype(jnp.float32))
    print("max |old-new|", float(jnp.abs(outs[0] - outs[1]).max()), flush=True)


if __name__ == "__main__":
  main()
