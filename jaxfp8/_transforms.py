"""How the public ops meet JAX's transforms (docs/CONTRACT.md §5), the same on every implementation.

- `not_differentiable`: an op whose outputs are quantized codes (the quantizers, the GEMM on codes) refuses
  `jax.grad`, `jax.vjp`, `jax.jvp` and the Jacobians with one error naming the op and the transforms, instead of
  what each kernel's primitive would say (an AssertionError from Pallas-Triton, a NotImplementedError from Mosaic
  GPU, a silent straight-through derivative from XLA).
- `batched`: `jax.vmap` of an op runs its own batching rule, which folds the mapped axis into the rows the kernels
  already loop over (one launch, the same kernels, whatever the backend), instead of each primitive's generic rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import custom_batching


class TransformError(TypeError):
  """A JAX transform that a jaxfp8 op does not support."""


_DERIVATIVES = "jax.grad, jax.vjp, jax.jvp, jax.jacfwd and jax.jacrev"


def not_differentiable(fun: Callable[..., Any], op: str, hint: str) -> Callable[..., Any]:
  """`fun` (arrays in, arrays out) with a derivative rule that raises `TransformError`. Arguments whose tangents are
  symbolic zeros (not differentiated) never reach the rule, so only a derivative that would flow through `op` is
  refused."""
  wrapped = jax.custom_jvp(fun)

  def refuse(primals, tangents):
    del primals, tangents
    raise TransformError(f"{op} is not differentiable ({_DERIVATIVES} of it are refused): {hint}")

  wrapped.defjvp(refuse)
  return wrapped


def batched(fun: Callable[..., Any], rule: Callable[..., Any]) -> Callable[..., Any]:
  """`fun` (arrays in, arrays out) whose `jax.vmap` calls `rule(axis_size, in_batched, *args) -> (out, out_batched)`,
  `jax.custom_batching.custom_vmap`'s rule signature."""
  wrapped = custom_batching.custom_vmap(fun)
  wrapped.def_vmap(rule)
  return wrapped


def refuse_vmap(op: str, what: str, hint: str) -> None:
  raise TransformError(f"jax.vmap of {op} over {what} is not supported: {hint}")


def untransformable(fun: Callable[..., Any], op: str, *, vmap_hint: str, derivative_hint: str) -> Callable[..., Any]:
  """`fun` with `jax.vmap` over any argument and every derivative refused, each with one `TransformError` naming `op`
  (`jax.jit` and `jax.eval_shape` still work)."""
  def vmap_rule(axis_size, in_batched, *args):
    del axis_size, in_batched, args
    refuse_vmap(op, "any argument", vmap_hint)

  return not_differentiable(batched(fun, vmap_rule), op, derivative_hint)
