"""The Mosaic GPU grouped-GEMM backend (Hopper): what it runs, its schedule heuristic, and its launch.

The kernel (pallas_kernels/grouped_gemm_mosaic.py) builds any config it is given; the choice lives here, by the rows
one expert sees: where they fit in one 64-row tile, the dense GEMM's decode schedule (jaxfp8/gemm/mosaic.py: the
weights stream once, spread over many CTAs); above that 64x256 tiles on two consumer warpgroups side by side, whose
64-row work items waste little where an expert's rows end inside a tile (measured on the H200 against the dense
GEMM's 128x128 prefill tile).
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
  elif problem.n % (2 * BLOCK) == 0:
    # 64x256 tiles, two consumers side by side along N, persistent: a work item is one 64-row tile, so an expert
    # boundary inside a tile costs 64 rows computed twice, not 128 (or one idle consumer of a 128-row tile, which
    # still paces the other's pipeline). One K block per step: each consumer holds one wgmma accumulator beside the
    # running one, which fits the launch's registers where JAX 0.12 drops setmaxnreg (dense.register_split_kept).
    # On the H200 (balanced routing) it beat 128x128 tiles split along M at 11 of 12 prefill points: DeepSeek-V3 EP8
    # gate_up at 4096 / 16384 routed rows 385.5 / 998.9 us vs 467.0 / 1054.8, Qwen3-30B-A3B gate_up at 32768 274.1 vs
    # 299.8, down 185.4 vs 194.9; level at 1024 rows per expert (DeepSeek-V3 gate_up 1919.4 vs 1889.1, down 1005.9
    # vs 1022.9); benchmarks/grouped_prefill_h200.md.
    config = K.MosaicGemmConfig(tile_m=WGMMA_M, tile_n=2 * BLOCK, max_concurrent_steps=4, k_blocks_per_step=1,
                                num_compute_wgs=2, wg_split=K.Dim.N, grid_minor_dim=K.Dim.M, grid_tile_width=8)
  else:
    # An N of an odd number of 128-column blocks: 128x128 tiles on two consumers split along M, the idle one of a
    # tile that holds only another expert's rows skipping its wgmmas. One K block per step, as above.
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
  kind = "decode" if not config.persistent else "prefill"
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
