"""The MoE layer's dispatch at decode (jaxfp8/moe/layer.py `dispatch`): the routed slots in expert order and the
grouped GEMMs' work-item table.

Two implementations: "xla", the counting sort as XLA reductions (three dependent kernels at decode: the rows, the
table's item indices, the table's pick), and "mosaic", the same counts in one Mosaic GPU kernel of one warpgroup
(pallas_kernels/dispatch_mosaic.py) for up to 64 routed slots, whose outputs are the XLA form's bit for bit (the
planner's default where it runs).
"""

from __future__ import annotations

import importlib

import jax

from jaxfp8 import _planning, _platform
from jaxfp8.grouped import mosaic as grouped_mosaic

KERNEL_MODULE = "pallas_kernels.dispatch_mosaic"
IMPLEMENTATIONS = ("mosaic", "xla")
# Whether the planner takes the Mosaic dispatch by default where it runs. H100, the whole layer against XLA's three
# kernels (`scripts/ab_moe_plan.py mosaic_dispatch`, off / on / off, us): DeepSeek-V3 EP8 at 1 / 8 tokens 21.18,
# 21.23 / 20.51; 108.89, 109.49 / 108.69; Qwen3-30B-A3B 31.97, 31.95 / 31.06; 103.39, 104.02 / 102.06.
MOSAIC_BY_DEFAULT = True


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


class SortPlan(_planning.StepPlan):
  STEP = "dispatch"


def plan(asked: str | None, slots: int, experts: int, tile_m: int | None, device: _platform.Device,
         interpret: bool) -> SortPlan:
  """The Mosaic dispatch where it runs (MOSAIC_BY_DEFAULT), else XLA's; `asked` overrides (a
  ValueError says why the Mosaic one cannot run here). tile_m: the row tile of the table both grouped GEMMs read
  (None: they read none the kernel builds, the Mosaic GEMMs with one table from the rows)."""
  if asked == "xla":
    return SortPlan("xla", None, interpret, "dispatch_implementation='xla'")
  why = _platform.unavailable_reason("the Mosaic GPU dispatch", device, interpret, hopper=True, module=KERNEL_MODULE)
  if not why and tile_m is None:
    why = ("the grouped GEMMs read no work-item table built from the sorted rows (the XLA GEMMs, aligned expert rows, "
           "or two tables)")
  config = None if why else _kernel().DispatchConfig(tile_m)
  if not why:
    width = grouped_mosaic.table_columns(slots, experts, tile_m)
    why = "; ".join(_kernel().problems(slots, experts, config, width)) or None
  if asked is None:
    if why or not MOSAIC_BY_DEFAULT:
      because = why or "the Mosaic dispatch turned off by default (sort.MOSAIC_BY_DEFAULT)"
      return SortPlan("xla", None, interpret, f"XLA's counting sort ({because})")
    return SortPlan("mosaic", config, interpret, f"the Mosaic GPU dispatch ({slots} slots <= "
                    f"{_kernel().MAX_SLOTS}): the rows, the order and the work-item table in one kernel")
  if why:
    raise ValueError(f"dispatch_implementation='mosaic' cannot run here: {why}; use dispatch_implementation='xla'")
  return SortPlan("mosaic", config, interpret, "dispatch_implementation='mosaic': the rows, the order and the "
                  "work-item table in one kernel")


def run(ids: jax.Array, experts: int, plan: SortPlan):
  """(rows (R,), order (R,), live (R,), table (5, `grouped.mosaic.table_columns`)) of the routed ids (R,) int32
  (`plan`'s Mosaic implementation)."""
  width = grouped_mosaic.table_columns(ids.shape[0], experts, plan.config.tile_m)
  return _kernel().decode_dispatch(ids, experts=experts, num_items=width, config=plan.config,
                                   interpret=plan.interpret)
