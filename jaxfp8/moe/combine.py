"""The MoE layer's combine (jaxfp8/moe/layer.py): each token's k result rows, weighted and summed in slot order.

Two implementations of the one formula (docs/CONTRACT.md §8; `combine_slots`): "xla", a gather of every slot's
row (a slot of no local expert gathers row 0, then selects it away) and the sum; "mosaic", the Mosaic GPU combine
(pallas_kernels/combine_rows_mosaic.py), which reads only the valid slots' rows and writes each output row once.
The planner runs the Mosaic one from MOSAIC_MIN_TOKENS tokens where it can run and some slots may be dead, else
XLA's (every slot live, `MoeOptions.every_id_local`: XLA's; `MoeOptions.combine_implementation` overrides).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from jaxfp8 import _planning, _platform

KERNEL_MODULE = "pallas_kernels.combine_rows_mosaic"
IMPLEMENTATIONS = ("mosaic", "xla")
# From this many tokens the Mosaic combine runs by default: on the H200 it took half XLA's time at 4096 tokens
# (DeepSeek-V3 EP8: it reads only the valid slots' rows) but 3-10x XLA's at 64 tokens and below, where its grid of
# (tokens / block_tokens) x (hidden / block_cols) CTAs leaves most of the GPU idle.
MOSAIC_MIN_TOKENS = 2048


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


class CombinePlan(_planning.StepPlan):
  STEP = "combine"


def plan(asked: str | None, tokens: int, top_k: int, hidden: int, out_dtype, device: _platform.Device,
         interpret: bool, every_slot_live: bool = False) -> CombinePlan:
  """The Mosaic combine from MOSAIC_MIN_TOKENS tokens where it runs and some slots may be dead, else XLA's; `asked`
  overrides (a ValueError says why the Mosaic one cannot run here). Every slot live: XLA's, which reads the same rows
  and measured ahead (Qwen3-30B-A3B at 4096 tokens: H200 69.1 against 71.7 us, H100 98.8 against 101.8)."""
  if asked == "xla":
    return CombinePlan("xla", None, interpret, "combine_implementation='xla'")
  why = _platform.unavailable_reason("the Mosaic GPU combine", device, interpret, hopper=True, module=KERNEL_MODULE)
  config = None if why else _kernel().CombineRowsConfig()
  if not why and (problems := _kernel().problems(tokens, top_k, hidden, out_dtype=out_dtype, config=config)):
    why = "; ".join(problems)
  if asked is None:
    because = why
    if not because and tokens < MOSAIC_MIN_TOKENS:
      because = f"{tokens} tokens < {MOSAIC_MIN_TOKENS}: too few CTAs for the Mosaic combine"
    elif not because and every_slot_live:
      because = ("every slot is live (every_id_local): the Mosaic combine's saving, reading only the valid slots' "
                 "rows, is gone")
    if because:
      return CombinePlan("xla", None, interpret, f"XLA's gather of each token's k rows and their sum in slot order "
                         f"({because})")
    return CombinePlan("mosaic", config, interpret, f"the Mosaic GPU combine ({tokens} tokens >= "
                       f"{MOSAIC_MIN_TOKENS}): only the valid slots' rows are read, each output row written once")
  if why:
    raise ValueError(f"combine_implementation='mosaic' cannot run here: {why}; use combine_implementation='xla'")
  return CombinePlan("mosaic", config, interpret, "combine_implementation='mosaic': only the valid slots' rows are "
                     "read")


def combine_slots(y_slots: jax.Array, topk_weights: jax.Array, valid: jax.Array, out_dtype) -> jax.Array:
  """out[t] = sum over slots j, in order, of float32(w[t, j]) * y[t, j] (float32), cast once. y_slots (T, k, H); a
  slot not `valid` adds exactly nothing, whatever its weight (inf, NaN) or its row (never read: selected away)."""
  weights = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
  acc = jnp.zeros(y_slots.shape[::2], jnp.float32)
  for j in range(y_slots.shape[1]):
    acc = acc + weights[:, j, None] * jnp.where(valid[:, j, None], y_slots[:, j], 0.0)
  return acc.astype(out_dtype)


def combine(y: jax.Array, rows: jax.Array, topk_weights: jax.Array, valid: jax.Array, out_dtype,
            plan: CombinePlan) -> jax.Array:
  """(T, H): token t's slot j reads row rows[t, j] of y (where valid), weighted and summed in slot order."""
  if plan.implementation == "mosaic":
    return _kernel().combine_rows(y, rows, topk_weights.astype(jnp.float32), valid.astype(jnp.int32),
                                  out_dtype=out_dtype, config=plan.config, interpret=plan.interpret)
  t, k = rows.shape
  rows = jnp.where(valid, rows, 0)  # a slot of no expert reads row 0, selected away
  return combine_slots(y[rows.reshape(-1)].reshape(t, k, -1), topk_weights, valid, out_dtype)
