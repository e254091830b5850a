"""Runs our Mosaic FP8 GEMM and cuBLASLt's per-tensor FP8 GEMM (or the --contenders named) once each inside a CUDA
profiler range, for Nsight Compute's hardware counters (the H200 machines run ncu; see the device notes):

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

from jaxfp8 import _platform, gemm
from jaxfp8.tools import bench_gemm

BLOCK_SIZE = (128, 128)


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
  parser.add_argument("--contenders", default="mosaic,fp8_per_tensor",
                      help="comma-separated jaxfp8.bench_gemm contenders to profile, one call each")
  args = parser.parse_args()
  m, n, k = args.m, args.n, args.k
  a_q, a_s = bench_gemm.make_activation(jax.random.key(0), m, k, BLOCK_SIZE[1])
  b_q, b_s = bench_gemm.make_weight(jax.random.key(1), n, k, BLOCK_SIZE)
  names = args.contenders.split(",")
  contenders = [bench_gemm.jax_contender(name, BLOCK_SIZE) for name in names]
  configs = {"mosaic": lambda: gemm.mosaic.default_config(m, n, k, num_sms=_platform.num_sms()),
             "triton": lambda: gemm.triton.get_config(m, n, k, BLOCK_SIZE, device_kind=jax.devices()[0].device_kind,
                                                      num_sms=_platform.num_sms())}
  for name in names:
    if name in configs:
      print(f"{name} config:", configs[name](), flush=True)
  jax.block_until_ready([fn(a_q, b_q, a_s, b_s) for fn in contenders])  # compile and warm up
  cudart = _cudart()
  cudart.cudaProfilerStart()
  for fn in contenders:
    jax.block_until_ready(fn(a_q, b_q, a_s, b_s))
  cudart.cudaProfilerStop()
  print("profiled one call of each", flush=True)


if __name__ == "__main__":
  main()
