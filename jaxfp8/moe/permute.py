"""The MoE layer's permute (jaxfp8/moe/layer.py): each live routed row's token codes gathered into expert order.

Two implementations: "mosaic", the Mosaic GPU row gather (pallas_kernels/gather_rows_mosaic.py), which moves only the
live rows; "xla", a gather of every routed row (the rows past the live ones all read row 0, which costs no HBM read
after the first, but every row is written). The scales, a few bytes per row, are gathered by XLA either way.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from jaxfp8 import _planning, _platform

KERNEL_MODULE = "pallas_kernels.gather_rows_mosaic"


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


class PermutePlan(_planning.StepPlan):
  STEP = "row gather"


def plan(gemm_implementation: str, hidden: int, device: _platform.Device, interpret: bool) -> PermutePlan:
  """The Mosaic row gather beside the Mosaic grouped GEMMs where it takes the rows, else XLA's gather."""
  if gemm_implementation != "mosaic":
    return PermutePlan("xla", None, interpret, f"the {gemm_implementation} grouped GEMMs: XLA's gather of every row")
  why = _platform.unavailable_reason("the Mosaic GPU row gather", device, interpret, hopper=True, module=KERNEL_MODULE)
  config = None if why else _kernel().GatherRowsConfig()
  if not why and (problems := _kernel().problems(hidden, jnp.float8_e4m3fn, config)):
    why = "; ".join(problems)
  if why:
    return PermutePlan("xla", None, interpret, f"the Mosaic row gather cannot run ({why}): XLA's gather of every row")
  return PermutePlan("mosaic", config, interpret, "beside the Mosaic grouped GEMMs: only the live rows are moved")


def gather(x_q: jax.Array, source: jax.Array, live: jax.Array, plan: PermutePlan, divisor: int = 1) -> jax.Array:
  """(R, H): row r < live is x_q[source[r] // divisor] (the kernel divides: no index kernel before it); the rows past
  `live` are unspecified. Every source[r] // divisor must be a row of x_q."""
  if plan.implementation == "mosaic":
    return _kernel().gather_rows(x_q, source, live, config=plan.config, src_divisor=divisor,
                                 interpret=plan.interpret)
  return x_q[source // divisor]
