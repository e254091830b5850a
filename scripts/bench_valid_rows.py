"""GPU: a linear jitted for a bucket of rows with `valid_rows` live, against the same linear jitted for exactly the
live rows; CUPTI kernel times, one process.

Contenders, per weight (N, K), bucket B and live count V:
  bucket_full   the linear jitted for B rows, no valid_rows (every row computed)
  bucket_valid  the same B-row call with valid_rows=V traced (row tiles past V skipped on the Mosaic GEMM)
  exact         the linear jitted for round_up(V, 64) rows, no valid_rows: what a call of the live rows costs
The issue's target: bucket_valid within 1.1x of exact. Every output is checked against the float64 reference on
sampled live rows, and the rows past V must be 0.

  PYTHONPATH=. python3 scripts/bench_valid_rows.py $OUT/valid_rows_h200.json [--shapes ...] [--cases 4096:2100,...]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxfp8
from jaxfp8 import reference as ref
from jaxfp8.tools import args, results, timing
from jaxfp8.tools.bench_gemm import make_weight, rotation_sets

BLOCK = (128, 128)
FLAGS = flags.FLAGS
flags.DEFINE_string("shapes", "deepseek_v3.q_proj_no_lora;deepseek_v3.dense_down;qwen3_32b.qkv_proj",
                    "weights, ';'-separated (model.layer or N,K)")
flags.DEFINE_string("cases", "4096:2100,4096:1000,1024:300,256:70", "bucket:live pairs, ','-separated")
flags.DEFINE_integer("iterations", 20, "calls per CUPTI median")


def _check(out, x, w64, live: int) -> float:
  """Relative error of sampled live rows against float64; raises if a row past `live` is not 0."""
  out = np.asarray(out).astype(np.float64)
  if (out[live:] != 0).any():
    raise AssertionError(f"a row past valid_rows={live} is not 0")
  rows, _ = results.sample_rows_and_blocks(live, 1, 1)
  return ref.relative_error(out[rows], np.asarray(x[rows]).astype(np.float64) @ w64.T)


def measure(label: str, n: int, k: int, cases, iterations: int, log=print) -> list[dict]:
  rows = []
  key = jax.random.key(n * 3 + k)
  weights = [make_weight(jax.random.fold_in(key, i), n, k, BLOCK) for i in range(rotation_sets(n * k, 0))]
  w64 = ref.dequantize_weight_blockwise(np.asarray(weights[0][0]), np.asarray(weights[0][1]), BLOCK)
  plain = jax.jit(lambda x, w_q, w_s: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, BLOCK))
  masked = jax.jit(lambda x, w_q, w_s, v: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, BLOCK, valid_rows=v))
  for bucket, live in cases:
    exact_rows = -(-live // 64) * 64
    xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (bucket, k), jnp.bfloat16) for i in range(len(weights))]
    valid = jnp.int32(live)
    row = dict(shape=label, n=n, k=k, bucket=bucket, live=live, exact_rows=exact_rows,
               plan=str(jaxfp8.linear.explain(xs[0], weights[0][0], BLOCK, valid_rows=True)).splitlines()[1].strip())
    row["rel_err"] = _check(masked(xs[0], *weights[0], valid), xs[0], w64, live)
    row["bucket_full_us"] = timing.median_kernel_us(plain, [(x, *w) for x, w in zip(xs, weights)],
                                                    iterations=iterations)
    row["bucket_valid_us"] = timing.median_kernel_us(masked, [(x, *w, valid) for x, w in zip(xs, weights)],
                                                     iterations=iterations)
    row["exact_us"] = timing.median_kernel_us(plain, [(x[:exact_rows], *w) for x, w in zip(xs, weights)],
                                              iterations=iterations)
    row["valid_vs_exact"] = row["bucket_valid_us"] / row["exact_us"]
    log(results.row_line(row))
    rows.append(row)
  return rows


def markdown_table(result: dict) -> str:
  lines = [results.cupti_caption(result, "x: bucket with valid_rows / exact rows (target <= 1.1)."), "",
           "| weight | bucket | live | bucket, all rows | bucket, valid_rows | exact rows | x | rel. err |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['shape']} | {r['bucket']} | {r['live']} | {r['bucket_full_us']:.1f} | "
                 f"{r['bucket_valid_us']:.1f} | {r['exact_us']:.1f} ({r['exact_rows']}) | {r['valid_vs_exact']:.2f} | "
                 f"{r['rel_err']:.3g} |")
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: bench_valid_rows.py OUT.json [--shapes ...] [--cases B:V,...]")
  shapes = args.parse_shapes(FLAGS.shapes, flag="--shapes")
  try:
    cases = [tuple(int(v) for v in case.split(":")) for case in FLAGS.cases.split(",")]
  except ValueError:
    raise app.UsageError(f"--cases: bucket:live pairs, got {FLAGS.cases!r}") from None
  if any(len(c) != 2 or not 0 < c[1] <= c[0] for c in cases):
    raise app.UsageError(f"--cases: each pair needs 0 < live <= bucket, got {FLAGS.cases!r}")
  results.run_shapes("python3 scripts/bench_valid_rows.py " + " ".join(sys.argv[1:]), shapes,
                     lambda shape: measure(shape.name, shape.n, shape.k, cases, FLAGS.iterations), argv[1],
                     markdown_table)


if __name__ == "__main__":
  app.run(main)
