"""The grouped GEMM's planner: the implementation and kernel config of a call, each with its reason.

`plan(problem, ...)` is the one place a grouped GEMM call is decided; `run(...)` executes a plan without checking
anything again. The backends (`xla`, `mosaic` in this package) say what they can run and own their heuristics.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxfp8 import _planning, _platform
from jaxfp8.grouped import mosaic, xla

IMPLEMENTATIONS = ("mosaic", "xla")
BACKENDS = {"mosaic": mosaic, "xla": xla}
LAYOUTS = ("ragged", "masked")


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
  """One grouped GEMM call, by its shapes. ragged: a_q (rows, K) shared by `groups` experts; masked: a_q
  (groups, rows, K), each expert its own rows."""
  layout: str
  groups: int                   # E: experts (weights)
  rows: int                     # ragged: M; masked: T, the rows of each expert's buffer
  n: int
  k: int
  block_size: tuple[int, int]
  out_dtype: str
  a_s_column_major: bool = False
  # False: the rows no group owns (past the groups, past masked_m) are left unspecified instead of written as zeros,
  # for a caller that never reads them (the MoE layer); a kernel then neither computes nor stores them.
  zero_unowned_rows: bool = True

  @property
  def empty(self) -> bool:
    return self.groups == 0 or self.rows == 0 or self.n == 0 or self.k == 0

  @property
  def out_shape(self) -> tuple[int, ...]:
    return (self.rows, self.n) if self.layout == "ragged" else (self.groups, self.rows, self.n)


def problem(layout: str, groups: int, rows: int, n: int, k: int, block_size, *, out_dtype=jnp.bfloat16,
            a_s_column_major: bool = False, zero_unowned_rows: bool = True) -> GroupedProblem:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  return GroupedProblem(layout, int(groups), int(rows), int(n), int(k), tuple(block_size), jnp.dtype(out_dtype).name,
                        bool(a_s_column_major), bool(zero_unowned_rows))


@dataclasses.dataclass(frozen=True)
class GroupedPlan:
  """What a grouped GEMM call runs and why (hashable: it is the static part of the jitted call)."""
  problem: GroupedProblem
  implementation: str
  config: Any
  interpret: bool
  reason: str
  config_reason: str = ""
  device: _platform.Device | None = None

  def __str__(self) -> str:
    mode = " (interpreted)" if self.interpret and self.implementation != "xla" else ""
    config = f"; config {self.config} ({self.config_reason})" if self.config is not None else ""
    unowned = "" if self.problem.zero_unowned_rows else "; rows no group owns left unwritten (never read)"
    return f"{self.implementation} {self.problem.layout} grouped GEMM{mode}: {self.reason}{config}{unowned}"


def _default(p: GroupedProblem, device: _platform.Device, interpret: bool) -> tuple[str, str]:
  """(implementation, reason) when none is asked for."""
  if interpret and device.capability is not None:
    return "xla", "interpret=True and no implementation named: XLA (name one to interpret its kernel)"
  if device.capability is None:
    return "xla", f"no NVIDIA GPU (device {device.describe()}): XLA"
  if device.is_hopper:
    why = mosaic.unavailable(device, interpret) or mosaic.unsupported(p)
    if why is None and (passed_over := mosaic.not_default(p)):
      return "xla", f"Hopper GPU {device.describe()}, but {passed_over}: XLA"
    if why is None:
      return "mosaic", (f"Hopper GPU {device.describe()}, N a multiple of 8, K of {p.block_size[1]}, block_size "
                        f"{tuple(p.block_size)}: the Mosaic GPU kernel")
    return "xla", f"Hopper GPU {device.describe()}, but the Mosaic kernel cannot take this problem ({why}): XLA"
  return "xla", f"GPU {device.describe()} is not a Hopper GPU (the only grouped kernel is Mosaic GPU's): XLA"


def plan(p: GroupedProblem, *, implementation: str | None = None, config=None, interpret: bool | None = None,
         device: _platform.Device | None = None, reason: str | None = None) -> GroupedPlan:
  """Chooses the implementation and config of a grouped problem; raises ValueError/TypeError (naming the argument)
  when what was asked for cannot run here. `reason` overrides the implementation's reason (a caller that chose it)."""
  device = device or _platform.device()
  interpret = _platform.resolve_interpret(interpret)
  implementation, why = _planning.requested(implementation, config, BACKENDS, option="implementation",
                                            default=lambda: _default(p, device, interpret))
  backend = BACKENDS[implementation]
  others = " or ".join(repr(name) for name in IMPLEMENTATIONS if name != implementation)
  if unavailable := backend.unavailable(device, interpret):
    raise ValueError(f"implementation={implementation!r} {unavailable}, or use implementation={others}")
  if unsupported := backend.unsupported(p):
    raise ValueError(f"implementation={implementation!r} cannot run N={p.n}, K={p.k}, block_size={p.block_size}: "
                     f"{unsupported}; use implementation={others}")
  if config is None:
    config, config_reason = backend.default_config_for(p, device)
  else:
    _planning.given_config(backend, implementation, config, option="implementation", kernels=("mosaic",))
    if problem_text := backend.config_problem(p, config):
      raise ValueError(f"config cannot run this problem ({problem_text}): {config}")
    config_reason = "given"
  return GroupedPlan(p, implementation, config, interpret, reason or why, config_reason, device)


def prepare(counts: jax.Array, plan: GroupedPlan) -> jax.Array:
  """What `run(..., prepared=True)` takes instead of the counts: the implementation's routing table (the Mosaic
  kernel's work items; XLA's counts as they are). A caller running several GEMMs on one routing builds it once for
  each distinct `prepared_key` (the MoE layer: one for both projections)."""
  p = plan.problem
  return counts if p.empty else BACKENDS[plan.implementation].prepare(counts, p, plan.config, plan.interpret)


def prepare_from_rows(groups: jax.Array, rows: jax.Array, within: jax.Array, group_sizes: jax.Array,
                      plan: GroupedPlan, with_order: bool = False):
  """`prepare(group_sizes, plan)` for a ragged call whose caller sorted the rows: groups (R,) each routed row's group
  (outside [0, E): none), rows (R,) its position in group order, within (R,) its index among its group's rows. The
  Mosaic kernel's table then takes two fused reductions over the rows instead of its per-group prologue (fewer
  kernels at decode, where the rows are few). with_order: (the table, the routed row at each position where the
  table's first reduction also took it, else None: the caller's gather order at no kernel of its own)."""
  p = plan.problem
  if p.empty:
    return (group_sizes, None) if with_order else group_sizes
  return BACKENDS[plan.implementation].prepare_from_rows(groups, rows, within, group_sizes, p, plan.config,
                                                         with_order=with_order)


def prepare_from_starts(starts: jax.Array, group_sizes: jax.Array, plan: GroupedPlan) -> jax.Array:
  """The routing table of a ragged call whose groups' rows are [starts[e], starts[e] + group_sizes[e]), in group
  order but not packed (the rows between them belong to no group: neither computed nor stored). The Mosaic kernel's
  only: the XLA grouped GEMM takes packed rows (its table is the group sizes)."""
  p = plan.problem
  if plan.implementation != "mosaic" or p.layout != "ragged" or p.zero_unowned_rows:
    raise ValueError(f"rows placed at given starts need the Mosaic ragged grouped GEMM leaving the rows no group owns "
                     f"unwritten (zero_unowned_rows=False), not {plan.implementation} {p.layout} with "
                     f"zero_unowned_rows={p.zero_unowned_rows}")
  return group_sizes if p.empty else mosaic.prepare_from_starts(starts, group_sizes, p, plan.config)


def prepared_key(plan: GroupedPlan):
  """Plans with equal keys take the same `prepare` table."""
  p = plan.problem
  return ("empty",) if p.empty else BACKENDS[plan.implementation].items_key(p, plan.config)


@functools.partial(jax.jit, static_argnames=("plan", "prepared"))
def run(a_q, b_q, a_s, b_s, counts, *, plan: GroupedPlan, prepared: bool = False) -> jax.Array:
  """Executes `plan`: (M, N) for the ragged layout, (E, T, N) for the masked one, in the plan's out_dtype.
  counts: group_sizes (ragged) or masked_m (masked), or with prepared=True `prepare(counts, plan)`."""
  p = plan.problem
  if p.empty:
    return jnp.zeros(p.out_shape, p.out_dtype)  # an empty sum is 0
  return BACKENDS[plan.implementation].launch(a_q, b_q, a_s, b_s, counts, p, plan.config, plan.interpret,
                                              plan.device or _platform.device(), prepared=prepared)


def silu_quant_unsupported(plan: GroupedPlan, h_dtype) -> str | None:
  """Why `plan` (an MoE layer's gate_up on a [gate | up] weight) cannot compute SiLU(gate) * up quantized in its
  epilogue (`run_gate_up_silu_quant`); None: it can."""
  if plan.implementation != "mosaic":
    return f"the {plan.implementation} grouped GEMM has no fused epilogue (the Mosaic kernel's only)"
  if plan.problem.empty:
    return "an empty problem"
  return mosaic.silu_quant_unsupported(plan.problem, plan.config, h_dtype)


@functools.partial(jax.jit, static_argnames=("plan", "h_dtype", "eps"))
def run_gate_up_silu_quant(a_q, b_q, a_s, b_s, table, *, plan: GroupedPlan, h_dtype, eps: float):
  """The gate_up GEMM of `plan` on a [gate | up] weight b_q (E, 2I, K) with docs/CONTRACT.md §1's SiLU-and-mul
  quantizer (group size 128, float scales, eps) in its epilogue: (codes (M, I) fp8, column-major scales (I/128, M')
  float32, M' = round_up(M, 64)); h itself (rounded to h_dtype before it is quantized, §8) is never written. table:
  `prepare_from_starts` with each group's rows from a multiple of the plan's row tile, so that no row tile holds two
  groups' rows (`silu_quant_unsupported(plan, h_dtype)` must be None)."""
  return mosaic.launch_gate_up_silu_quant(a_q, b_q, a_s, b_s, table, plan.problem, plan.config, jnp.dtype(h_dtype),
                                          eps, plan.interpret, plan.device or _platform.device())
