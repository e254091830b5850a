"""The quantizer's planner: every decision a call needs (implementation, kernel config), each with its reason.

`plan(problem, ...)` is the one place a quantization call is decided; `run(plan, ...)` executes a plan without
checking anything again. The backends (`xla`, `triton`, `mosaic` in this package) say what they can run and own
their config heuristics; this module holds the rule that chooses between them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _planning, _platform
from jaxfp8.quant import mosaic, triton, xla

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
BACKENDS = {"mosaic": mosaic, "triton": triton, "xla": xla}
SCALE_LAYOUTS = ("row", "col", "col_packed")

# On the H200 the Triton kernel is up to 0.16 us faster than the Mosaic one below about half a million values (a
# launch-bound regime), and the Mosaic kernel is faster above (up to 1.4x at 16384 x 18432); benchmarks/README.md.
MOSAIC_MIN_ELEMENTS = 1 << 19
DEFAULT_EPS = 1e-10  # the floor of a group's absolute maximum when the caller gives none (docs/CONTRACT.md §1)


@dataclasses.dataclass(frozen=True)
class QuantProblem:
  """One quantization call, arrays described by their shapes: x (batch, rows, k_in) -> q (batch, out_rows, k)."""
  batch: int
  rows: int
  k_in: int
  dtype: str                  # x's dtype name
  group_size: int
  eps: float
  out_rows: int               # rows of q (rows padded to the row alignment)
  scale_layout: str           # "row", "col" or "col_packed"
  scale_cols: int             # columns of the column-major scales (>= out_rows)
  scale_ue8m0: bool = False
  fuse_silu_and_mul: bool = False
  # False: the rows past valid_rows are unspecified (a caller that never reads them); a backend may leave them
  # unwritten (the Mosaic kernel skips blocks of pad rows only) or write them as when True (q = 0, scale 1.0).
  pad_rows_written: bool = True
  # > 0: gathered rows (the MoE layer's quantize-and-permute): row r of q is row source[r] // gather_divisor of x, and
  # `rows` counts q's rows (x's own row count is free)
  gather_divisor: int = 0

  @property
  def k(self) -> int:
    return self.k_in // 2 if self.fuse_silu_and_mul else self.k_in

  @property
  def groups(self) -> int:
    return self.k // self.group_size

  @property
  def num_elements(self) -> int:
    return self.batch * self.rows * self.k

  @property
  def empty(self) -> bool:
    return self.batch * self.out_rows == 0 or self.k == 0

  @property
  def scale_rows(self) -> int:
    """Rows the scales cover: out_rows, or the column-major scales' (TMA-padded) columns."""
    return self.out_rows if self.scale_layout == "row" else self.scale_cols


def for_gemm(gemm_implementation: str, device: _platform.Device, interpret: bool, asked: str | None = None,
             gemm_kind: str = "GEMM") -> tuple[str, str]:
  """(implementation, reason) of the quantizer that feeds a GEMM: the one `asked` for (quant_implementation), else the
  GEMM family's own kernel, which writes the buffers that GEMM reads; the Mosaic GEMM falls back to the Triton
  quantizer where its own is unavailable."""
  if asked is not None:
    return asked, f"quant_implementation={asked!r} was asked for"
  if gemm_implementation == "mosaic" and (why := mosaic.unavailable(device, interpret)):
    return "triton", f"the Mosaic {gemm_kind}'s own quantizer is unavailable ({why}): the Triton quantizer"
  return gemm_implementation, f"the {gemm_implementation} {gemm_kind}'s own quantizer, writing the buffers it reads"


def problem(batch: int, rows: int, k_in: int, dtype, *, group_size: int, eps: float, row_alignment: int = 1,
            scale_layout: str = "row", scale_tma_aligned: bool = False, scale_ue8m0: bool = False,
            fuse_silu_and_mul: bool = False, pad_rows_written: bool = True, gather_divisor: int = 0) -> QuantProblem:
  """The problem of quantizing x (batch, rows, k_in) with rows padded to a multiple of `row_alignment`; with
  gather_divisor > 0, of the `rows` rows x[source[r] // gather_divisor] (batch 1, `run`'s source)."""
  out_rows = _checks.round_up(rows, row_alignment)
  scale_cols = _checks.round_up(out_rows, 4) if scale_tma_aligned else out_rows
  return QuantProblem(batch, rows, k_in, jnp.dtype(dtype).name, group_size, float(eps), out_rows, scale_layout,
                      scale_cols, bool(scale_ue8m0), bool(fuse_silu_and_mul), bool(pad_rows_written),
                      int(gather_divisor))


@dataclasses.dataclass(frozen=True)
class QuantPlan:
  """What a quantization call runs and why (hashable: it is the static part of the jitted call)."""
  problem: QuantProblem
  implementation: str
  config: Any                 # the kernel config that runs (None for "xla")
  interpret: bool
  reason: str                 # why this implementation
  config_reason: str = ""     # why this config

  def __str__(self) -> str:
    mode = " (interpreted)" if self.interpret and self.implementation != "xla" else ""
    config = f"; config {self.config} ({self.config_reason})" if self.config is not None else ""
    pad = "" if self.problem.pad_rows_written else "; pad rows past valid_rows unspecified (their reader skips them)"
    return f"{self.implementation} quantizer{mode}: {self.reason}{config}{pad}"


def _default(p: QuantProblem, device: _platform.Device, interpret: bool) -> tuple[str, str]:
  """(implementation, reason) when none is asked for."""
  if interpret and device.capability is not None:
    return "xla", "interpret=True and no implementation named: XLA (name one to interpret its kernel)"
  if device.is_hopper:
    mosaic_why = mosaic.unavailable(device, interpret) or mosaic.unsupported(p)
    if p.num_elements < MOSAIC_MIN_ELEMENTS and not triton.unavailable(device, interpret):
      return "triton", (f"Hopper GPU {device.describe()}, {p.num_elements} values < {MOSAIC_MIN_ELEMENTS}: the Triton "
                        "kernel (measured faster than the Mosaic one in this launch-bound range)")
    if mosaic_why is None:
      return "mosaic", f"Hopper GPU {device.describe()}: the Mosaic GPU kernel"
    if not triton.unavailable(device, interpret):
      return "triton", f"Hopper GPU {device.describe()}, but the Mosaic kernel cannot run this ({mosaic_why}): Triton"
  if device.has_fp8 and not triton.unavailable(device, interpret):
    return "triton", f"GPU {device.describe()}: the portable Triton kernel"
  if device.capability is None:
    return "xla", f"no NVIDIA GPU (device {device.describe()}): XLA"
  return "xla", f"GPU {device.describe()} has no FP8 conversions: XLA"


def plan(p: QuantProblem, *, implementation: str | None = None, config=None, interpret: bool | None = None,
         device: _platform.Device | None = None, reason: str | None = None, option: str = "implementation"
         ) -> QuantPlan:
  """Chooses the implementation and config of a quantization problem; raises ValueError/TypeError (naming the
  argument) when what was asked for cannot run here. `reason` overrides the implementation's reason (a caller that
  chose it); `option` is the name errors give the implementation argument (the linear's `quant_implementation`)."""
  reason_override = reason
  device = device or _platform.device()
  interpret = _platform.resolve_interpret(interpret)
  implementation, reason = _planning.requested(implementation, config, BACKENDS, option=option,
                                               default=lambda: _default(p, device, interpret))
  backend = BACKENDS[implementation]
  if why := backend.unavailable(device, interpret):
    raise ValueError(f"{option}={implementation!r} {why}, or use {option}='xla'")
  if why := backend.unsupported(p):
    raise ValueError(f"{option}={implementation!r} cannot quantize this: {why}")
  if config is None:
    config, config_reason = backend.default_config_for(p, device)
  else:
    _planning.given_config(backend, implementation, config, option=option)
    config_reason = "given"
  return QuantPlan(p, implementation, config, interpret, reason_override or reason, config_reason)


@functools.partial(jax.jit, static_argnames=("plan",))
def run(x3: jax.Array, masked_m: jax.Array | None, *, plan: QuantPlan,
        source: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Executes `plan` on x3 (batch, rows, k_in): q (batch, out_rows, k) and the scales in the plan's layout. A
  gathering plan (gather_divisor > 0) quantizes the rows x3[:, source // gather_divisor] (source int32 (rows,)):
  the Mosaic kernel reads them where they are; the other backends gather them first. masked_m: int32, its first
  `batch` entries the valid rows of each batch (a longer vector reaches the Mosaic kernel as it is: the MoE layer's
  live count fills every entry of its dispatch reduction's output, and slicing one out is a kernel of its own)."""
  p = plan.problem
  backend = BACKENDS[plan.implementation]
  if p.gather_divisor and not getattr(backend, "GATHERS_ROWS", False):
    x3 = jnp.take(x3, source // p.gather_divisor, axis=1)
    source = None
  if masked_m is None:
    valid_rows = jnp.full((p.batch,), p.rows, jnp.int32)
  elif getattr(backend, "CLIPS_VALID_ROWS", False):
    valid_rows = masked_m  # at decode a separate clip would be a kernel of its own
  else:
    valid_rows = jnp.clip(masked_m[:p.batch], 0, p.rows)
  if p.empty:
    return _empty_outputs(p)
  if source is not None:
    return backend.launch(x3, valid_rows, p, plan.config, plan.interpret, source=source)
  return backend.launch(x3, valid_rows, p, plan.config, plan.interpret)


def _empty_outputs(p: QuantProblem) -> tuple[jax.Array, jax.Array]:
  """Nothing to launch: empty codes, and scales that are all pad entries (1.0, or packed exponent words of 0)."""
  q = jnp.zeros((p.batch, p.out_rows, p.k), jnp.float8_e4m3fn)
  if p.scale_layout == "row":
    return q, jnp.ones((p.batch, p.out_rows, p.groups), jnp.float32)
  if p.scale_layout == "col":
    return q, jnp.ones((p.batch, p.groups, p.scale_cols), jnp.float32)
  return q, jnp.zeros((p.batch, -(-p.groups // 4), p.scale_cols), jnp.int32)
