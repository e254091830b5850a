"""How the public ops meet JAX's transforms (docs/CONTRACT.md §5), the same on every implementation.

- `not_differentiable`: an op whose outputs are quantized codes (the quantizers, the GEMM on codes) refuses
  `jax.grad`, `jax.vjp`, `jax.jvp` and the Jacobians with one error naming the op and the transforms, instead of
  what each kernel's primitive would say (an AssertionError from Pallas-Triton, a NotImplementedError from Mosaic
  GPU, a silent straight-through derivative from XLA).
- `refuse_forward_mode`: an op whose derivative is a `jax.custom_vjp` (the linear) refuses `jax.jvp` and
  `jax.jacfwd` with the same kind of error, instead of JAX's generic custom_vjp TypeError (raised at lowering under
  `jax.jit`); reverse mode is its gradient.
- `batched`: `jax.vmap` of an op runs its own batching rule, which folds the mapped axis into the rows the kernels
  already loop over (one launch, the same kernels, whatever the backend), instead of each primitive's generic rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import custom_batching
# JAX has no public test of a tracer's kind (_forward_tangent): its own classes, the same in JAX 0.11 and 0.12.
from jax._src.interpreters import ad, partial_eval


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

  # symbolic_zeros: the rule raises before any tangent is used, so the zero tangents of the other arguments are never
  # built (JAX would build them eagerly, which fails for arrays typed as sharded over an Explicit mesh axis).
  wrapped.defjvp(refuse, symbolic_zeros=True)
  return wrapped


def refuse_forward_mode(op: str, hint: str, *values) -> None:
  """Raises `TransformError` naming `op` when any of `values` carries a forward-mode tangent (`jax.jvp`,
  `jax.jacfwd`); a reverse-mode linearization (`jax.grad`, `jax.vjp`) passes."""
  if any(_forward_tangent(v) for v in values):
    raise TransformError(f"{op} has no forward-mode derivative (jax.jvp and jax.jacfwd of it are refused): {hint}")


def _forward_tangent(value) -> bool:
  """Whether `value`, through its nested tracers, is a forward-mode JVP tracer. JAX has no public test for a
  tracer's kind: these are JAX's own classes (the same in JAX 0.11 and 0.12). `jax.grad` traces with
  LinearizeTracers (direct linearization, JAX's default), or without it with JVPTracers whose tangents are
  partial-evaluation JaxprTracers; `jax.jvp` gives a JVPTracer with any other tangent. A forward-mode tracer under
  a reverse-mode one (`jax.hessian`, a jvp of a gradient) is a second derivative: left to the gradient's own
  refusal."""
  while isinstance(value, jax.core.Tracer):
    if isinstance(value, ad.JVPTracer) and not isinstance(value.tangent, partial_eval.JaxprTracer):
      return True
    if isinstance(value, (ad.LinearizeTracer, ad.JVPTracer)):
      return False
    inner = getattr(value, "val", None)  # batching and the other tracers that wrap one value
    if inner is None or inner is value:
      return False
    value = inner
  return False


def varying_axes(x) -> frozenset:
  """The mesh axes that x varies over inside `jax.shard_map` with check_vma (empty elsewhere): its type's
  `manual_axis_type.varying` in JAX 0.11 and 0.12, `vma` in the JAX versions that named it so."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())


def cotangent_like(ct: jax.Array, axes: frozenset) -> jax.Array:
  """A custom_vjp cotangent `ct` typed like its primal, which varies over `axes`: summed (psum) over the mesh axes
  it varies over and the primal does not, as JAX's own transpose of a replicated value's use does (the cotangent of
  a value every device shares is the sum of theirs)."""
  extra = tuple(sorted(varying_axes(ct) - axes))
  return jax.lax.psum(ct, extra) if extra else ct


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
