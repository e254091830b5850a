"""Where a Triton GEMM call's time goes, kernel by kernel (CUPTI), for chosen configs at decode shapes.

  python scripts/triton_decode_breakdown.py OUT.json --shapes "64,10240,5120;32,10240,5120" \
      --configs "table;64,32,128,1,4,3,1,0;32,64,128,2,4,3,2,0"

A split-K call is two kernels, the Pallas GEMM writing f32 partials and XLA's reduction of them; ab_gemm.py and the
tuner time their sum. This prints each kernel's median apart (and the call's multiple of the weight-streaming floor),
then times XLA's reduction of random partials written as `sum(axis=0)` against a chain of adds, to see whether the
reduction could be cheaper. Configs: "table" (the shipped table or heuristic, `jaxfp8.gemm.triton.get_config`) or
block_m,block_n,block_k,group_m,num_warps,num_stages,split_k,swap_ab. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jaxfp8 import _platform, gemm
from jaxfp8.tools import bench_gemm, timing
from jaxfp8.tools.args import UsageError, parse_shapes
from pallas_kernels import gemm_triton

BLOCK_SIZE = (128, 128)


def per_kernel_us(fn, arg_sets, iterations: int) -> tuple[float, dict[str, float]]:
  total, by_name = timing.median_kernel_us_by_name(fn, arg_sets, iterations=iterations)
  return total, {name: round(us, 2) for name, us in by_name.items()}


def parse_config(text: str, m: int, n: int, k: int) -> gemm_triton.TritonGemmConfig:
  if text == "table":
    return gemm.triton.get_config(m, n, k, BLOCK_SIZE, device_kind=jax.devices()[0].device_kind,
                                  num_sms=_platform.num_sms())
  fields = [int(v) for v in text.split(",")]
  return gemm_triton.TritonGemmConfig(*fields[:7], bool(fields[7]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--shapes", default="64,10240,5120")
  parser.add_argument("--configs", default="table")
  parser.add_argument("--iterations", type=int, default=60)
  args = parser.parse_args()
  try:
    parsed = parse_shapes(args.shapes)
  except UsageError as e:
    parser.error(str(e))
  if any(not s.ms for s in parsed):
    parser.error(f"--shapes: every item needs its M (M,N,K), got {args.shapes!r}")
  rows = []
  for m, n, k in [(m, s.n, s.k) for s in parsed for m in s.ms]:
    a_q, a_s = bench_gemm.make_activation(jax.random.key(m), m, k, BLOCK_SIZE[1])
    weights = [bench_gemm.make_weight(jax.random.key(n + k + i), n, k, BLOCK_SIZE)
               for i in range(bench_gemm.rotation_sets(n * k, m * k))]
    arg_sets = [(a_q, b_q, a_s, b_s) for b_q, b_s in weights]
    configs = [parse_config(text, m, n, k) for text in args.configs.split(";")]
    for config in configs:
      fn = jax.jit(lambda a, b, sa, sb, config=config: gemm_triton.block_fp8_matmul(
          a, b, sa, sb, None, block_size=BLOCK_SIZE, a_s_column_major=True, out_dtype=jnp.bfloat16, config=config,
          interpret=False))
      total, kernels = per_kernel_us(fn, arg_sets, args.iterations)
      rows.append(dict(m=m, n=n, k=k, config=str(config), us=round(total, 2), kernels=kernels,
                       x_weight_floor=round(total / (n * k / bench_gemm.HBM_BYTES_PER_S * 1e6), 3)))
      print(json.dumps(rows[-1]), flush=True)
    split = gemm_triton.split_k_steps(k, configs[0])[1]
    if split > 1:
      partials = [(jax.random.normal(jax.random.key(i), (split, m, n), jnp.float32),) for i in range(4)]
      for label, reduce in (("sum(axis=0)", lambda p: p.sum(axis=0).astype(jnp.bfloat16)),
                            ("chained adds", lambda p: sum(p[i] for i in range(p.shape[0])).astype(jnp.bfloat16))):
        total, kernels = per_kernel_us(jax.jit(reduce), partials, args.iterations)
        rows.append(dict(reduce=label, split_k=split, m=m, n=n, us=round(total, 2), kernels=kernels))
        print(json.dumps(rows[-1]), flush=True)
  with open(args.out, "w") as f:
    json.dump({"description": __doc__.splitlines()[0], "command": " ".join(["scripts/triton_decode_breakdown.py",
              args.out, "--shapes", repr(args.shapes), "--configs", repr(args.configs)]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
