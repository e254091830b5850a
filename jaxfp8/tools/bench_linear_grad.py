"""Benchmark of one linear layer's forward and backward (y, and dx = dy @ W), FP8 against bf16:
`python -m jaxfp8 bench --ops=linear_grad`.

Contenders (names for --implementations), per weight (N, K) and row count M, all in one process:
  "fp8_fwd"      part: the FP8 linear's forward alone (quantize x, block-FP8 GEMM).
  "fp8_fwd_bwd"  ours: forward + backward="fp8" (dy quantized per 1 x 128, the block-FP8 GEMM against W^T's codes,
                 which the layer holds: `Fp8LinearWeight.with_transpose`).
  "bf16_bwd"     ours: forward + backward="bf16" (dy against the dequantized weight in bf16).
  "bf16_layer"   BASELINE: the same layer in bf16, y = x @ W^T and dx = dy @ W with a bf16 W (dequantized once,
                 outside the timing), XLA's dots: what the layer costs without FP8.
Every output is checked against the float64 reference on sampled rows and column blocks first: y to the bf16 bound
of docs/CONTRACT.md §2 (against the linear's reference, §3, for the FP8 forward; against x @ W for the bf16 layer),
dx to §6's bound (6e-2 with backward="fp8", the bf16 bound otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxfp8
from jaxfp8 import reference as ref
from jaxfp8.tools import bench_gemm, bench_linear, bench_report, results, timing

CONTENDERS = ("fp8_fwd", "fp8_fwd_bwd", "bf16_bwd", "bf16_layer")
ROLES = {"fp8_fwd": "part", "fp8_fwd_bwd": "ours", "bf16_bwd": "ours", "bf16_layer": "baseline"}
FP8_DGRAD_BOUND = 6e-2  # docs/CONTRACT.md §6: dx with backward="fp8" (dy's e4m3 rounding)
DX_BOUND = {"fp8_fwd_bwd": FP8_DGRAD_BOUND, "bf16_bwd": bench_report.BF16_BOUND, "bf16_layer": bench_report.BF16_BOUND}


def contenders(block_size: tuple[int, int]) -> dict[str, Callable]:
  """name -> jitted f(x, dy, w_q, w_s, w_q_t, w_bf16) -> y or (y, dx); the weights are arguments, never constants."""
  def fp8(backward):
    def fwd_bwd(x, dy, w_q, w_s, w_q_t, w_bf16):
      del w_bf16
      y, vjp = jax.vjp(lambda x: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size, backward=backward,
                                                              w_q_t=w_q_t), x)
      return y, vjp(dy)[0]
    return jax.jit(fwd_bwd)

  def bf16_layer(x, dy, w_q, w_s, w_q_t, w_bf16):
    del w_q, w_s, w_q_t
    y, vjp = jax.vjp(lambda x: jnp.dot(x, w_bf16.T, preferred_element_type=jnp.float32).astype(x.dtype), x)
    return y, vjp(dy)[0]

  def fwd(x, dy, w_q, w_s, w_q_t, w_bf16):
    del dy, w_q_t, w_bf16
    return jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size)

  return {"fp8_fwd": jax.jit(fwd), "fp8_fwd_bwd": fp8("fp8"), "bf16_bwd": fp8("bf16"),
          "bf16_layer": jax.jit(bf16_layer)}


def _references(x, dy, w_q, w_s, block_size) -> dict[str, np.ndarray]:
  """float64 references on the sampled rows and column blocks: the FP8 linear's y, x @ W (the bf16 layer's y, on
  the sampled columns) and dy @ W (dx, every column of x)."""
  m, n = dy.shape
  rows, blocks = results.sample_rows_and_blocks(m, n, block_size[0])
  y_fp8, cols = bench_linear._sample_reference(x, w_q, w_s, block_size, rows, blocks)
  w64 = ref.dequantize_weight_blockwise(np.asarray(w_q), np.asarray(w_s), block_size)
  x_rows = np.asarray(x[rows]).astype(np.float64)
  return dict(rows=rows, cols=cols, y_fp8=y_fp8, y_exact=x_rows @ w64[cols].T,
              dx=np.asarray(dy[rows]).astype(np.float64) @ w64)


def _check(name: str, out, want: dict) -> dict:
  """rel_err (of dx; of y for the forward alone), y_rel_err, bound and within_bound of one contender's output."""
  rows, cols = want["rows"], want["cols"]
  y = out if name == "fp8_fwd" else out[0]
  y_err = ref.relative_error(np.asarray(y).astype(np.float64)[np.ix_(rows, cols)],
                             want["y_exact" if name == "bf16_layer" else "y_fp8"])
  if name == "fp8_fwd":
    return dict(rel_err=y_err, bound=bench_report.BF16_BOUND, within_bound=bool(y_err <= bench_report.BF16_BOUND))
  dx_err = ref.relative_error(np.asarray(out[1]).astype(np.float64)[rows], want["dx"])
  bound = DX_BOUND[name]
  return dict(rel_err=dx_err, y_rel_err=y_err, bound=bound,
              within_bound=bool(dx_err <= bound and y_err <= bench_report.BF16_BOUND))


def _counts(name: str, m: int, n: int, k: int, block_size) -> tuple[int, int]:
  """(FLOPs, fewest bytes) of one call: the forward 2MNK, with the backward 4MNK; the weight's codes (and W^T's for
  the FP8 backward, the bf16 weight twice for the bf16 layer), x, y, and dy, dx with the backward."""
  scales = -(-n // block_size[0]) * -(-k // block_size[1]) * 4
  if name == "fp8_fwd":
    return 2 * m * n * k, n * k + scales + 2 * m * (k + n)
  weight = 4 * n * k if name == "bf16_layer" else 2 * (n * k + scales)
  return 4 * m * n * k, weight + 4 * m * (k + n)


def run(shape, ms: Sequence[int], implementations: Sequence[str], *, block_size=(128, 128), iterations: int = 30,
        seed: int = 0, timer: Callable[..., float] | None = None, log=print) -> list[dict]:
  """Raw rows of every contender on one weight (name, N, K) at every M; each output checked first."""
  name, n, k = shape
  block_size = tuple(block_size)
  timer = timer or timing.median_kernel_us
  key = jax.random.key(seed)
  sets = bench_gemm.rotation_sets(n * k, 0)
  weights = []
  for i in range(sets):
    w_q, w_s = bench_gemm.make_weight(jax.random.fold_in(key, i), n, k, block_size)
    w_q_t = jaxfp8.Fp8LinearWeight(w_q, w_s, None, block_size).with_transpose().w_q_t
    weights.append((w_q, w_s, w_q_t, jaxfp8.dequantize_weight_blockwise(w_q, w_s, block_size, dtype=jnp.bfloat16)))
  fns = contenders(block_size)
  rows = []
  for m in ms:
    arg_sets = [(jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.bfloat16),
                 jax.random.normal(jax.random.fold_in(key, 2000 + i), (m, n), jnp.bfloat16), *w)
                for i, w in enumerate(weights)]
    want = _references(arg_sets[0][0], arg_sets[0][1], *weights[0][:2], block_size)
    for contender in implementations:
      flops, num_bytes = _counts(contender, m, n, k, block_size)
      row = dict(shape=name, m=m, n=n, k=k, contender=contender, flops=flops, bytes=num_bytes, rotation_sets=sets)
      try:
        row.update(_check(contender, fns[contender](*arg_sets[0]), want))
        row["us"] = timer(fns[contender], arg_sets, iterations=iterations)
      except Exception as e:  # a failing contender is reported, not fatal for the others
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      rows.append(row)
      log(results.row_line(row))
    del arg_sets
  return rows


def summary_table(rows: list[dict]) -> str:
  """One line per (weight, M): each contender's us, and the bf16 layer's time over the FP8 forward + backward's."""
  by_key: dict = {}
  for r in rows:
    by_key.setdefault((r["shape"], r["m"]), {})[r["implementation"]] = r
  lines = ["Linear forward + backward (us): FP8 against the bf16 layer; x = bf16 layer / FP8 fwd+bwd.", "",
           "| weight | M | FP8 fwd | FP8 fwd+bwd | FP8 fwd, bf16 dgrad | bf16 layer | x | dx rel err (fp8) |",
           "|---|---|---|---|---|---|---|---|"]
  for (shape, m), cells in by_key.items():
    fp8, bf16 = cells.get("fp8_fwd_bwd", {}), cells.get("bf16_layer", {})
    ratio = f"{bf16['us'] / fp8['us']:.2f}" if "us" in fp8 and "us" in bf16 else "-"
    err = f"{fp8['rel_err']:.3g}" if "rel_err" in fp8 else "-"
    lines.append(f"| {shape} | {m} | " + " | ".join(bench_report.cell_us(cells.get(c)) for c in CONTENDERS) +
                 f" | {ratio} | {err} |")
  return "\n".join(lines) + "\n"
