"""Runs the grouped GEMM (`ragged_w8a8_block_fp8_matmul`, the default dispatch, or a --gemm_config) once per case
inside a CUDA profiler range, for Nsight Compute's hardware counters: every kernel of the call (the work-item
table's prologue and the GEMM) is profiled, so the GEMM's own time and DRAM throughput show apart from the prologue
that CUPTI's call time sums with it. On the GPU machine:

  ncu --profile-from-start off --clock-control none --set full --import-source yes --export $OUT/grouped \
      python3 scripts/ncu_grouped.py --cases=qwen3_30b_a3b.gate_up:8,dsv3_ep8.gate_up:8
  ncu -i $OUT/grouped.ncu-rep --page details > $OUT/grouped_details.txt
  ncu -i $OUT/grouped.ncu-rep --page source --csv --print-source sass | gzip > $OUT/grouped_src.csv.gz
  python3 scripts/ncu_source_summary.py $OUT/grouped_src.csv.gz

Inputs, compilation and a warm-up call happen before the range opens; each case's output is checked against the
float64 reference on sampled rows (the bench's check) before the profiled call.
"""

import argparse
import ctypes
import glob
import os

import jax
import numpy as np

from jaxfp8.tools import bench_gemm, bench_grouped

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
  parser.add_argument("--cases", default="qwen3_30b_a3b.gate_up:8,qwen3_30b_a3b.down:8,dsv3_ep8.gate_up:8",
                      help="comma-separated EXPERT_SHAPE:ROWS (shapes of jaxfp8.tools.bench_grouped.DEFAULT_SHAPES)")
  parser.add_argument("--gemm_config", default=None, help="a bench --gemm_configs entry ('mosaic:f=v,...'); "
                      "default: the planner's config")
  args = parser.parse_args()
  shapes = {name: (e, n, k) for name, e, n, k in bench_grouped.DEFAULT_SHAPES}
  config = bench_gemm.config_contender(args.gemm_config)[1] if args.gemm_config else None
  rng = np.random.default_rng(0)
  calls = []
  for i, case in enumerate(args.cases.split(",")):
    name, rows = case.split(":")
    e, n, k = shapes[name]
    operands = bench_grouped.make_problem(jax.random.key(i), e, n, k, int(rows), BLOCK_SIZE)
    sizes = bench_grouped.group_sizes(rng, int(rows), e, "balanced")
    fn = bench_grouped.contender("mosaic", BLOCK_SIZE, config=config)
    out = jax.block_until_ready(fn(*operands, sizes))  # compile and warm up
    sample = bench_grouped._sample(sizes, rng)
    expected, cols = bench_grouped.reference_rows(*operands, sample, BLOCK_SIZE)
    err = bench_grouped._error(out, sample, expected, cols, int(rows))
    print(f"{case}: active experts {int((sizes > 0).sum())}, rel err {err:.2e} (bound {bench_grouped.BF16_BOUND})",
          flush=True)
    assert err <= bench_grouped.BF16_BOUND, case
    calls.append((fn, operands, sizes))
  cudart = _cudart()
  cudart.cudaProfilerStart()
  for fn, operands, sizes in calls:
    jax.block_until_ready(fn(*operands, sizes))
  cudart.cudaProfilerStop()
  print("profiled one call of each case", flush=True)


if __name__ == "__main__":
  main()
