"""The GEMM's planner: every decision a call needs (implementation, kernel config, row padding), each with its reason.

`plan(problem, ...)` is the one place a block-FP8 GEMM call is decided; `run(...)` executes a plan without checking
anything again. The backends (`xla`, `triton`, `mosaic` in this package) say what they can run and own their config
heuristics and tables; this module holds the rules that choose between them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxfp8 import _planning, _platform
from jaxfp8.gemm import mosaic, triton, xla

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
BACKENDS = {"mosaic": mosaic, "triton": triton, "xla": xla}

# Decode on Hopper: up to this many live rows the tuned Triton kernel beats the Mosaic small-M kernel (H200, CUPTI,
# Mosaic reading the quantizer's 64-row decode buffers: M=1 Triton/Mosaic 43.7/45.3 us on DeepSeek-V3 q_proj,
# 34.0/35.3 on dense_down, 15.7/15.8 on Qwen3 qkv; from M=8 Mosaic is ahead on all three).
TRITON_DECODE_MAX_M = 4


@dataclasses.dataclass(frozen=True)
class GemmProblem:
  """One GEMM call, arrays described by their shapes: a_q (rows, K) of which the first m rows are computed."""
  m: int                        # rows computed and returned
  rows: int                     # rows of a_q (m, or more: padding rows the caller's buffers carry)
  n: int
  k: int
  block_size: tuple[int, int]
  out_dtype: str
  a_s_column_major: bool = False
  has_bias: bool = False
  masked: bool = False          # a traced `valid_rows` comes with the call: rows past it are 0

  @property
  def empty(self) -> bool:
    return self.m == 0 or self.n == 0 or self.k == 0


def problem(m: int, n: int, k: int, block_size, *, rows: int | None = None, out_dtype=jnp.bfloat16,
            a_s_column_major: bool = False, has_bias: bool = False, masked: bool = False) -> GemmProblem:
  return GemmProblem(m, m if rows is None else rows, n, k, tuple(block_size), jnp.dtype(out_dtype).name,
                     bool(a_s_column_major), bool(has_bias), bool(masked))


@dataclasses.dataclass(frozen=True)
class GemmPlan:
  """What a GEMM call runs and why (hashable: it is the static part of the jitted call)."""
  problem: GemmProblem
  implementation: str
  config: Any                   # the kernel config that runs (None for "xla")
  interpret: bool
  reason: str                   # why this implementation
  config_reason: str = ""       # why this config
  device: _platform.Device | None = None

  @property
  def skips_dead_rows(self) -> bool:
    """Whether the kernel skips the row tiles past `valid_rows` (else every row is computed, then zeroed)."""
    return self.problem.masked and BACKENDS[self.implementation].SKIPS_DEAD_ROWS

  def __str__(self) -> str:
    mode = " (interpreted)" if self.interpret and self.implementation != "xla" else ""
    config = f"; config {self.config} ({self.config_reason})" if self.config is not None else ""
    rows = ""
    if self.problem.masked:
      rows = ("; valid_rows: the row tiles past it are skipped and written as zeros" if self.skips_dead_rows else
              "; valid_rows: every row is computed, the rows past it are then set to zero")
    return f"{self.implementation} GEMM{mode}: {self.reason}{config}{rows}"


def _default(p: GemmProblem, device: _platform.Device, interpret: bool) -> tuple[str, str]:
  """(implementation, reason) when none is asked for."""
  if interpret and device.capability is not None:
    return "xla", "interpret=True and no implementation named: XLA (name one to interpret its kernel)"
  if device.capability is None:
    return "xla", f"no NVIDIA GPU (device {device.describe()}): XLA"
  triton_why = triton.unavailable(device, interpret) or triton.unsupported(p)
  if device.is_hopper:
    mosaic_why = mosaic.unavailable(device, interpret) or mosaic.unsupported(p)
    if p.m <= TRITON_DECODE_MAX_M and triton_why is None:
      return "triton", (f"Hopper GPU {device.describe()}, decode M={p.m} <= {TRITON_DECODE_MAX_M}: the tuned Triton "
                        "kernel (measured faster than the Mosaic small-M kernel there)")
    if mosaic_why is None and (passed_over := mosaic.not_default(p)) and triton_why is None:
      return "triton", f"Hopper GPU {device.describe()}, but {passed_over}: the portable Triton kernel"
    if mosaic_why is None:
      return "mosaic", (f"Hopper GPU {device.describe()}, K a multiple of {p.block_size[1]}, block_size "
                        f"{tuple(p.block_size)}: the Mosaic GPU kernel")
    if triton_why is None:
      return "triton", (f"Hopper GPU {device.describe()}, but the Mosaic kernel cannot take this problem "
                        f"({mosaic_why}): the portable Triton kernel")
  elif device.has_fp8 and triton_why is None:
    return "triton", f"GPU {device.describe()}: the portable Triton kernel"
  if not device.has_fp8:
    return "xla", f"GPU {device.describe()} has no FP8 conversions: XLA"
  return "xla", f"{triton_why}: XLA"


def choose(p: GemmProblem, *, implementation: str | None = None, config=None, interpret: bool | None = None,
           device: _platform.Device | None = None) -> tuple[str, str]:
  """(implementation, reason): the implementation a call runs, checked to be able to run `p` here."""
  device = device or _platform.device()
  interpret = _platform.resolve_interpret(interpret)
  implementation, reason = _planning.requested(implementation, config, BACKENDS, option="implementation",
                                               default=lambda: _default(p, device, interpret))
  backend = BACKENDS[implementation]
  others = " or ".join(repr(name) for name in IMPLEMENTATIONS if name != implementation)
  if why := backend.unavailable(device, interpret):
    raise ValueError(f"implementation={implementation!r} {why}, or use implementation={others}")
  # A given config's own problems say more than the backend's general limits.
  why = (config is not None and isinstance(config, backend.config_class() or ()) and
         backend.config_problem(p, config)) or backend.unsupported(p)
  if why:
    raise ValueError(f"implementation={implementation!r} cannot run M={p.m}, N={p.n}, K={p.k}, "
                     f"block_size={p.block_size}: {why}; use implementation={others}")
  return implementation, reason


def row_alignment(implementation: str, m: int) -> tuple[int, str]:
  """The padding of a_q's rows that `implementation` reads fastest (for callers that write a_q themselves, as the
  linear's quantizer does), and why."""
  return BACKENDS[implementation].row_alignment(m)


def plan(p: GemmProblem, *, implementation: str | None = None, config=None, interpret: bool | None = None,
         device: _platform.Device | None = None, reason: str | None = None) -> GemmPlan:
  """Chooses the implementation and config of a GEMM problem; raises ValueError/TypeError (naming the argument)
  when what was asked for cannot run here. `reason` overrides the implementation's reason (a caller that chose it)."""
  device = device or _platform.device()
  interpret = _platform.resolve_interpret(interpret)
  implementation, why = choose(p, implementation=implementation, config=config, interpret=interpret, device=device)
  backend = BACKENDS[implementation]
  if config is None:
    config, config_reason = backend.default_config_for(p, device)
  else:
    _planning.given_config(backend, implementation, config, option="implementation")
    if problem_text := backend.config_problem(p, config):
      raise ValueError(f"config cannot run this problem ({problem_text}): {config}")
    config_reason = "given"
  return GemmPlan(p, implementation, config, interpret, reason or why, config_reason, device)


@functools.partial(jax.jit, static_argnames=("plan",))
def run(a_q, b_q, a_s, b_s, bias, valid_rows=None, *, plan: GemmPlan) -> jax.Array:
  """Executes `plan`: C (m, N) in the plan's out_dtype; with `valid_rows` (the plan's problem is `masked`), the rows
  from valid_rows on are 0."""
  p = plan.problem
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if p.empty:
    # Nothing to multiply: an empty sum is 0 (plus the bias).
    out = jnp.zeros((p.m, p.n), jnp.float32)
    if bias is not None:
      out = out + bias[None, :]
    out = out.astype(p.out_dtype)
  elif plan.skips_dead_rows:
    return BACKENDS[plan.implementation].launch_masked(a_q, b_q, a_s, b_s, bias, valid_rows, p, plan.config,
                                                       plan.interpret, plan.device or _platform.device())
  else:
    out = BACKENDS[plan.implementation].launch(a_q, b_q, a_s, b_s, bias, p, plan.config, plan.interpret,
                                               plan.device or _platform.device())
  return xla.live_rows_only(out, valid_rows)
