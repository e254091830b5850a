"""The GPU kernels of jaxfp8, each as a jitted call on fresh random inputs at an aligned and an unaligned shape.

Shared by scripts/determinism.py and scripts/sanitize_driver.py. Imports no timing code (CUPTI conflicts with
compute-sanitizer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxfp8
from jaxfp8 import reference as ref

# name -> (implementation kind, shapes): quantizer shapes are (M, K), GEMM / linear shapes (M, N, K).
KERNELS = {
    "quant_triton": ("quant", "triton", [(4096, 7168), (13, 2304)]),
    "quant_mosaic": ("quant", "mosaic", [(4096, 7168), (13, 2304)]),
    "gemm_triton": ("gemm", "triton", [(256, 1536, 7168), (13, 200, 7000)]),
    "gemm_mosaic": ("gemm", "mosaic", [(256, 1536, 7168), (12, 1536, 7168)]),  # it takes M % 4 == 0 only
    "linear_default": ("linear", None, [(256, 1536, 7168), (13, 2112, 7168)]),
    "linear_triton": ("linear", "triton", [(256, 1536, 7168), (13, 200, 7168)]),
}


def make_call(name: str, shape: tuple[int, ...], seed: int):
  """(fn, args): fn(*args) runs the kernel once; fresh inputs from `seed`, never zeros."""
  kind, implementation, _ = KERNELS[name]
  rng = np.random.default_rng(seed)
  if kind == "quant":
    m, k = shape
    x = jnp.asarray((rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 8, (m, 1)))).astype(np.float32),
                    jnp.bfloat16)
    fn = jax.jit(functools.partial(jaxfp8.per_token_group_quant_fp8_row_padded, group_size=128,
                                   implementation=implementation))
    return fn, (x,)
  m, n, k = shape
  b_q, b_s = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), (128, 128))
  if kind == "gemm":
    groups = ref.ceil_div(k, 128)
    a_q, a_s = ref.per_token_group_quant_fp8(rng.standard_normal((m, groups * 128)).astype(np.float32), 128)
    a_q = a_q[:, :k]
    fn = jax.jit(functools.partial(jaxfp8.w8a8_block_fp8_matmul, block_size=(128, 128), out_dtype=jnp.bfloat16,
                                   implementation=implementation))
    return fn, tuple(jnp.asarray(a) for a in (a_q, b_q, a_s, b_s))
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), jnp.bfloat16)
  fn = jax.jit(functools.partial(jaxfp8.w8a8_block_fp8_linear, block_size=(128, 128), implementation=implementation))
  return (lambda x, w_q, w_s: fn(x, w_q, w_s)), (x, jnp.asarray(b_q), jnp.asarray(b_s))


def available(name: str) -> str | None:
  """Why a kernel cannot run on this device (None when it can)."""
  from jaxfp8 import _platform
  implementation = KERNELS[name][1]
  if implementation == "mosaic" and not _platform.is_hopper():
    return "needs Hopper"
  if implementation == "triton" and not _platform.has_fp8_gpu():
    return "needs sm >= 8.9"
  return None
