"""The linear's planner: the GEMM's plan and the quantizer's plan, made once per call shape, and `apply`.

The linear decides nothing of its own beyond how the two ops meet: it asks the GEMM planner for the implementation
and the row padding its kernel reads fastest, then has the quantizer write exactly those buffers (rows padded,
scales in the GEMM's layout), and `apply` runs both plans without checking anything again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
from jax import lax

from jaxfp8 import _checks, _platform, gemm, quant
from jaxfp8 import _transforms as transforms
from jaxfp8.linear import backward


@dataclasses.dataclass(frozen=True)
class LinearOptions:
  """What the caller asked for, besides the arrays (hashable: part of the executable cache key). Validated here."""
  implementation: str | None = None
  quant_implementation: str | None = None
  row_alignment: int | None = None
  config: Any = None
  interpret: bool | None = None
  backward: str = "fp8"         # the gradient's mode (jaxfp8.linear.backward)

  def __post_init__(self):
    _checks.one_of("implementation", self.implementation, gemm.IMPLEMENTATIONS)
    _checks.one_of("quant_implementation", self.quant_implementation, quant.IMPLEMENTATIONS)
    if self.row_alignment is not None:
      object.__setattr__(self, "row_alignment", _checks.positive_int("row_alignment", self.row_alignment))
    if self.config is not None and not (dataclasses.is_dataclass(self.config) and
                                        self.config.__dataclass_params__.frozen):
      raise TypeError(f"config must be a GEMM kernel config (TritonGemmConfig or MosaicGemmConfig), "
                      f"got {type(self.config).__name__}")
    object.__setattr__(self, "interpret", _checks.interpret(self.interpret))
    _checks.one_of("backward", self.backward, backward.BACKWARDS, none=False)


@dataclasses.dataclass(frozen=True)
class LinearPlan:
  """What a linear call runs and why (`explain` returns it). `str(plan)`: the decisions, one line each."""
  m: int
  n: int
  k: int
  block_size: tuple[int, int]
  out_dtype: str
  row_alignment: int            # the quantizer pads M up to a multiple of this
  row_reason: str
  quant: quant.QuantPlan
  gemm: gemm.GemmPlan
  options: LinearOptions = LinearOptions()

  @property
  def masked(self) -> bool:
    """Whether the call takes a traced `valid_rows` (rows past it are not quantized or multiplied and come out 0)."""
    return self.gemm.problem.masked

  @property
  def implementation(self) -> str:
    return self.gemm.implementation

  @property
  def quant_implementation(self) -> str:
    return self.quant.implementation

  @property
  def config(self):
    """The GEMM kernel config that runs."""
    return self.gemm.config

  @property
  def quant_config(self):
    return self.quant.config

  @property
  def reason(self) -> str:
    return self.gemm.reason

  @property
  def interpret(self) -> bool:
    return self.gemm.interpret

  @property
  def scale_layout(self) -> str:
    """"col": column-major TMA-aligned (K/gk, M_pad') scales; "row": (M, K/gk)."""
    return self.quant.problem.scale_layout

  @property
  def padded_rows(self) -> int:
    """Rows of the quantized activations (the GEMM computes only the first M of them)."""
    return self.quant.problem.out_rows

  @property
  def gemm_out_rows(self) -> int | None:
    """The GEMM's `out_rows`: M where the quantizer padded the rows, else None."""
    return self.m if self.padded_rows != self.m else None

  def summary(self) -> str:
    pallas = self.implementation != "xla" or self.quant_implementation != "xla"
    mode = " (interpreted)" if self.interpret and pallas else ""
    rows = (f"M={self.m} padded to {self.padded_rows} rows by the quantizer, the GEMM computes {self.m}"
            if self.padded_rows != self.m else f"M={self.m}, no padding")
    layout = "column-major" if self.scale_layout == "col" else "row-major"
    if self.masked:
      rows += (", valid_rows live (the GEMM skips the row tiles past it)" if self.gemm.skips_dead_rows else
               ", valid_rows live (the GEMM computes every row, then zeroes those past it)")
    return (f"{self.implementation} GEMM + {self.quant_implementation} quantizer{mode}; {rows}; {layout} scales; "
            f"N={self.n}, K={self.k}, block_size={self.block_size}, out {self.out_dtype}")

  def __str__(self) -> str:
    return "\n".join([self.summary(), f"  GEMM: {self.gemm}", f"  quantizer: {self.quant}",
                      f"  rows: {self.row_reason}"])


def plan(m: int, n: int, k: int, block_size: tuple[int, int], out_dtype, x_dtype, options: LinearOptions,
         has_bias: bool = False, device: _platform.Device | None = None, masked: bool = False) -> LinearPlan:
  """The plans of a linear call of M rows (M = 0 plans as M = 1: nothing runs, but `explain` still answers), for
  `device` (default: the device programs are built for now); `masked`: the call passes a traced `valid_rows`.
  Plans are cached by all of these (a plan is a pure function of them): eager calls plan on every call."""
  return _plan(m, n, k, tuple(block_size), jnp.dtype(out_dtype), jnp.dtype(x_dtype), options, has_bias,
               device or _platform.device(), masked, _platform.resolve_interpret(options.interpret))


@functools.lru_cache(maxsize=4096)
def _plan(m, n, k, block_size, out_dtype, x_dtype, options, has_bias, device, masked, interpret) -> LinearPlan:
  live = max(m, 1)
  implementation, reason = gemm.planner.choose(
      gemm.problem(live, n, k, block_size, out_dtype=out_dtype, has_bias=has_bias, masked=masked),
      implementation=options.implementation, config=options.config, interpret=interpret, device=device)
  if options.row_alignment is not None:
    alignment, row_reason = options.row_alignment, f"row_alignment={options.row_alignment} was asked for"
  else:
    alignment, row_reason = gemm.row_alignment(implementation, live)
  rows = _checks.round_up(m, alignment)
  column_major = implementation != "xla"  # the kernels read column-major scales; XLA needs no transpose
  gemm_plan = gemm.plan(
      gemm.problem(m, n, k, block_size, rows=rows, out_dtype=out_dtype, a_s_column_major=column_major,
                   has_bias=has_bias, masked=masked),
      implementation=implementation, config=options.config, interpret=interpret, device=device, reason=reason)
  quant_implementation, quant_reason = quant.planner.for_gemm(implementation, device, interpret,
                                                              options.quant_implementation)
  # A GEMM that skips the row tiles past valid_rows never reads the rows there but in the tile holding the count's
  # boundary, whose rows past it it computes and then selects away: their codes need not be written.
  quant_plan = quant.plan(
      quant.problem(1, m, k, x_dtype, group_size=block_size[1], eps=quant.planner.DEFAULT_EPS,
                    row_alignment=alignment, scale_layout="col" if column_major else "row",
                    scale_tma_aligned=column_major, pad_rows_written=not gemm_plan.skips_dead_rows),
      implementation=quant_implementation, interpret=interpret, device=device, reason=quant_reason,
      option="quant_implementation")
  return LinearPlan(m, n, k, tuple(block_size), out_dtype.name, alignment, row_reason, quant_plan, gemm_plan, options)


def forward(x, w_q, w_s, bias, plan: LinearPlan, valid_rows=None):
  """Quantize (into the GEMM's buffers, padded by the quantizer itself), GEMM, (..., N). Traceable; checks nothing.
  Under `jax.vmap` each op folds the mapped axis into its rows (`quant.transformable`, `gemm.transformable`).
  valid_rows (a masked plan): the quantizer's rows past it are pad rows (left unwritten in whole blocks where the GEMM
  skips them) and the GEMM returns 0 there."""
  lead = tuple(x.shape[:-1])
  x3 = jnp.reshape(x, (1, math.prod(lead), x.shape[-1]))
  if plan.masked:
    q, s = quant.transformable(plan.quant, None, masked=True)(x3, jnp.reshape(valid_rows, (1,)))
    q, s = lax.squeeze(q, (0,)), lax.squeeze(s, (0,))
  else:
    q, s = quant.transformable(plan.quant, None, masked=False)(x3, None)
  args = (q, w_q, s, w_s) + (() if bias is None else (bias,)) + ((valid_rows,) if plan.masked else ())
  out = gemm.transformable(plan.gemm, plan.options.config, has_bias=bias is not None)(*args)
  return out.reshape(*lead, plan.n)


def apply(x, w_q, w_s, bias, plan: LinearPlan, w_q_t=None, valid_rows=None):
  """`forward` with the linear's gradient (`backward`): what a traced call of the linear runs."""
  transforms.refuse_forward_mode("jaxfp8.w8a8_block_fp8_linear", backward.FORWARD_MODE_HINT, x, w_s, bias)
  static = (tuple(x.shape), jnp.dtype(x.dtype), None if bias is None else jnp.dtype(bias.dtype),
            transforms.varying_axes(x), None if bias is None else transforms.varying_axes(bias))
  return backward.linear(x, w_q, w_s, bias, w_q_t, valid_rows, plan, forward, static)
