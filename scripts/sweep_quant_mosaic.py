"""GPU (Hopper): time Mosaic GPU quantizer configs at a few shapes (CUPTI), to pick the default heuristic.

  python3 scripts/sweep_quant_mosaic.py [--quick] [--only=0,3,5]

--quick: 3 shapes, 5 configs (about a minute); --only: the SHAPES to run, by index (the full sweep is 8 shapes x 21
configs, a few minutes, mostly compilation). Prints, per shape, the default config's time and the best configs, with
GB/s (bytes = read x + write q and scales, live rows only).
"""

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import quant
from jaxfp8.tools import timing
from pallas_kernels import quant_mosaic as qm

# (E, T, K, valid rows per batch entry or None, options)
COL = dict(column_major_scales=True, scale_tma_aligned=True, row_alignment=4)
PACKED = dict(scale_ue8m0=True, pack_ue8m0=True, scale_tma_aligned=True, row_alignment=4)
SHAPES = [
    (1, 1, 7168, None, COL),
    (1, 64, 7168, None, COL),
    (1, 1024, 7168, None, COL),
    (1, 4096, 7168, None, COL),
    (1, 4096, 7168, None, PACKED),
    (1, 16384, 2048, None, COL),
    (1, 4096, 18432, None, COL),
    (8, 1024, 7168, 256, COL),  # masked MoE layout: a quarter of the rows live
]
# One block per CTA (latency hidden by CTAs sharing an SM), 2 KiB to 64 KiB of bf16 per block ...
CONFIGS = [None] + [
    qm.QuantMosaicConfig(block_rows=r, groups_per_block=g)
    for r, g in itertools.product((4, 8, 16, 32, 64), (2, 4, 8)) if 8 <= r * g <= 256
] + [  # ... and a pipeline inside the CTA over 4, 7 or all 14 blocks of 512 columns of K = 7168.
    qm.QuantMosaicConfig(block_rows=r, groups_per_block=4, blocks_per_cta=b, num_stages=s)
    for r, b, s in ((8, 14, 3), (16, 14, 2), (16, 14, 3), (16, 4, 2), (32, 7, 2), (32, 14, 3))
]


def main(argv: list[str]) -> None:
  quick = "--quick" in argv
  shapes, configs = SHAPES, CONFIGS
  if quick:
    shapes = [SHAPES[i] for i in (0, 1, 3)]
    configs = CONFIGS[:1] + [c for c in CONFIGS[1:] if c.block_rows in (4, 16) and c.groups_per_block == 4]
  for arg in argv:
    if arg.startswith("--only="):
      shapes = [SHAPES[int(i)] for i in arg.split("=", 1)[1].split(",")]
  rng = np.random.default_rng(0)
  for experts, rows, k, live, options in shapes:
    sweep_shape(rng, experts, rows, k, live, options, configs, quick)


def sweep_shape(rng, experts: int, rows: int, k: int, live: int | None, options: dict, configs, quick: bool) -> None:
  """Times every config on one shape; prints the default's time and the five fastest."""
  sets = max(1, min(4, (256 << 20) // (experts * rows * k * 2)))  # rotate inputs beyond the 60 MB L2
  arg_sets = []
  for _ in range(sets):
    x = jnp.asarray(rng.standard_normal((experts, rows, k)), jnp.bfloat16)
    arg_sets.append((x if experts > 1 else x[0],))
  masked_m = None if live is None else jnp.full((experts,), live, jnp.int32)
  live_rows = experts * (rows if live is None else live)
  num_bytes = live_rows * k * 3 + live_rows * (k // 128) * 4  # bf16 in, fp8 out, f32 scales (live rows only)
  results = []
  for config in configs:
    fn = jax.jit(lambda v, config=config: quant.per_token_group_quant_fp8(
        v, 128, masked_m=masked_m, implementation="mosaic", config=config, **options))
    try:
      us = timing.median_kernel_us(fn, arg_sets, iterations=10 if quick else 20)
    except Exception as e:  # a config that does not fit is reported, not fatal
      print(f"  {config}: {type(e).__name__} {str(e)[:120]}", file=sys.stderr, flush=True)
      continue
    results.append((us, config))
  default_us = next((us for us, c in results if c is None), None)
  results.sort(key=lambda r: r[0])
  name = "packed" if options is PACKED else "col"
  default = "FAILED" if default_us is None else f"{default_us:.2f}us ({num_bytes / default_us / 1e3:.0f} GB/s)"
  print(f"E={experts} T={rows} K={k} live={live} {name}: default {default}; best:", flush=True)
  for us, config in results[:5]:
    print(f"    {us:8.2f}us {num_bytes / us / 1e3:6.0f} GB/s  {config}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
