"""GPU (H200): check and time the Mosaic GPU block-FP8 GEMM configs (pallas_kernels/gemm_mosaic.py).

  python scripts/bench_gemm_mosaic.py OUT.json [--budget_s 200] [--quick] [--shapes N,K;N,K] [--m 1,16,64]
      [--only decode|medium|prefill|wg3|wg3_tune|small_prefill|cols|choices] [--unscaled] [--torch]

(a) every candidate config against an f32 XLA computation of docs/CONTRACT.md §2 at a few odd shapes (partial row tiles, bias);
(b) CUPTI kernel times (jaxfp8.tools.timing.median_kernel_us) at M in {1, 16, 64, 256, 1024, 4096} for (N, K) =
(24576, 7168) and (7168, 2048): the heuristic's choice first, then the sweep candidates, and the cuBLASLt FP8 GEMM
(XLA dot_general, per-tensor scales, no block scales) as a yardstick. Prints TFLOP/s and, for M <= 64, the ratio to
the weight-streaming floor (weight bytes / 4.3 TB/s). A config that fails to compile or run is logged and skipped.
Stops starting new measurements once --budget_s is spent, and writes the JSON (with what was skipped) either way.

--unscaled adds a diagnostic row per prefill shape: the heuristic's config with the block-scale promotion taken out
(the wgmmas accumulate across all of K in their own accumulator, waited once per step: a plain per-tensor FP8 GEMM in
the same TMA pipeline, warp specialization and epilogue). Its gap to the default row is what the per-128-K promotion
costs; its gap to cuBLASLt is the pipeline's own. Not the contract's math: its output is checked against the unscaled f32
product of the same codes instead (the row's rel_err_vs_unscaled_product).
--torch adds torch `_scaled_mm` blockwise (cuBLASLt, the GEMM's yardstick) to pass 1, timed by the benchmark's own
runner (jaxfp8.tools.bench_gemm) on the same operands, so that the rows above compare with it within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
import traceback

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from jaxfp8 import _platform
from jaxfp8.gemm import mosaic as policy  # the Mosaic GEMM's schedule policy
from jaxfp8.tools import results as results_io, bench_gemm, timing
from jaxfp8.tools.args import UsageError, parse_ms, parse_shapes
from pallas_kernels import gemm_mosaic as gm
from pallas_kernels.gemm_mosaic import Dim, MosaicGemmConfig

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth of the H200 (benchmarks/README.md)
L2_BYTES = 60 << 20
TIMED_SHAPES = [(24576, 7168), (7168, 2048)]
TIMED_M = [1, 16, 64, 256, 1024, 4096]
# (M, N, K, out dtype): partial row tiles, N not a multiple of 256, a short K.
CHECK_CASES = [(36, 1536, 7168, jnp.bfloat16), (300, 7168 + 128, 2048, jnp.bfloat16), (1000, 4096, 512, jnp.float32)]

C = MosaicGemmConfig
# Decode (M <= 64): one consumer warpgroup, 64-row tile, weight streaming.
DECODE = {
    "d64x64_s8_persist": C(tile_m=64, tile_n=64, max_concurrent_steps=8, num_compute_wgs=1),
    "d64x64_s8": C(tile_m=64, tile_n=64, max_concurrent_steps=8, num_compute_wgs=1, persistent=False),
    "d64x64_s5": C(tile_m=64, tile_n=64, max_concurrent_steps=5, num_compute_wgs=1, persistent=False),
    "d64x128_s8": C(tile_m=64, tile_n=128, max_concurrent_steps=8, num_compute_wgs=1, persistent=False),
    "d64x128_s8_persist": C(tile_m=64, tile_n=128, max_concurrent_steps=8, num_compute_wgs=1),
    "d64x256_s5_persist": C(tile_m=64, tile_n=256, max_concurrent_steps=5, num_compute_wgs=1),
    "d64x128_k2_s4": C(tile_m=64, tile_n=128, max_concurrent_steps=4, k_blocks_per_step=2, num_compute_wgs=1,
                       persistent=False),
    "d64x64_k2_s4": C(tile_m=64, tile_n=64, max_concurrent_steps=4, k_blocks_per_step=2, num_compute_wgs=1,
                      persistent=False),
    # Deeper: more weight bytes in flight per SM when fewer CTAs than SMs stream it.
    "d64x64_k2_s6": C(tile_m=64, tile_n=64, max_concurrent_steps=6, k_blocks_per_step=2, num_compute_wgs=1,
                      persistent=False),
    # Shallow enough (84 KiB) for two CTAs per SM: all 160 tiles of N=10240 resident at once.
    "d64x64_k2_s2": C(tile_m=64, tile_n=64, max_concurrent_steps=2, k_blocks_per_step=2, num_compute_wgs=1,
                      persistent=False),
    "d64x128_k1_s8": C(tile_m=64, tile_n=128, max_concurrent_steps=8, num_compute_wgs=1, persistent=False),
}
# Medium M: 2 consumer warpgroups side by side in N.
MEDIUM = {
    "m64x128_n_s7": C(tile_m=64, tile_n=128, max_concurrent_steps=7, wg_split=Dim.N),
    "m64x256_n_s5": C(tile_m=64, tile_n=256, max_concurrent_steps=5, wg_split=Dim.N),
    "m128x128_m_s5": C(tile_m=128, tile_n=128, max_concurrent_steps=5),
}
# Prefill: persistent, 2 consumer warpgroups.
PREFILL = {
    "p128x128_m_s5": C(tile_m=128, tile_n=128, max_concurrent_steps=5),
    "p128x128_m_s5_nminor": C(tile_m=128, tile_n=128, max_concurrent_steps=5, grid_minor_dim=Dim.N),
    "p128x128_m_s5_w16": C(tile_m=128, tile_n=128, max_concurrent_steps=5, grid_tile_width=16),
    "p128x128_m_k2_s3": C(tile_m=128, tile_n=128, max_concurrent_steps=3, k_blocks_per_step=2, epi_tile_n=16),
    "p128x256_n_s4": C(tile_m=128, tile_n=256, max_concurrent_steps=4, wg_split=Dim.N),
    "p256x128_m_s4": C(tile_m=256, tile_n=128, max_concurrent_steps=4),
    "p128x256_m_s4": C(tile_m=128, tile_n=256, max_concurrent_steps=4),
    "p128x128_simple_s4": C(tile_m=128, tile_n=128, max_concurrent_steps=4, warp_specialized=False),
    "p128x128_m_s5_clM": C(tile_m=128, tile_n=128, max_concurrent_steps=5, cluster_dim=Dim.M),
    "p128x128_m_s5_clN": C(tile_m=128, tile_n=128, max_concurrent_steps=5, cluster_dim=Dim.N),
    "p128x256_n_s4_clM": C(tile_m=128, tile_n=256, max_concurrent_steps=4, wg_split=Dim.N,
                           cluster_dim=Dim.M),
}
# Prefill with three consumer warpgroups of 64 rows each: a third wgmma stream to cover each warpgroup's wait and
# promotion, in the registers the two-warpgroup 128x128-per-warpgroup tiles spend on their running accumulators.
THREE_WGS = {
    "p128x256_n_s4": PREFILL["p128x256_n_s4"],
    "p192x128_3m_s4": C(tile_m=192, tile_n=128, max_concurrent_steps=4, num_compute_wgs=3),
    "p192x128_3m_s4_nminor": C(tile_m=192, tile_n=128, max_concurrent_steps=4, num_compute_wgs=3,
                               grid_minor_dim=Dim.N),
    "p192x128_3m_s4_clN": C(tile_m=192, tile_n=128, max_concurrent_steps=4, num_compute_wgs=3, cluster_dim=Dim.N),
    "p192x256_3m_s3": C(tile_m=192, tile_n=256, max_concurrent_steps=3, num_compute_wgs=3),
}
# Around the winner of THREE_WGS (p192x128_3m_s4_clN): pipeline depth, tile order, which operand the CTA pair
# shares, and the pair multicast for the two-warpgroup 128x256 tiles.
_3M = dict(tile_m=192, tile_n=128, num_compute_wgs=3)
THREE_WGS_TUNE = {
    "p192x128_3m_s4_clN": C(**_3M, max_concurrent_steps=4, cluster_dim=Dim.N),
    "p192x128_3m_s5_e16_clN": C(**_3M, max_concurrent_steps=5, epi_tile_n=16, cluster_dim=Dim.N),
    "p192x128_3m_s4_clN_w4": C(**_3M, max_concurrent_steps=4, cluster_dim=Dim.N, grid_tile_width=4),
    "p192x128_3m_s4_clN_w16": C(**_3M, max_concurrent_steps=4, cluster_dim=Dim.N, grid_tile_width=16),
    "p192x128_3m_s4_clM": C(**_3M, max_concurrent_steps=4, cluster_dim=Dim.M),
    "p128x256_n_s4_clN": C(tile_m=128, tile_n=256, max_concurrent_steps=4, wg_split=Dim.N, cluster_dim=Dim.N),
    "p128x256_n_s4_clM": PREFILL["p128x256_n_s4_clM"],
}
# M = 128-256, where the weight read and the math take about as long (measured: Mosaic 0.83-0.88x torch blockwise
# at M=128 on q_proj and Qwen3 qkv, 0.86-0.88x at M=256): the decode schedule (one consumer warpgroup, a CTA per
# tile, 64-row tiles so that M=128 has two row tiles) and one warpgroup over 128 rows, beside the medium schedules.
SMALL_PREFILL = {
    **MEDIUM,
    "d64x128_k2_s4": DECODE["d64x128_k2_s4"],
    "d64x64_k2_s4": DECODE["d64x64_k2_s4"],
    "d64x128_k1_s8": DECODE["d64x128_k1_s8"],
    "s128x128_1wg_k1_s4": C(tile_m=128, tile_n=128, max_concurrent_steps=4, num_compute_wgs=1, persistent=False),
    "p128x128_m_k2_s3": PREFILL["p128x128_m_k2_s3"],
    "p128x128_m_s5": PREFILL["p128x128_m_s5"],
}
GROUPS = {"decode": DECODE, "medium": MEDIUM, "prefill": PREFILL, "wg3": THREE_WGS, "wg3_tune": THREE_WGS_TUNE,
          "small_prefill": SMALL_PREFILL}
CANDIDATES = {**DECODE, **MEDIUM, **PREFILL, **THREE_WGS, **THREE_WGS_TUNE, **SMALL_PREFILL}


def balanced_widths(n: int, row_tiles: int = 1, num_sms: int = 132, count: int = 3, min_width: int = 32,
                    max_waves: int = 2) -> list[int]:
  """Tile widths (multiples of 8 dividing N, min_width..256) whose tile counts (row_tiles x N / width) fill the
  persistent grid's or the SMs' slots best, up to max_waves waves, the widest first among equals: the
  per-column-scale candidates of `--only cols`."""
  tiles = lambda w: row_tiles * (n // w)
  widths = [w for w in range(min_width, 257, 8) if n % w == 0 and tiles(w) <= max_waves * num_sms]
  return sorted(widths, key=lambda w: (-round(policy._balance(tiles(w), num_sms), 2), -w))[:count]


def cols_candidates(m: int, n: int) -> dict[str, MosaicGemmConfig]:
  """Configs at the balanced widths of N. Decode (m <= 64): 64-row tile, one consumer warpgroup, one CTA per tile.
  Larger m: 128-row tiles split in M between two consumer warpgroups (64 x width each) on the persistent grid, one K
  block per step and, where the stages fit, two."""
  out = {}
  if m <= gm.WGMMA_M:
    for w in balanced_widths(n):
      out[f"d64x{w}_k2_s4"] = C(tile_m=64, tile_n=w, max_concurrent_steps=4, k_blocks_per_step=2, num_compute_wgs=1,
                                persistent=False)
      if w <= 96:
        out[f"d64x{w}_k2_s6"] = C(tile_m=64, tile_n=w, max_concurrent_steps=6, k_blocks_per_step=2,
                                  num_compute_wgs=1, persistent=False)
    return out
  for w in balanced_widths(n, row_tiles=math.ceil(m / 128), min_width=64, max_waves=4):
    out[f"p128x{w}_m_s5"] = C(tile_m=128, tile_n=w, max_concurrent_steps=5)
    if w <= 160:  # two fresh accumulators of a sub-tile beside the running ones stay within the registers
      out[f"p128x{w}_m_k2_s3"] = C(tile_m=128, tile_n=w, max_concurrent_steps=3, k_blocks_per_step=2)
  return out


def _fit(config: MosaicGemmConfig, out_dtype=jnp.bfloat16) -> MosaicGemmConfig:
  return policy._fit_smem(config, out_dtype, 1 << 20)


def _problem(key, m, n, k, num_weight_sets=1):
  """Random fp8 operands and scales (never zeros); `num_weight_sets` copies of the weight to defeat the L2."""
  ka, kb, ks, kt = jax.random.split(key, 4)
  a_q = jnp.clip(jax.random.normal(ka, (m, k)) * 60, -448, 448).astype(jnp.float8_e4m3fn)
  a_s = (10.0 ** jax.random.uniform(ks, (k // 128, -(-m // 4) * 4), minval=-3, maxval=-1)).astype(jnp.float32)
  weights = []
  for i in range(num_weight_sets):
    kbi, kti = jax.random.split(jax.random.fold_in(kb, i))
    b_q = jnp.clip(jax.random.normal(kbi, (n, k)) * 60, -448, 448).astype(jnp.float8_e4m3fn)
    b_s = (10.0 ** jax.random.uniform(kti, (n // 128, k // 128), minval=-4, maxval=-2)).astype(jnp.float32)
    weights.append((b_q, b_s))
  return a_q, a_s, weights


@jax.jit
def _reference_f32(a_q, b_q, a_s_col, b_s, bias):
  m, k = a_q.shape
  n = b_q.shape[0]
  groups = k // 128
  a = a_q.astype(jnp.float32).reshape(m, groups, 128)
  b = b_q.astype(jnp.float32).reshape(n, groups, 128)
  b_s_cols = jnp.repeat(b_s, 128, axis=0)

  def body(g, acc):
    part = jax.lax.dot_general(a[:, g], b[:, g], (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return acc + part * a_s_col[g, :m][:, None] * b_s_cols[:, g][None, :]

  return jax.lax.fori_loop(0, groups, body, jnp.zeros((m, n), jnp.float32)) + bias[None, :]


class _UnscaledPlgpu:
  """plgpu, except that the warp-specialized pipeline's carry is a set of wgmma accumulators (`plgpu.ACC`) that live
  across the whole K loop, loaded into registers once at the end for the kernel's own epilogue."""

  def __getattr__(self, name):
    return getattr(plgpu, name)

  @staticmethod
  def emit_pipeline_warp_specialized(body, *, compute_context, **kwargs):
    def context(run_pipeline):
      def run_with_accumulators(init_carry):
        init_values, weight_scales = init_carry
        def scope(*acc_refs):
          run_pipeline((acc_refs, weight_scales))
          return tuple(ref[...] for ref in acc_refs), weight_scales
        return pl.run_scoped(scope, *(plgpu.ACC(v.shape, jnp.float32) for v in init_values))
      return compute_context(run_with_accumulators)
    return plgpu.emit_pipeline_warp_specialized(body, compute_context=context, **kwargs)


def _unscaled_step(carry, a_smem, b_smem, as_smem, bs_gmem, *, k_step, col0, cfg, num_k_blocks, num_n_blocks):
  """The step of gm.scaled_mma_step with the promotion taken out: every K block accumulates in the wgmma
  accumulator; one wait per step, so that the pipeline may release the step's SMEM. The carry's weight scales pass
  through unused."""
  del as_smem, bs_gmem, k_step, col0, num_k_blocks, num_n_blocks
  acc_refs, _ = carry
  wg_m, wg_n = cfg.wg_tile
  subs_n = wg_n // cfg.sub_n
  for i in range(wg_m // gm.WGMMA_M):
    for j in range(subs_n):
      for kb in range(cfg.k_blocks_per_step):
        ks = pl.ds(kb * gm.BLOCK, gm.BLOCK)
        plgpu.wgmma(acc_refs[i * subs_n + j], a_smem.at[pl.ds(i * gm.WGMMA_M, gm.WGMMA_M), ks],
                    b_smem.at[pl.ds(j * cfg.sub_n, cfg.sub_n), ks].T)
  plgpu.wgmma_wait(0)
  return carry


@contextlib.contextmanager
def unscaled_promotion():
  """Diagnostic (module docstring, --unscaled): traces gm's warp-specialized kernel without the block-scale
  promotion. Only for timing; restores the module on exit."""
  saved = gm.plgpu, gm.scaled_mma_step
  gm.plgpu, gm.scaled_mma_step = _UnscaledPlgpu(), _unscaled_step
  try:
    yield
  finally:
    gm.plgpu, gm.scaled_mma_step = saved


def _short(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def check_configs(results: dict, deadline: float, candidates: dict[str, MosaicGemmConfig] = CANDIDATES) -> int:
  """Every candidate config (and the heuristic's) against the f32 reference: bf16 at two odd shapes, f32 at one."""
  failures = 0
  cases = CHECK_CASES
  problems = {}
  for name, config in {"default": None, **candidates}.items():
    for m, n, k, out_dtype in cases:
      key = f"{name} M={m} N={n} K={k} {jnp.dtype(out_dtype).name}"
      if time.monotonic() > deadline:
        results["skipped"].append(f"check {key}")
        continue
      cfg = None if config is None else _fit(config, out_dtype)
      if (m, n, k) not in problems:
        a_q, a_s, [(b_q, b_s)] = _problem(jax.random.key(m + n + k), m, n, k)
        bias = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
        problems[m, n, k] = (a_q, b_q, a_s, b_s, bias), _reference_f32(a_q, b_q, a_s, b_s, bias)
      inputs, expect = problems[m, n, k]
      try:
        cfg = cfg or _default(m, n, k, out_dtype)
        out = jax.jit(lambda *xs, cfg=cfg, out_dtype=out_dtype: gm.block_fp8_matmul(
            *xs[:4], bias=xs[4], out_dtype=out_dtype, config=cfg, num_sms=_platform.num_sms()))(*inputs)
        out32 = out.astype(jnp.float32)
        err = float(jnp.linalg.norm(out32 - expect.astype(out_dtype).astype(jnp.float32)) / jnp.linalg.norm(expect))
        finite = bool(jnp.isfinite(out32).all())
        ok = finite and err <= (2e-4 if out_dtype == jnp.float32 else 5e-3)
        results["checks"].append(dict(case=key, rel_err=err, finite=finite, ok=ok))
        print(f"check {key}: rel_err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        failures += not ok
      except Exception as e:  # noqa: BLE001 - log and keep going
        failures += 1
        results["checks"].append(dict(case=key, ok=False, error=_short(e)))
        print(f"check {key}: ERROR {_short(e)}", file=sys.stderr, flush=True)
        traceback.print_exc(limit=2, file=sys.stderr)
  return failures


def _config_name(c: MosaicGemmConfig) -> str:
  name = f"p{c.tile_m}x{c.tile_n}_{c.num_compute_wgs}{c.wg_split.name.lower()}_k{c.k_blocks_per_step}"
  name += f"_s{c.max_concurrent_steps}"
  return name + (f"_cl{c.cluster_dim.name}" if c.cluster_dim is not None else "")


def _configs_for(m: int, n: int, only: str | None = None) -> dict[str, MosaicGemmConfig]:
  """The sweep candidates for row count m and N (`only` picks one group regardless of m)."""
  if only == "cols":
    return cols_candidates(m, n)
  if only == "choices":  # every schedule policy.default_config weighs for this shape (M > 64)
    return {_config_name(c): c for _, c in policy.prefill_candidates(m, n, _platform.num_sms())}
  if only is not None:
    return GROUPS[only]
  if m <= 64:
    return {**DECODE, "m64x128_n_s7": MEDIUM["m64x128_n_s7"]}
  if m <= 256:
    return {**MEDIUM, "p128x256_n_s4": PREFILL["p128x256_n_s4"]}
  return PREFILL


def _default(m: int, n: int, k: int, out_dtype=jnp.bfloat16) -> MosaicGemmConfig:
  """The schedule the library picks for a_q of m rows on this GPU."""
  return policy.default_config(m, n, k, out_dtype, num_sms=_platform.num_sms())


def _launcher(config: MosaicGemmConfig):
  def fn(a_q, b_q, a_s, b_s):
    return gm.block_fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=jnp.bfloat16, config=config, num_sms=_platform.num_sms())
  return jax.jit(fn)


def _xla_fp8_dot(a_q, b_q, a_s, b_s):
  del a_s, b_s  # cuBLASLt FP8 with no block scales: a yardstick, not the same math
  return jax.lax.dot_general(a_q, b_q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def time_configs(results: dict, deadline: float, quick: bool, shapes=TIMED_SHAPES, ms=TIMED_M,
                 only: str | None = None, unscaled: bool = False, torch: bool = False):
  """Pass 1: the heuristic's config and the cuBLASLt yardstick everywhere (and, with `unscaled`, the heuristic's
  config without the promotion at M > 64). Pass 2: the sweep candidates."""
  weights = {}
  for n, k in shapes:
    num_sets = min(8, max(1, math.ceil(3 * L2_BYTES / (n * k))))  # rotate through > 3x the L2 of weights
    weights[n, k] = _problem(jax.random.key(n + k), 4, n, k, num_sets)[2]
  activations = {}

  def measure(m, n, k, name, config):
    case = f"M={m} N={n} K={k} {name}"
    if time.monotonic() > deadline:
      results["skipped"].append(f"time {case}")
      return
    if (m, k) not in activations:
      activations[m, k] = _problem(jax.random.key(m * 7 + k), m, 128, k)[:2]
    a_q, a_s = activations[m, k]
    arg_sets = [(a_q, b_q, a_s, b_s) for b_q, b_s in weights[n, k]]
    fn = jax.jit(_xla_fp8_dot) if config == "xla" else _launcher(config)
    try:
      us = timing.median_kernel_us(fn, arg_sets, iterations=20 if m <= 256 else 10)
    except Exception as e:  # noqa: BLE001 - a config that fails to compile is logged and skipped
      results["timings"].append(dict(case=case, m=m, n=n, k=k, config=name, error=_short(e)))
      print(f"time {case}: ERROR {_short(e)}", file=sys.stderr, flush=True)
      return
    flops, weight_bytes = 2.0 * m * n * k, n * k
    row = dict(case=case, m=m, n=n, k=k, config=name, us=us, tflops=flops / us / 1e6,
               weight_gbps=weight_bytes / us / 1e3, floor_ratio=us / (weight_bytes / HBM_BYTES_PER_S * 1e6))
    if name == "default_unscaled":
      # Proof that it did the whole product: against the unscaled f32 product of the same codes.
      plain = jnp.dot(a_q.astype(jnp.float32), arg_sets[0][1].astype(jnp.float32).T)
      diff = fn(*arg_sets[0]).astype(jnp.float32) - plain
      row["rel_err_vs_unscaled_product"] = float(jnp.linalg.norm(diff) / jnp.linalg.norm(plain))
    if isinstance(config, MosaicGemmConfig):
      row["config_fields"] = {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config)}
    results["timings"].append(row)
    print(f"time {case:44s}: {us:9.1f} us {row['tflops']:7.1f} TFLOP/s {row['weight_gbps']:6.0f} GB/s "
          f"floor x{row['floor_ratio']:.2f}" + (f" rel_err {row['rel_err_vs_unscaled_product']:.1e} vs the unscaled "
          "product" if name == "default_unscaled" else ""), flush=True)

  torch_mm = bench_gemm._TorchScaledMM() if torch else None

  def measure_torch(m, n, k):
    if time.monotonic() > deadline:
      results["skipped"].append(f"time M={m} N={n} K={k} torch_scaled_mm")
      return
    a_q, a_s = activations[m, k]
    arg_sets = [(a_q, b_q, a_s, b_s) for b_q, b_s in weights[n, k]]
    rows, blocks = results_io.sample_rows_and_blocks(m, n, 128)
    expected, cols = bench_gemm.sample_reference(*arg_sets[0], (128, 128), rows, blocks)

    def record(name, us=None, err=None, error=None, note=None):
      row = dict(case=f"M={m} N={n} K={k} {name}", m=m, n=n, k=k, config=name)
      row.update(dict(error=error) if error is not None else dict(us=us, tflops=2.0 * m * n * k / us / 1e6,
                                                                   rel_err=err, note=note))
      results["timings"].append(row)
      print(f"time {row['case']:44s}: " + (f"{us:9.1f} us {row['tflops']:7.1f} TFLOP/s" if error is None else error),
            flush=True)

    bench_gemm._run_torch(torch_mm, arg_sets, m, (128, 128), expected, rows, cols, 20 if m <= 256 else 10, record,
                          timing.median_kernel_us)

  for n, k in shapes:
    for m in ms:
      measure(m, n, k, "default", _default(m, n, k))
      measure(m, n, k, "xla_fp8_dot", "xla")
      if torch_mm is not None:
        measure_torch(m, n, k)
      if unscaled and m > gm.WGMMA_M:
        with unscaled_promotion():
          measure(m, n, k, "default_unscaled", _default(m, n, k))
  if quick:
    return
  for m in ms:
    for n, k in shapes:
      for name, config in _configs_for(m, n, only).items():
        measure(m, n, k, name, _fit(config))


def summarize(results: dict):
  best: dict[tuple[int, int, int], dict] = {}
  for row in results["timings"]:
    if "us" not in row or row["config"] in ("xla_fp8_dot", "default_unscaled", "torch_scaled_mm"):
      continue
    key = (row["m"], row["n"], row["k"])
    if key not in best or row["us"] < best[key]["us"]:
      best[key] = row
  results["best"] = [dict(m=m, n=n, k=k, config=row["config"], us=row["us"], tflops=row["tflops"],
                          floor_ratio=row["floor_ratio"]) for (m, n, k), row in sorted(best.items())]
  print("\nbest per shape:")
  for row in results["best"]:
    print(f"  M={row['m']:5d} N={row['n']:5d} K={row['k']:5d}: {row['config']:24s} {row['us']:9.1f} us "
          f"{row['tflops']:7.1f} TFLOP/s floor x{row['floor_ratio']:.2f}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out", help="JSON output path")
  parser.add_argument("--budget_s", type=float, default=200.0, help="stop starting new measurements after this")
  parser.add_argument("--quick", action="store_true", help="time only the heuristic's config")
  parser.add_argument("--skip_checks", action="store_true")
  parser.add_argument("--shapes", default=None, help="N,K pairs or shapes.json names separated by ';' "
                      "(jaxfp8.tools.args; default: 24576,7168;7168,2048)")
  parser.add_argument("--m", default=None, help="comma-separated M values (default: 1,16,64,256,1024,4096)")
  parser.add_argument("--only", choices=(*GROUPS, "cols", "choices"), default=None,
                      help="sweep this candidate group at every M instead of the group for each M (cols: the "
                           "balanced per-column-scale widths of each N, decode or 128-row tiles by M; choices: "
                           "every schedule jaxfp8.gemm.mosaic.default_config weighs at M > 64)")
  parser.add_argument("--unscaled", action="store_true", help="add the no-promotion diagnostic rows (docstring)")
  parser.add_argument("--torch", action="store_true", help="add torch _scaled_mm blockwise rows (docstring)")
  args = parser.parse_args()
  try:
    shapes = TIMED_SHAPES if args.shapes is None else [(s.n, s.k) for s in parse_shapes(args.shapes)]
    ms = TIMED_M if args.m is None else list(parse_ms(args.m))
  except UsageError as e:
    parser.error(str(e))
  start = time.monotonic()
  if not _platform.is_hopper():
    print(f"needs a Hopper GPU; found {jax.devices()}", file=sys.stderr)
    return 2
  results: dict = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, checks=[], timings=[],
                       skipped=[])
  failures = 0
  try:
    if not args.skip_checks:
      # Checks get at most 35% of the budget; timing is what this script is for.
      # The swept group only; --only cols and choices have no fixed candidates (they depend on the shape; the GPU
      # tests check those kernels), so they check the heuristic's configs alone.
      candidates = CANDIDATES if args.only is None else GROUPS.get(args.only, {})
      failures = check_configs(results, start + 0.35 * args.budget_s, candidates)
    time_configs(results, start + args.budget_s, args.quick, shapes, ms, args.only, args.unscaled, args.torch)
    summarize(results)
  finally:
    results["elapsed_s"] = time.monotonic() - start
    results["check_failures"] = failures
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
    print(f"wrote {args.out} ({results['elapsed_s']:.0f} s, {failures} check failures, "
          f"{len(results['skipped'])} skipped)", flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
