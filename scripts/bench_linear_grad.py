"""GPU: forward + backward of one linear layer (y and dx = dy @ W), FP8 against bf16, CUPTI kernel times, one process.

Contenders, per weight (N, K) and row count M:
  fp8_fwd       the FP8 linear's forward alone (quantize x, block-FP8 GEMM)
  fp8_fwd_bwd   forward + backward="fp8" (dy quantized per 1 x 128, the block-FP8 GEMM against W^T's codes, which
                the layer holds: `Fp8LinearWeight.with_transpose`)
  bf16_bwd      forward + backward="bf16" (dy against the dequantized weight in bf16)
  bf16_layer    the same layer in bf16: y = x @ W^T and dx = dy @ W with a bf16 W (dequantized once, outside the
                timing), XLA's dots: what the layer costs without FP8
Every output is checked against the float64 reference on sampled rows (dx to docs/CONTRACT.md §6's bound).

  PYTHONPATH=. python3 scripts/bench_linear_grad.py $OUT/grad_h200.json [--shapes deepseek_v3.q_proj_no_lora,...]
      [--m 1,64,1024,4096]
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
                    "weights, ';'-separated: shapes.json names or N,K pairs (jaxfp8.tools.args)")
flags.DEFINE_string("m", "1,64,1024,4096", "row counts")
flags.DEFINE_integer("iterations", 20, "calls per CUPTI median")


def _contenders():
  """name -> jitted f(x, dy, w_q, w_s, w_q_t, w_bf16): the weights are arguments, never baked-in constants."""
  def fp8(backward):
    def fwd_bwd(x, dy, w_q, w_s, w_q_t, w_bf16):
      del w_bf16
      f = lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, BLOCK, backward=backward, w_q_t=w_q_t)
      y, vjp = jax.vjp(f, x)
      return y, vjp(dy)[0]
    return jax.jit(fwd_bwd)

  def bf16_layer(x, dy, w_q, w_s, w_q_t, w_bf16):
    del w_q, w_s, w_q_t
    y, vjp = jax.vjp(lambda x: jnp.dot(x, w_bf16.T, preferred_element_type=jnp.float32).astype(x.dtype), x)
    return y, vjp(dy)[0]

  def fwd(x, dy, w_q, w_s, w_q_t, w_bf16):
    del dy, w_q_t, w_bf16
    return jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, BLOCK)

  return {"fp8_fwd": jax.jit(fwd), "fp8_fwd_bwd": fp8("fp8"), "bf16_bwd": fp8("bf16"),
          "bf16_layer": jax.jit(bf16_layer)}


def _check(name, out, x, dy, w64) -> float:
  """Relative error of dx (or y for the forward alone) on sampled rows against float64."""
  rows, _ = results.sample_rows_and_blocks(x.shape[0], 1, 1)
  if name == "fp8_fwd":
    return ref.relative_error(np.asarray(out[rows]).astype(np.float64),
                              np.asarray(x[rows]).astype(np.float64) @ w64.T)
  return ref.relative_error(np.asarray(out[1][rows]).astype(np.float64),
                            np.asarray(dy[rows]).astype(np.float64) @ w64)


def measure(label: str, n: int, k: int, ms, iterations: int, log=print) -> list[dict]:
  rows = []
  key = jax.random.key(n * 7 + k)
  sets = rotation_sets(n * k, 0)
  weights = [make_weight(jax.random.fold_in(key, i), n, k, BLOCK) for i in range(sets)]
  extras = []
  for w_q, w_s in weights:
    w_bf16 = jaxfp8.dequantize_weight_blockwise(w_q, w_s, BLOCK, dtype=jnp.bfloat16)
    extras.append((w_q, w_s, jaxfp8.Fp8LinearWeight(w_q, w_s, None, BLOCK).with_transpose().w_q_t, w_bf16))
  w64 = ref.dequantize_weight_blockwise(np.asarray(weights[0][0]), np.asarray(weights[0][1]), BLOCK)
  contenders = _contenders()
  for m in ms:
    arg_sets = []
    for i, weight_args in enumerate(extras):
      x = jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16)
      dy = jax.random.normal(jax.random.fold_in(key, 2000 + i), (m, n), jnp.bfloat16)
      arg_sets.append((x, dy, *weight_args))
    row = dict(shape=label, m=m, n=n, k=k)
    for name, fn in contenders.items():
      row[f"{name}_rel_err"] = _check(name, fn(*arg_sets[0]), arg_sets[0][0], arg_sets[0][1], w64)
      row[f"{name}_us"] = timing.median_kernel_us(fn, arg_sets, iterations=iterations)
    row["fp8_vs_bf16_layer"] = row["bf16_layer_us"] / row["fp8_fwd_bwd_us"]
    row["fp8_backward_us"] = row["fp8_fwd_bwd_us"] - row["fp8_fwd_us"]
    log(results.row_line(row))
    rows.append(row)
  return rows


def markdown_table(result: dict) -> str:
  lines = [results.cupti_caption(result, "x: bf16 layer time / FP8 forward+backward time."), "",
           "| weight | M | FP8 fwd | FP8 fwd+bwd (fp8) | FP8 fwd+bwd (bf16 dgrad) | bf16 layer fwd+bwd | x | dx rel. err (fp8) |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['shape']} | {r['m']} | {r['fp8_fwd_us']:.1f} | {r['fp8_fwd_bwd_us']:.1f} | "
                 f"{r['bf16_bwd_us']:.1f} | {r['bf16_layer_us']:.1f} | {r['fp8_vs_bf16_layer']:.2f} | "
                 f"{r['fp8_fwd_bwd_rel_err']:.3g} |")
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: bench_linear_grad.py OUT.json [--shapes ...] [--m ...]")
  shapes = args.parse_shapes(FLAGS.shapes, flag="--shapes")
  ms = args.parse_ms(FLAGS.m)
  results.run_shapes("python3 scripts/bench_linear_grad.py " + " ".join(sys.argv[1:]), shapes,
                     lambda shape: measure(shape.name, shape.n, shape.k, ms, FLAGS.iterations), argv[1],
                     markdown_table)


if __name__ == "__main__":
  app.run(main)
