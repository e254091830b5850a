"""GPU: how fast one kernel can read a weight from HBM at all, the practical floor under a decode GEMM.

  python scripts/bench_weight_read.py OUT.json [--shapes "N,K;N,K"]

The issues' floor is weight bytes / 4.3 TB/s (`jaxfp8.tools.bench_gemm.HBM_BYTES_PER_S`). A whole-weight reduction in
XLA (one fused reduce kernel reading the weight once as 32-bit words and writing only its row or column sums) shows
what a streaming kernel actually reaches on each weight, fixed costs (ramp-up, the tail) included. CUPTI kernel
times, rotating over as many weight copies as the GEMM benchmark (`rotation_sets`), so that none is read from L2.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from jaxfp8.tools import timing
from jaxfp8.tools.args import UsageError, parse_shapes
from jaxfp8.tools.bench_gemm import HBM_BYTES_PER_S, rotation_sets

DEFAULT_SHAPES = [(24576, 7168), (7168, 18432), (10240, 5120), (7168, 2048), (5120, 25600)]


# Column sums and row sums: every word read once, the result (K/4 or N words) negligible. XLA emits a different
# reduction for each; the faster one is the floor taken.
READERS = {
    "column_sums": jax.jit(lambda w: jnp.sum(w, axis=0, dtype=jnp.uint32)),
    "row_sums": jax.jit(lambda w: jnp.sum(w, axis=1, dtype=jnp.uint32)),
}


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--shapes", default=None,
                      help='"N,K;N,K" or shapes.json names (jaxfp8.tools.args; default: the benchmarks\' decode shapes)')
  args = parser.parse_args(argv)
  try:
    shapes = [(s.n, s.k) for s in parse_shapes(args.shapes)] if args.shapes else DEFAULT_SHAPES
  except UsageError as e:
    parser.error(str(e))
  rows = []
  for n, k in shapes:
    weight_bytes = n * k
    keys = jax.random.split(jax.random.key(n + k), rotation_sets(weight_bytes, 0))
    words = [(jax.random.bits(key, (n, k // 4), jnp.uint32),) for key in keys]
    by_reader = {name: timing.median_kernel_us(fn, words, iterations=40) for name, fn in READERS.items()}
    best = min(by_reader, key=by_reader.get)
    us = by_reader[best]
    floor_us = weight_bytes / HBM_BYTES_PER_S * 1e6
    row = dict(n=n, k=k, weight_mb=weight_bytes / 1e6, read_us=us, reader=best, us_by_reader=by_reader,
               floor_us=floor_us, read_over_floor=us / floor_us, read_tb_per_s=weight_bytes / us / 1e6,
               kernels=timing.kernel_names(READERS[best], words[0]))
    rows.append(row)
    print(f"N={n:6d} K={k:6d} {row['weight_mb']:7.1f} MB: read {us:7.1f} us = {row['read_tb_per_s']:.2f} TB/s, "
          f"x{row['read_over_floor']:.2f} the 4.3 TB/s floor ({floor_us:.1f} us); by reader "
          + ", ".join(f"{name} {t:.1f}" for name, t in by_reader.items()) + f"; kernels {row['kernels']}", flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
