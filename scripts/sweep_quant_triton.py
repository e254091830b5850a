"""GPU: time Triton quantizer configs at a few shapes (CUPTI), to pick the default heuristic. Prints a table.

  python scripts/sweep_quant_triton.py
"""

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import quant
from jaxfp8.tools import timing
from pallas_kernels.quant_triton import QuantTritonConfig


def main() -> None:
  shapes = [(64, 7168), (1024, 7168), (4096, 7168), (16384, 2048)]
  rng = np.random.default_rng(0)
  for m, k in shapes:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    results = []
    for rows, gpb, warps in itertools.product((1, 2, 4, 8, 16), (2, 4, 8), (2, 4, 8)):
      if rows * gpb * 128 > 64 * 1024 or (m <= 64 and rows > 16):
        continue
      config = QuantTritonConfig(block_rows=rows, groups_per_block=gpb, num_warps=warps)
      fn = jax.jit(lambda v, config=config: quant.per_token_group_quant_fp8(
          v, 128, column_major_scales=True, scale_tma_aligned=True, row_alignment=4, implementation="triton",
          config=config))
      try:
        us = timing.median_kernel_us(fn, [(x,)], iterations=10)
      except Exception as e:
        print(f"  {config}: {type(e).__name__} {str(e)[:100]}", file=sys.stderr)
        continue
      results.append((us, rows, gpb, warps))
    results.sort()
    num_bytes = m * k * 3
    print(f"M={m} K={k}: best " + ", ".join(f"{us:.2f}us rows={r} gpb={g} warps={w} ({num_bytes / us / 1e3:.0f} GB/s)"
                                            for us, r, g, w in results[:4]), flush=True)


if __name__ == "__main__":
  main()
