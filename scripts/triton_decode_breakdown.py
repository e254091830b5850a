"""Where a Triton GEMM call's time goes, kernel by kernel (CUPTI), for chosen configs at decode shapes.

  python scripts/triton_decode_breakdown.py OUT.json --shapes "64,10240,5120;32,10240,5120" \
      --configs "table;64,32,128,1,4,3,1,0;32,64,128,2,4,3,2,0"

A split-K call is two kernels, the Pallas GEMM writing f32 partials and XLA's reduction of them; ab_gemm.py and the
tuner time their sum. This prints each kernel's median apart (and the call's multiple of the weight-streaming floor),
then times XLA's reduction of random partials written as `sum(axis=0)` against a chain of adds, to see whether the
reduction could be cheaper. Configs: "table" (the shipped table or heuristic, `jaxfp8.gemm.triton_config`) or
block_m,block_n,block_k,group_m,num_warps,num_stages,split_k,swap_ab. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import gemm, timing
from pallas_kernels import gemm_triton

BLOCK_SIZE = (128, 128)
HBM_BYTES_PER_US = 4.3e6  # the weight-streaming floor's 4.3 TB/s


def per_kernel_us(fn, arg_sets, iterations: int) -> tuple[float, dict[str, float]]:
  """(median summed time per call, median time of each kernel name) of fn over rotating argument sets."""
  records = timing.kernel_records(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations)
  per_call = len(records) // iterations
  totals = [sum(us for _, us in records[i * per_call:(i + 1) * per_call]) for i in range(iterations)]
  by_name = collections.defaultdict(list)
  for name, us in records:
    by_name[name].append(us)
  return statistics.median(totals), {name: round(statistics.median(v), 2) for name, v in by_name.items()}


def parse_config(text: str, m: int, n: int, k: int) -> gemm_triton.TritonGemmConfig:
  if text == "table":
    return gemm.triton_config(m, n, k, BLOCK_SIZE)
  fields = [int(v) for v in text.split(",")]
  return gemm_triton.TritonGemmConfig(*fields[:7], bool(fields[7]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--shapes", default="64,10240,5120")
  parser.add_argument("--configs", default="table")
  parser.add_argument("--iterations", type=int, default=60)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for shape in args.shapes.split(";"):
    m, n, k = (int(v) for v in shape.split(","))
    arg_sets = [(jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(jnp.float8_e4m3fn),
                 jnp.asarray(rng.standard_normal((n, k)), jnp.float32).astype(jnp.float8_e4m3fn),
                 jnp.asarray(rng.uniform(0.5, 1, (k // 128, m)), jnp.float32),
                 jnp.asarray(rng.uniform(0.5, 1, (n // 128, k // 128)), jnp.float32)) for _ in range(4)]
    for text in args.configs.split(";"):
      config = parse_config(text, m, n, k)
      fn = jax.jit(lambda a, b, sa, sb, config=config: gemm_triton.block_fp8_matmul(
          a, b, sa, sb, None, block_size=BLOCK_SIZE, a_s_column_major=True, out_dtype=jnp.bfloat16, config=config,
          interpret=False))
      total, kernels = per_kernel_us(fn, arg_sets, args.iterations)
      rows.append(dict(m=m, n=n, k=k, config=str(config), us=round(total, 2), kernels=kernels,
                       x_weight_floor=round(total / (n * k / HBM_BYTES_PER_US), 3)))
      print(json.dumps(rows[-1]), flush=True)
    split = parse_config(args.configs.split(";")[0], m, n, k).split_k
    if split > 1:
      partials = [(jnp.asarray(rng.standard_normal((split, m, n)), jnp.float32),) for _ in range(4)]
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
