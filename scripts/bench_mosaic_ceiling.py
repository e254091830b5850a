"""How close JAX's own Mosaic GPU matmul comes to cuBLAS on the H200: a yardstick for what a Pallas Mosaic kernel
written in Python reaches, beside our FP8 kernel's gap to cuBLASLt.

  python scripts/bench_mosaic_ceiling.py OUT.json [--m 4096 --n 24576 --k 7168] [--budget_s 150]

Times jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu (bf16, a handful of its tuning configs) and XLA's bf16 dot
(cuBLAS), and beside them our FP8 kernel and cuBLASLt's per-tensor FP8 GEMM, in one process with CUPTI kernel
times; every bf16 output is compared with the XLA product (rel_err_vs_xla).
"""

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from jaxfp8.tools import bench_gemm, timing


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--m", type=int, default=4096)
  parser.add_argument("--n", type=int, default=24576)
  parser.add_argument("--k", type=int, default=7168)
  parser.add_argument("--budget_s", type=float, default=150.0)
  args = parser.parse_args()
  m, n, k = args.m, args.n, args.k
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
  flops = 2.0 * m * n * k
  xla_dot = jax.jit(jnp.dot)  # bf16 out, f32 accumulation: one cuBLAS GEMM
  expect = xla_dot(a, b).astype(jnp.float32)
  rows = []

  def record(name, fn):
    out = fn(a, b).astype(jnp.float32)
    err = float(jnp.linalg.norm(out - expect) / jnp.linalg.norm(expect))
    us = timing.median_kernel_us(fn, [(a, b)], iterations=10)
    rows.append(dict(name=name, us=us, tflops=flops / us / 1e6, rel_err_vs_xla=err))
    print(f"{name:60s} {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s rel_err {err:.1e}", flush=True)

  record("xla_bf16_dot (cuBLAS)", xla_dot)
  # Our FP8 kernel and cuBLASLt's FP8 GEMM (per-tensor, no block scales) on the same shape in the same process.
  a_q, a_s = bench_gemm.make_activation(jax.random.key(2), m, k, 128)
  b_q, b_s = bench_gemm.make_weight(jax.random.key(3), n, k, (128, 128))
  fp8_rows = {}
  for name, contender in [("ours fp8 block-scaled (default config)", "mosaic"),
                          ("xla fp8 dot, per-tensor (cuBLASLt)", "fp8_per_tensor")]:
    fn = bench_gemm.jax_contender(contender, (128, 128))
    us = timing.median_kernel_us(fn, [(a_q, b_q, a_s, b_s)], iterations=10)
    fp8_rows[name] = dict(name=name, us=us, tflops=flops / us / 1e6)
    print(f"{name:60s} {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s", flush=True)
  dims = hm.MatmulDimension
  start = time.monotonic()
  for (tile_m, tile_n), cluster, wg_dim, minor, width in itertools.product(
      ((128, 256), (256, 128), (128, 128)), (dims.M, None), (dims.N, dims.M), (dims.N, dims.M), (16, 8)):
    if time.monotonic() - start > args.budget_s:
      print("budget spent")
      break
    for steps in (4, 3, 2):  # the deepest pipeline that fits in shared memory
      config = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=steps, epi_tile_n=64,
                               epi_tile_m=64, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg_dim,
                               cluster_dimension=cluster)
      name = f"mgpu {tile_m}x{tile_n} s{steps} wg{wg_dim} minor{minor} w{width} cl{cluster}"
      try:
        record(name, jax.jit(lambda x, y, config=config: hm.matmul(x, y, None, config)))
        break
      except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
        if "shared memory" not in str(e):
          print(f"{name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
          break
  best = min((r for r in rows if r["name"].startswith("mgpu")), key=lambda r: r["us"], default=None)
  cublas = rows[0]
  ours, lt = fp8_rows.values()
  summary = dict(m=m, n=n, k=k, rows=rows, fp8_rows=list(fp8_rows.values()), best=best,
                 best_over_cublas=None if best is None else cublas["us"] / best["us"],
                 fp8_ours_over_cublaslt=lt["us"] / ours["us"])
  json.dump(summary, open(args.out, "w"), indent=1)
  if best:
    print(f"best Mosaic {best['name']}: {best['tflops']:.0f} TFLOP/s, {summary['best_over_cublas']:.3f}x cuBLAS "
          f"({cublas['tflops']:.0f}); ours FP8 block-scaled {summary['fp8_ours_over_cublaslt']:.3f}x cuBLASLt per-tensor")


if __name__ == "__main__":
  main()
