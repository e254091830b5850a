"""GPU (H200): does TMA's zero fill of the rows past M make the Mosaic GEMM slower at decode?

  python scripts/decode_padding_check.py OUT.json

For M in {4, 16, 32} (and M = 64, no padding, for scale) on DeepSeek-V3 dense_down and q_proj_no_lora and Qwen3-32B
qkv_proj, CUPTI kernel times of the default Mosaic config with a_q (M, K) as it is (TMA fills rows M..63 of the
64-row tile), with a_q and the scales padded to 64 rows beforehand (the quantizer's row_alignment=64) and out_rows=M,
with the padding done by two XLA pads inside the timed call, and with only the scales or only a_q padded. Each
variant's output must equal the plain call's bit for bit (same_as_plain). Weights rotate through > 3x the L2.
Session 5's run: benchmarks/archive/mosaic_decode_padding_h200.json.
"""
import json
import math
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "scripts")
import bench_gemm_mosaic as b  # noqa: E402
from jaxfp8 import timing  # noqa: E402
from jaxfp8.kernels import gemm_mosaic as gm  # noqa: E402

ROWS = gm.WGMMA_M


def main(out_path: str) -> None:
  rows_out = []
  for n, k in [(7168, 18432), (10240, 5120), (24576, 7168)]:
    num_sets = min(8, max(1, math.ceil(3 * b.L2_BYTES / (n * k))))
    weights = b._problem(jax.random.key(n + k), 4, n, k, num_sets)[2]
    floor = n * k / b.HBM_BYTES_PER_S * 1e6
    for m in (4, 16, 32, 64):
      a_q, a_s = b._problem(jax.random.key(m * 7 + k), m, 128, k)[:2]
      a_q64 = jnp.pad(a_q, ((0, ROWS - m), (0, 0)))
      a_s64 = jnp.pad(a_s, ((0, 0), (0, ROWS - a_s.shape[1])))
      cfg = gm.default_config(m, n, k)
      call = lambda a, bq, s, bs, rows=None: gm.block_fp8_matmul(a, bq, s, bs, config=cfg, out_rows=rows)
      variants = {
          "plain": (call, a_q, a_s),
          "prepadded_both": (lambda a, bq, s, bs: call(a, bq, s, bs, m), a_q64, a_s64),
          "pad_in_call": (lambda a, bq, s, bs: call(jnp.pad(a, ((0, ROWS - m), (0, 0))), bq,
                                                    jnp.pad(s, ((0, 0), (0, ROWS - s.shape[1]))), bs, m), a_q, a_s),
          "prepadded_a_s_only": (call, a_q, a_s64),
          "prepadded_a_q_only": (lambda a, bq, s, bs: call(a, bq, s, bs, m), a_q64, a_s),
      }
      plain = None
      for name, (fn, aq, s) in variants.items():
        if m == ROWS and name != "plain":
          continue
        f = jax.jit(fn)
        out = f(aq, weights[0][0], s, weights[0][1]).astype(jnp.float32)
        plain = out if plain is None else plain
        same = bool(jnp.array_equal(out, plain))
        us = timing.median_kernel_us(f, [(aq, bq, s, bs) for bq, bs in weights], iterations=20)
        rows_out.append(dict(n=n, k=k, m=m, variant=name, us=us, floor_ratio=us / floor, tile_n=cfg.tile_n,
                             same_as_plain=same))
        print(f"N={n:5d} K={k:5d} M={m:2d} {name:20s} {us:7.1f} us floor x{us / floor:.2f} same={same}", flush=True)
  with open(out_path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, script="scripts/decode_padding_check.py",
                   timings=rows_out), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
