"""Probe: does the Mosaic decode kernel stream the weight faster when each pipeline step's weight tile is one
contiguous run of memory?

  python scripts/probe_packed_weight.py OUT.json [--shapes "N,K;..."] [--rounds 2]

In the (N, K) layout a decode step's TMA copy of a (tile_n, 256) weight tile reads 256 bytes from each of tile_n
rows that lie K bytes apart; a bare XLA reduction reads the same weight end to end, 1.19-1.22x faster than the decode
kernel on DeepSeek's dense_down (benchmarks/README.md, "The weight-read floor"). Here the weight is rearranged so
that every (tile_n, 256) tile is contiguous, the kernel's B copy indexes that array instead, and both forms are timed
side by side (CUPTI, weight copies rotated past L2), the outputs checked to be identical. A measurement, not a
library feature: the packed layout would serve only configs of that tile width and step depth.
Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from jaxfp8 import gemm
from jaxfp8.tools import bench_gemm, timing
from jaxfp8.kernels import gemm_mosaic as gm

ROWS = gemm.mosaic.DECODE_ROWS


def pack(b_q: jax.Array, tile_n: int, bk: int) -> jax.Array:
  """(N, K) -> (N * K / bk, bk) where rows [(i * K/bk + s) * tile_n, +tile_n) hold tile (i, s)."""
  n, k = b_q.shape
  return b_q.reshape(n // tile_n, tile_n, k // bk, bk).transpose(0, 2, 1, 3).reshape(-1, bk)


@contextlib.contextmanager
def packed_b_spec(k: int):
  original = gm._in_specs

  def specs(cfg, m_idx, n_idx):
    out = original(cfg, m_idx, n_idx)
    bk = gm.BLOCK * cfg.k_blocks_per_step
    steps = k // bk
    out[1] = plgpu.BlockSpec((cfg.tile_n, bk), lambda s: (n_idx * steps + s, 0), transforms=gm._FP8_TRANSFORMS)
    return out

  gm._in_specs = specs
  try:
    yield
  finally:
    gm._in_specs = original


def packed_call(config: gm.MosaicGemmConfig, n: int, k: int, out_rows: int):
  """The decode (one CTA per tile, warp-specialized) launch of block_fp8_matmul, over a packed weight."""
  assert config.warp_specialized and not config.persistent

  def body(a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem):
    gm._ws_kernel(a_gmem, b_gmem, as_gmem, bs_gmem, None, out_gmem, cfg=config)

  def fn(a_q, b_packed, a_s_col, b_s):
    with packed_b_spec(k):
      return plgpu.kernel(
          body, out_type=jax.ShapeDtypeStruct((out_rows, n), jnp.bfloat16),
          grid=(n // config.tile_n, 1), grid_names=("n", "m"),
          num_threads=config.num_compute_wgs + 1, thread_name="wg")(a_q, b_packed, a_s_col, b_s)

  return jax.jit(fn)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out")
  parser.add_argument("--shapes", default="7168,18432;24576,7168;10240,5120")
  parser.add_argument("--out_rows", type=int, default=64)
  parser.add_argument("--tile_n", default="default", help="'default' or a comma list of widths to try")
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  rows = []
  for shape in args.shapes.split(";"):
    n, k = (int(v) for v in shape.split(","))
    a_q, a_s = bench_gemm.make_activation(jax.random.key(k), args.out_rows, k, gm.BLOCK)
    weights = [bench_gemm.make_weight(jax.random.key(n + k + i), n, k, (128, 128))
               for i in range(bench_gemm.rotation_sets(n * k, ROWS * k))]
    a_q, _, a_s, _ = bench_gemm.decode_tile_buffers(a_q, None, a_s, None, ROWS)
    base = gm.default_config(ROWS, n, k)
    widths = [base.tile_n] if args.tile_n == "default" else [int(w) for w in args.tile_n.split(",")]
    floor_us = n * k / bench_gemm.HBM_BYTES_PER_S * 1e6
    for tile_n in widths:
      config = gm._fit_smem(dataclasses.replace(base, tile_n=tile_n), jnp.bfloat16,
                            k // (gm.BLOCK * base.k_blocks_per_step))
      bk = gm.BLOCK * config.k_blocks_per_step
      plain_fn = jax.jit(lambda a, b, sa, sb, config=config: gm.block_fp8_matmul(
          a, b, sa, sb, config=config, out_rows=args.out_rows))
      packed_fn = packed_call(config, n, k, args.out_rows)
      plain_sets = [(a_q, b_q, a_s, b_s) for b_q, b_s in weights]
      packed_sets = [(a_q, jax.block_until_ready(pack(b_q, tile_n, bk)), a_s, b_s) for b_q, b_s in weights]
      same = bool(np.array_equal(np.asarray(plain_fn(*plain_sets[0]).astype(jnp.float32)),
                                 np.asarray(packed_fn(*packed_sets[0]).astype(jnp.float32))))
      for rnd in range(args.rounds):
        for label, fn, sets in (("nk", plain_fn, plain_sets), ("packed", packed_fn, packed_sets)):
          us = timing.median_kernel_us(fn, sets, iterations=60)
          rows.append(dict(n=n, k=k, out_rows=args.out_rows, tile_n=tile_n, layout=label, round=rnd,
                           us=round(us, 2), x_floor=round(us / floor_us, 3), identical_outputs=same,
                           config=str(config)))
          print(json.dumps(rows[-1]), flush=True)
  with open(args.out, "w") as f:
    json.dump({"description": __doc__.splitlines()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
