"""Runs our Mosaic FP8 GEMM and cuBLASLt's per-tensor FP8 GEMM once each inside a CUDA profiler range, for Nsight
Compute's hardware counters (the H200 machines run ncu; see the device notes):

  ncu --profile-from-start off --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section WarpStateStats --export $OUT/gemm python3 scripts/ncu_gemm.py \
      --m 4096 --n 24576 --k 7168

Everything else (input generation, compilation, a warm-up call) happens before the range opens, so the report
holds the two GEMM kernels only.
"""

import argparse
import ctypes
import glob
import os

import jax
import jax.numpy as jnp

from pallas_kernels import gemm_mosaic as gm


def _cudart():
  """libcudart, for cudaProfilerStart/Stop: the system's or the one JAX's CUDA plugin brought."""
  names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "/usr/local/cuda/lib64/libcudart.so"]
  site_packages = os.path.dirname(os.path.dirname(jax.__file__))
  for pattern in ("cu*", "cuda_runtime"):
    names += sorted(glob.glob(os.path.join(site_packages, "nvidia", pattern, "lib", "libcudart.so*")))
  for name in names:
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  raise RuntimeError(f"no libcudart found among {names}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--m", type=int, default=4096)
  parser.add_argument("--n", type=int, default=24576)
  parser.add_argument("--k", type=int, default=7168)
  args = parser.parse_args()
  m, n, k = args.m, args.n, args.k
  a_q = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.float8_e4m3fn)
  b_q = jax.random.normal(jax.random.key(1), (n, k), jnp.float32).astype(jnp.float8_e4m3fn)
  a_s = jax.random.uniform(jax.random.key(2), (k // 128, m), jnp.float32, 0.5, 2.0)
  b_s = jax.random.uniform(jax.random.key(3), (n // 128, k // 128), jnp.float32, 0.5, 2.0)
  ours = jax.jit(lambda x, y, xs, ys: gm.block_fp8_matmul(x, y, xs, ys, out_dtype=jnp.bfloat16))
  per_tensor = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=jnp.bfloat16))
  print("config:", gm.default_config(m, n, k), flush=True)
  jax.block_until_ready((ours(a_q, b_q, a_s, b_s), per_tensor(a_q, b_q)))  # compile and warm up
  cudart = _cudart()
  cudart.cudaProfilerStart()
  jax.block_until_ready(ours(a_q, b_q, a_s, b_s))
  jax.block_until_ready(per_tensor(a_q, b_q))
  cudart.cudaProfilerStop()
  print("profiled one call of each", flush=True)


if __name__ == "__main__":
  main()
