"""`fp8_group_dot(a, b)`: one scale group's FP8 x FP8 dot with an f32 result, for Triton-lowered Pallas kernels.

Why not `lax.dot_general`: Pallas-Triton (JAX 0.11.2) emits `tt.dot` without a `maxNumImpreciseAcc` attribute, i.e.
0. For FP8 operands Triton then treats every 32-wide wgmma as needing full-precision accumulation: each instruction
writes a fresh accumulator that is waited for and added into the result with f32 adds. That serialises the tensor
cores behind the adds (measured: the block-FP8 GEMM at about 320 TFLOP/s on an H200, 4x under cuBLAS).

The GEMM already promotes into its own f32 accumulator once per scale group (at most 128 K, as docs/CONTRACT.md §2
asks), so inside one group's dot the tensor core's own accumulation is what the contract allows. With
`fast_accumulation=True` this primitive lowers to `tt.dot` with `maxNumImpreciseAcc` above the dot's K, so Triton
chains the group's wgmmas on one accumulator, as Triton's own front end does for FP8 on Hopper (the measured error of
that accumulation, about 1.3e-4 relative at K=128, is 65% of the contract's float32-output bound: callers wanting float32
results ask for `fast_accumulation=False`, the precise and slow per-instruction promotion). Off the Triton path
(interpret mode, CPU) it is `lax.dot_general` with an f32 result.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir
# Private Pallas-Triton lowering API (jax is pinned to 0.11.2 in pyproject.toml): the rule registry and IR helpers.
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

# Above any dot this file is given (at most 128 wide in K): Triton then never splits the dot's accumulation.
_NO_PARTIAL_ACCUMULATION = 1 << 30

_NT_DIMS = (((1,), (1,)), ((), ()))  # contract the K axis of a (M, K) and b (N, K)


def _reference_dot(a: jax.Array, b: jax.Array, *, fast_accumulation: bool) -> jax.Array:
  del fast_accumulation  # exact off the tensor cores
  return lax.dot_general(a, b, _NT_DIMS, preferred_element_type=jnp.float32)


fp8_group_dot_p = jex_core.Primitive("jaxfp8_fp8_group_dot")
fp8_group_dot_p.def_impl(_reference_dot)
mlir.register_lowering(fp8_group_dot_p, mlir.lower_fun(_reference_dot, multiple_results=False))


@fp8_group_dot_p.def_abstract_eval
def _abstract_eval(a, b, *, fast_accumulation):
  del fast_accumulation
  return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


@triton_lowering.register_lowering(fp8_group_dot_p)
def _triton_lowering(ctx, a, b, *, fast_accumulation):
  del ctx
  b_t = tt_dialect.trans(b, (1, 0))  # (K, N): tt.dot's right operand
  m = ir.RankedTensorType(a.type).shape[0]
  n = ir.RankedTensorType(b.type).shape[0]
  acc = triton_lowering._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
  # None (0) is Triton's precise mode: every 32-wide wgmma added into f32 on its own.
  return tt_dialect.dot(a, b_t, acc, max_num_imprecise_acc=_NO_PARTIAL_ACCUMULATION if fast_accumulation else None)


def fp8_group_dot(a: jax.Array, b: jax.Array, *, fast_accumulation: bool = True) -> jax.Array:
  """f32 (M, N) = a (M, K) @ b (N, K)^T for FP8 a and b of one dtype, K <= 128 (one scale group, or less).

  fast_accumulation: let the tensor cores accumulate the whole dot (fast; about 1.3e-4 relative error at K=128 on an
  H200); False adds every 32-wide MMA into f32 separately (about 1e-8, several times slower).
  """
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.dtype != b.dtype:
    raise ValueError(f"fp8_group_dot takes (M, K) and (N, K) of one dtype, got {a.shape} {a.dtype} and "
                     f"{b.shape} {b.dtype}")
  if a.shape[1] > 128:
    raise ValueError(f"fp8_group_dot is for one scale group (K <= 128), got K={a.shape[1]}")
  return fp8_group_dot_p.bind(a, b, fast_accumulation=bool(fast_accumulation))
