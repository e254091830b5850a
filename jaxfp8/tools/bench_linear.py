"""Benchmark of `w8a8_block_fp8_linear`: the whole linear vs its parts vs what JAX users do today
(`python -m jaxfp8 bench --ops=linear`).

Contenders (names for `contenders`), all timed in one process with CUPTI kernel time (`jaxfp8.tools.timing`) on a GPU,
or with the timer `run` is given (bench's wall clock on CPU):
  "linear":       jitted `w8a8_block_fp8_linear(x, w_q, w_s)` as dispatched here (quantizer + GEMM + any slice).
  "gemm":         the GEMM alone, same implementation, config and buffer layout as the linear's plan (the padded
                  rows, and out_rows = M where the quantizer padded them), on activations quantized beforehand.
  "quant":        the activation quantizer alone (the plan's implementation and layout).
  "dequant_bf16": BASELINE `baselines.dequant_bf16_matmul_baseline` on the same quantized activations: XLA dequantizes
                  both operands to bf16, then one bf16 dot.
  "w8a16_bf16":   BASELINE weight-only: x (bf16) @ dequantize(w_q, w_s) in bf16, as a JAX user without block-FP8
                  kernels writes a linear layer today.

Every output is first checked against the float64 reference on sampled rows and whole column blocks. For M <= 64 a
row also reports the decode target, linear <= 1.1 x gemm + 3 us of kernel time, and the names of the kernels one
linear call launches (so that anything between the quantizer and the GEMM shows).

    python -m jaxfp8 bench --ops=linear --models=deepseek_v3,qwen3_32b --m=1,16,64,512,4096 --out=...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import gemm, linear, quant, shapes, weights
from jaxfp8.tools import results as results_io, bench_gemm, bench_quant, baselines, timing
from jaxfp8 import reference as ref

CONTENDERS = ("linear", "gemm", "quant", "dequant_bf16", "w8a16_bf16")
ROLES = {"linear": "ours", "gemm": "part", "quant": "part", "dequant_bf16": "baseline", "w8a16_bf16": "baseline"}
DEFAULT_MODELS = ("deepseek_v3", "qwen3_32b")
DEFAULT_MS = (1, 16, 64, 512, 4096)  # decode (weight streaming) and prefill (compute bound) row counts
DECODE_M = 64
BF16_BOUND = 5e-3  # docs/CONTRACT.md §2: relative Frobenius error of a bf16 output


def default_shapes(models: Sequence[str] = DEFAULT_MODELS) -> list[tuple[str, int, int]]:
  """(model.layer, N, K) of the given shapes.json models."""
  return [(name.replace("/", "."), n, k) for name, n, k in shapes.weight_shapes(tuple(models))]


def _activations(key, m: int, k: int) -> jax.Array:
  """bf16 (M, K): normal values with per-row magnitudes over a few octaves (never zeros)."""
  k1, k2 = jax.random.split(key)
  rows = jnp.exp2(jax.random.uniform(k1, (m, 1), minval=-3, maxval=3))
  return (jax.random.normal(k2, (m, k), jnp.float32) * rows).astype(jnp.bfloat16)


def _contenders(plan: linear.LinearPlan, block_size: tuple[int, int]) -> dict:
  col = plan.scale_layout == "col"
  quant_kwargs = dict(column_major_scales=col, scale_tma_aligned=col, row_alignment=plan.row_alignment,
                      implementation=plan.quant_implementation, interpret=False)
  return {
      "linear": jax.jit(lambda x, w_q, w_s, a_q, a_s: linear.w8a8_block_fp8_linear(
          x, w_q, w_s, block_size, implementation=plan.implementation, interpret=False)),
      "gemm": jax.jit(lambda x, w_q, w_s, a_q, a_s: gemm.w8a8_block_fp8_matmul(
          a_q, w_q, a_s, w_s, block_size, a_s_column_major=col, out_dtype=jnp.bfloat16,
          implementation=plan.implementation, interpret=False, out_rows=plan.gemm_out_rows)),
      "quant": jax.jit(lambda x, w_q, w_s, a_q, a_s: quant.per_token_group_quant_fp8(
          x, block_size[1], **quant_kwargs)),
      "dequant_bf16": jax.jit(lambda x, w_q, w_s, a_q, a_s: baselines.dequant_bf16_matmul_baseline(
          a_q, w_q, a_s, w_s, block_size=block_size, a_s_column_major=col, out_dtype=jnp.bfloat16)),
      "w8a16_bf16": jax.jit(lambda x, w_q, w_s, a_q, a_s: jnp.dot(
          x, weights.dequantize_weight_blockwise(w_q, w_s, block_size, dtype=jnp.bfloat16).T,
          preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
  }


def _sample_reference(x, w_q, w_s, block_size, rows: np.ndarray, col_blocks: np.ndarray):
  """float64 reference of the linear on sampled rows and whole gn-blocks of columns; (reference, column indices)."""
  gn, _ = block_size
  n = w_q.shape[0]
  cols = np.concatenate([np.arange(j * gn, min(n, (j + 1) * gn)) for j in col_blocks])
  x_h = np.asarray(x)[rows]
  expected = ref.w8a8_block_fp8_linear(x_h, np.asarray(w_q)[cols], np.asarray(w_s)[col_blocks], block_size)
  return expected, cols


def _expectations(args0: tuple, plan: linear.LinearPlan, block_size, sample) -> tuple[dict, np.ndarray]:
  """The float64 reference of each checked contender on the sample (rows, column blocks), and the sampled columns."""
  sample_rows, sample_blocks = sample
  x0, w_q0, w_s0, a_q0, a_s0 = args0
  m = x0.shape[0]
  expected, cols = _sample_reference(x0, w_q0, w_s0, block_size, sample_rows, sample_blocks)
  a_s_rows = np.asarray(a_s0)[:, :m].T if plan.scale_layout == "col" else np.asarray(a_s0)[:m]
  expected_gemm = ref.block_fp8_matmul(np.asarray(a_q0)[sample_rows], np.asarray(w_q0)[cols],
                                       a_s_rows[sample_rows], np.asarray(w_s0)[sample_blocks], block_size)
  # The weight-only baseline does not quantize x: its reference is x @ dequantized w, in float64.
  expected_w8a16 = np.asarray(x0)[sample_rows].astype(np.float64) @ ref.dequantize_weight_blockwise(
      np.asarray(w_q0)[cols], np.asarray(w_s0)[sample_blocks], block_size).T
  return {"linear": expected, "gemm": expected_gemm, "dequant_bf16": expected_gemm,
          "w8a16_bf16": expected_w8a16}, cols


def _time_contender(name: str, fn: Callable, arg_sets: list[tuple], base: dict, expected: np.ndarray | None,
                    sample: tuple[np.ndarray, np.ndarray], *, iterations: int, timer, kernel_names: bool) -> dict:
  """The row of one contender: checked on the sample (rows, cols) against `expected` (the quantizer's codes and
  scales against the reference quantizer's), timed."""
  m, n, k = base["m"], base["n"], base["k"]
  row = dict(base, contender=name)
  try:
    out = jax.block_until_ready(fn(*arg_sets[0]))
    if name == "quant":
      row.update(bench_quant.check_codes(out, np.asarray(arg_sets[0][0]), base["block_size"][1],
                                         column_major=base["scale_layout"] == "col"))
    if expected is not None:
      got = np.asarray(out).astype(np.float32)[np.ix_(*sample)]
      row["rel_err"] = ref.relative_error(got, expected)
      row["within_bf16_bound"] = bool(row["rel_err"] <= BF16_BOUND)
    us = timer(fn, arg_sets, iterations=iterations)
    row.update(us=us)
    if name != "quant":
      row["tflops"] = 2 * m * n * k / (us * 1e-6) / 1e12
      if m <= DECODE_M:
        row["x_weight_floor"] = us / base["weight_floor_us"]
    if name == "linear" and kernel_names:
      try:
        row["kernels"] = timing.kernel_names(fn, arg_sets[0])
      except Exception as e:  # names are a diagnostic; never fatal
        row["kernels_error"] = f"{type(e).__name__}: {str(e)[:200]}"
  except Exception as e:  # a failing contender is reported, not fatal for the others
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return row


def _linear_vs_gemm(base: dict, times: dict[str, float]) -> dict:
  """The summary row: what the linear adds to its GEMM, and (decode) whether that meets the target."""
  summary = dict(base, contender="linear_vs_gemm", summary=True, overhead_us=times["linear"] - times["gemm"],
                 ratio=times["linear"] / times["gemm"])
  if base["m"] <= DECODE_M:
    summary["decode_target_us"] = 1.1 * times["gemm"] + 3.0
    summary["meets_decode_target"] = bool(times["linear"] <= summary["decode_target_us"])
  return summary


def run(
    shape_list: Sequence[tuple[str, int, int]] | None = None,
    ms: Sequence[int] = DEFAULT_MS,
    contenders: Sequence[str] = CONTENDERS,
    out_json: str | None = None,
    *,
    block_size: tuple[int, int] = (128, 128),
    iterations: int = 30,
    seed: int | None = None,
    log=print,
    timer: Callable[..., float] | None = None,
    timing_label: str | None = None,
) -> dict:
  """Times every contender on every (shape, M); checks each output on a sample first. Returns (and writes) results."""
  shape_list = default_shapes() if shape_list is None else list(shape_list)
  block_size = tuple(block_size)
  record_kernel_names = timer is None  # kernel names come from CUPTI too
  timer = timer or timing.median_kernel_us
  unknown = set(contenders) - set(CONTENDERS)
  if unknown:
    raise ValueError(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  key = jax.random.key(seed)
  rows_out: list[dict] = []
  for shape_name, n, k in shape_list:
    sets = bench_gemm.rotation_sets(n * k, 0)
    key, *keys = jax.random.split(key, sets + 1)
    weight_sets = [bench_gemm.make_weight(keys[i], n, k, block_size) for i in range(sets)]
    for m in ms:
      key, *keys = jax.random.split(key, sets + 1)
      xs = [_activations(keys[i], m, k) for i in range(sets)]
      plan = linear.explain(xs[0], weight_sets[0][0], block_size)
      fns = _contenders(plan, block_size)
      quantize = fns["quant"]
      arg_sets = [(x, w_q, w_s, *quantize(x, w_q, w_s, None, None)) for x, (w_q, w_s) in zip(xs, weight_sets)]
      sample = results_io.sample_rows_and_blocks(m, n, block_size[0])
      expectations, cols = _expectations(arg_sets[0], plan, block_size, sample)
      base = dict(shape=shape_name, m=m, n=n, k=k, block_size=list(block_size), rotation_sets=sets,
                  weight_floor_us=n * k / bench_gemm.HBM_BYTES_PER_S * 1e6, plan=str(plan),
                  implementation=plan.implementation, quant_implementation=plan.quant_implementation,
                  scale_layout=plan.scale_layout)
      times: dict[str, float] = {}
      for name in contenders:
        row = _time_contender(name, fns[name], arg_sets, base, expectations.get(name), (sample[0], cols),
                              iterations=iterations, timer=timer, kernel_names=record_kernel_names)
        if "us" in row:
          times[name] = row["us"]
        rows_out.append(row)
        log(format_row(row))
      if "linear" in times and "gemm" in times:
        rows_out.append(_linear_vs_gemm(base, times))
        log(format_row(rows_out[-1]))
      del arg_sets, xs
    del weight_sets
  result = dict(
      benchmark="w8a8_block_fp8_linear (bf16 activations, block-FP8 weights, bf16 output) vs its parts and baselines",
      **results_io.run_metadata(), seed=seed,
      timing=timing_label or f"CUPTI kernel time (all kernels of a call), median of {iterations} calls",
      weight_floor=f"N*K bytes / {bench_gemm.HBM_BYTES_PER_S / 1e12} TB/s",
      decode_target="for M <= 64: linear <= 1.1 x gemm + 3 us", rows=rows_out)
  results_io.write_results(result, out_json, markdown_table)
  return result


def format_row(row: dict) -> str:
  head = f"{row['shape']:<34} {row['m']:>5} {row['n']:>6} {row['k']:>6} {row['contender']:<15}"
  if row["contender"] == "linear_vs_gemm":
    target = ""
    if "meets_decode_target" in row:
      target = f"  decode target {row['decode_target_us']:.2f} us: {'met' if row['meets_decode_target'] else 'MISSED'}"
    return f"{head} overhead {row['overhead_us']:8.2f} us  x{row['ratio']:.3f}{target}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  err = f"{row['rel_err']:9.2e}" if "rel_err" in row else f"{'':>9}"
  flag = "" if row.get("within_bf16_bound", True) else "  <-- above bf16 bound"
  kernels = f"  kernels: {len(row['kernels'])} {row['kernels']}" if "kernels" in row else ""
  return f"{head} {row['us']:10.2f} us {err}{flag}{kernels}"


def markdown_table(result: dict) -> str:
  """One line per (shape, M): each contender's us, the linear's overhead over the GEMM, and the decode target."""
  names = [c for c in CONTENDERS if any(r["contender"] == c for r in result["rows"])]
  lines = [f"w8a8_block_fp8_linear, {result['device']}, jax {result['jax_version']}, {result['date'][:10]}; "
           f"{result['timing']}; bf16 in and out. Cells: us (x weight-streaming floor for M <= 64). "
           f"Decode target: {result['decode_target']}.", "",
           "| shape | M | N | K | path | " + " | ".join(names) + " | linear - gemm | decode target |",
           "|---|---|---|---|---|" + "---|" * (len(names) + 2)]
  by_key: dict = {}
  for r in result["rows"]:
    by_key.setdefault((r["shape"], r["m"], r["n"], r["k"]), {})[r["contender"]] = r
  for (shape, m, n, k), cells in by_key.items():
    texts = []
    for c in names:
      r = cells.get(c)
      if r is None:
        texts.append("-")
      elif "error" in r:
        texts.append("error")
      else:
        extra = f" ({r['x_weight_floor']:.2f}x)" if "x_weight_floor" in r else ""
        bad = "" if r.get("within_bf16_bound", True) else " WRONG"
        texts.append(f"{r['us']:.1f}{extra}{bad}")
    summary = cells.get("linear_vs_gemm")
    overhead = "-" if summary is None else f"{summary['overhead_us']:+.2f} us (x{summary['ratio']:.2f})"
    target = "-" if summary is None or "meets_decode_target" not in summary else (
        "met" if summary["meets_decode_target"] else "**missed**")
    any_row = next(iter(cells.values()))
    path = f"{any_row.get('quant_implementation', '?')}+{any_row.get('implementation', '?')}"
    lines.append(f"| {shape} | {m} | {n} | {k} | {path} | " + " | ".join(texts) + f" | {overhead} | {target} |")
  return "\n".join(lines) + "\n"
