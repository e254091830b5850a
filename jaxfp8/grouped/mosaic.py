"""The Mosaic GPU grouped-GEMM backend (Hopper): what it runs, its schedule heuristic, and its launch.

The kernel (pallas_kernels/grouped_gemm_mosaic.py) builds any config it is given; the choice lives here. The two
schedules are the dense GEMM's (jaxfp8/gemm/mosaic.py) for the rows one expert sees: the decode schedule where an
expert's rows fit in one 64-row tile (the weights stream once, spread over many CTAs), a 128x128 tile on two
consumer warpgroups above that. They have not been tuned for grouped problems on a GPU yet.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp

from jaxfp8 import _checks, _platform
from jaxfp8.gemm import mosaic as dense

KERNEL_MODULE = "pallas_kernels.grouped_gemm_mosaic"
CONFIG_CLASS = "MosaicGemmConfig"
BLOCK = dense.BLOCK
WGMMA_M = dense.WGMMA_M


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


def config_class():
  return _kernel().MosaicGemmConfig


def rows_per_group(problem) -> float:
  """The rows one group sees on average (balanced routing): the schedule's row count."""
  if problem.layout == "masked":
    return problem.rows
  return problem.rows / max(problem.groups, 1)


def default_config(problem):
  """The schedule for `problem` (see the module docstring), fitted to shared memory."""
  K = _kernel()
  if rows_per_group(problem) <= WGMMA_M:
    config = K.MosaicGemmConfig(tile_m=WGMMA_M, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=2,
                                num_compute_wgs=1, persistent=False, weight_scales_ahead=True)
  else:
    # The persistent grid visits 8 work items (mostly of one expert) per column tile before moving on, so that an
    # expert's weight tiles are read from L2 by all of its row tiles. One K block per step: its consumers hold one
    # wgmma accumulator beside the running one, which fits the launch's 168 registers a thread where JAX 0.12 drops
    # setmaxnreg (dense.register_split_kept). On the H200 at 4096 routed rows it ran the same under JAX 0.11.2 and
    # 0.12 and level with two K blocks per step under 0.11.2 (DeepSeek-V3 EP8 gate_up / down, Qwen3-30B-A3B gate_up
    # / down: 457.5 / 248.1 / 147.7 / 96.1 us against 471.1 / 256.9 / 144.3 / 99.1; under 0.12 454.2 / 251.3 /
    # 145.0 / 99.1; scripts/jax012_ab.sh with GROUPED=1).
    config = K.MosaicGemmConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=1,
                                num_compute_wgs=2, grid_minor_dim=K.Dim.M, grid_tile_width=8)
  return fit_smem(config, problem.out_dtype, problem.k)


def fit_smem(config, out_dtype, k: int):
  """`config` with max_concurrent_steps lowered until it fits in shared memory (and to at most the K steps)."""
  K = _kernel()
  return K.fit_smem(config, k, lambda c: K.smem_bytes(c, out_dtype))


# ---- the backend interface the planner asks -------------------------------------------------------------------------

def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Mosaic GPU grouped GEMM", device, interpret, hopper=True,
                                      module=KERNEL_MODULE)


def unsupported(problem) -> str | None:
  if tuple(problem.block_size) != (BLOCK, BLOCK):
    return f"it implements block_size=(128, 128) only, got {tuple(problem.block_size)}"
  problems = []
  if problem.n % BLOCK:
    problems.append(f"N={problem.n} must be a multiple of {BLOCK}")
  if problem.k % BLOCK:
    problems.append(f"K={problem.k} must be a multiple of {BLOCK}")
  return "; ".join(problems) or None


def default_config_for(problem, device: _platform.Device):
  del device
  config = default_config(problem)
  kind = "decode" if config.tile_m == WGMMA_M else "prefill"
  return config, (f"the {kind} schedule for {rows_per_group(problem):g} rows per group "
                  f"({'at most' if kind == 'decode' else 'more than'} one {WGMMA_M}-row tile)")


def config_problem(problem, config) -> str | None:
  return "; ".join(_kernel().config_problems(config, problem.n, problem.out_dtype)) or None


def _column_major(a_s, rows: int, column_major: bool):
  """a_s as the kernel reads it: (..., K/128, R') column-major with R' >= rows and R' % 4 == 0."""
  a_s_col = a_s if column_major else jnp.swapaxes(a_s[..., :rows, :], -1, -2)
  if a_s_col.shape[-1] % 4:
    a_s_col = a_s_col[..., :rows]
    pad = [(0, 0)] * (a_s_col.ndim - 1) + [(0, _checks.round_up(rows, 4) - rows)]
    a_s_col = jnp.pad(a_s_col, pad, constant_values=1.0)
  return a_s_col


def launch(a_q, b_q, a_s, b_s, counts, problem, config, interpret: bool, device: _platform.Device):
  K = _kernel()
  f = K.ragged_block_fp8_matmul if problem.layout == "ragged" else K.masked_block_fp8_matmul
  return f(a_q, b_q, _column_major(a_s, problem.rows, problem.a_s_column_major), b_s, counts,
           out_dtype=problem.out_dtype, config=config, num_sms=device.num_sms,
           zero_unowned_rows=problem.zero_unowned_rows, interpret=interpret)
