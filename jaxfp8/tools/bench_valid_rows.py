"""Benchmark of `valid_rows`: a linear jitted for a bucket of rows with V of them live, against the same linear jitted
for exactly the live rows (`python -m jaxfp8 bench --ops=valid_rows`).

Contenders (names for --implementations), per weight (N, K), bucket B and live count V:
  "bucket_valid"  ours: the B-row call with valid_rows=V traced (row tiles past V skipped on the Mosaic GEMM)
  "bucket_full"   baseline: the linear jitted for B rows, no valid_rows (every row computed)
  "exact"         reference point: the linear jitted for round_up(V, 64) rows, no valid_rows: what a call of the
                  live rows costs
  "given_schedule"  the B-row call with valid_rows=V and, given as its config, the schedule bucket_valid's switch
                  picks for V (Mosaic GEMM only): what the run-time choice of schedule costs (bucket_valid against it)
valid_vs_exact = bucket_valid / exact (the target: <= 1.1). Every output is checked against the float64 reference on
sampled live rows and column blocks (docs/CONTRACT.md §3, the bf16 bound), and bucket_valid's rows past V must be 0.
The rows' M is V (the shape names the bucket: weight@B); FLOPs and bytes count the live rows only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxfp8
from jaxfp8.gemm import mosaic as gemm_mosaic
from jaxfp8.tools import args, bench_gemm, bench_linear, bench_report, results, timing

CONTENDERS = ("bucket_valid", "bucket_full", "exact", "given_schedule")
ROLES = {"bucket_valid": "ours", "bucket_full": "baseline", "exact": "reference", "given_schedule": "part"}
TARGET = 1.1
# (weight name, N, K, ((bucket, live), ...)): DeepSeek-V3 q_proj (a prefill bucket half full, a smaller one nearly
# empty), dense_down and Qwen3-32B qkv at a decode bucket.
DEFAULT_CASES = (
    ("deepseek_v3.q_proj_no_lora", 24576, 7168, ((4096, 2100), (1024, 300))),
    ("deepseek_v3.dense_down", 7168, 18432, ((256, 70),)),
    ("qwen3_32b.qkv_proj", 10240, 5120, ((256, 70),)),
)
CPU_CASES = (("tiny.256x512", 256, 512, ((64, 13),)),)
CASES_HELP = ("'weight:bucket:live' items, ';'-separated; weight a shapes.json model.layer or NxK (e.g. "
              "'deepseek_v3.q_proj_no_lora:4096:2100;7168x18432:256:70')")


def parse_cases(text: str) -> list[tuple[str, int, int, tuple[tuple[int, int], ...]]]:
  """--valid_rows_cases -> [(weight, N, K, ((bucket, live), ...))], the cases of one weight collected in order."""
  found: dict[str, tuple] = {}
  items = [item.strip() for item in text.split(";") if item.strip()]
  if not items:
    raise args.UsageError(f"--valid_rows_cases: no cases given; {CASES_HELP}")
  for item in items:
    parts = item.split(":")
    if len(parts) != 3:
      raise args.UsageError(f"--valid_rows_cases: {item!r} is not weight:bucket:live; {CASES_HELP}")
    [shape] = args.parse_shapes(parts[0], flag="--valid_rows_cases")
    bucket, live = args.parse_ints(",".join(parts[1:]), flag="--valid_rows_cases", count=2)
    if live > bucket:
      raise args.UsageError(f"--valid_rows_cases: {item!r}: live={live} exceeds bucket={bucket}")
    name, n, k, cases = found.get(shape.name, (shape.name, shape.n, shape.k, ()))
    found[shape.name] = (name, n, k, (*cases, (bucket, live)))
  return list(found.values())


def _check(out, x, w_q, w_s, live: int, block_size) -> dict:
  """rel_err of sampled live rows and column blocks against the float64 linear; infinite when a row past `live` is
  not 0."""
  out = np.asarray(out).astype(np.float32)
  rows, blocks = results.sample_rows_and_blocks(live, w_q.shape[0], block_size[0])
  want, cols = bench_linear._sample_reference(x, w_q, w_s, block_size, rows, blocks)
  err = float("inf") if out[live:].any() else jaxfp8.reference.relative_error(out[np.ix_(rows, cols)], want)
  return dict(rel_err=err, bound=bench_report.BF16_BOUND, within_bound=bool(err <= bench_report.BF16_BOUND))


def run(case, implementations: Sequence[str], *, block_size=(128, 128), iterations: int = 30, seed: int = 0,
        timer: Callable[..., float] | None = None, log=print) -> list[dict]:
  """Raw rows of every contender at every (bucket, live) of one weight `case` = (name, N, K, cases)."""
  name, n, k, cases = case
  block_size = tuple(block_size)
  key = jax.random.key(seed)
  weights = [bench_gemm.make_weight(jax.random.fold_in(key, i), n, k, block_size)
             for i in range(bench_gemm.rotation_sets(n * k, 0))]
  plain = jax.jit(lambda x, w_q, w_s: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size))
  masked = jax.jit(lambda x, w_q, w_s, v: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size, valid_rows=v))
  rows = []
  for bucket, live in cases:
    exact_rows = -(-live // 64) * 64
    xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (bucket, k), jnp.bfloat16) for i in range(len(weights))]
    calls = {"bucket_valid": (masked, [(x, *w, jnp.int32(live)) for x, w in zip(xs, weights)], bucket),
             "bucket_full": (plain, [(x, *w) for x, w in zip(xs, weights)], bucket),
             "exact": (plain, [(x[:exact_rows], *w) for x, w in zip(xs, weights)], min(exact_rows, bucket))}
    plan = jaxfp8.linear.explain(xs[0], weights[0][0], block_size, valid_rows=True)
    if (given := _given(plan, live)) is not None:
      calls["given_schedule"] = (_given_call(given, block_size), calls["bucket_valid"][1], bucket)
    base = dict(shape=f"{name}@{bucket}", m=live, n=n, k=k, bucket=bucket, live=live, flops=2 * live * n * k,
                bytes=n * k + 2 * live * (k + n))
    times, case_rows = {}, []
    for contender in implementations:
      if contender not in calls:  # given_schedule where the plan is not the Mosaic GEMM's schedules
        continue
      fn, arg_sets, computed = calls[contender]
      row = dict(base, contender=contender, rows_computed=computed)
      if contender == "bucket_valid":
        row["plan"] = str(plan)
      try:
        out = fn(*arg_sets[0])
        # Only valid_rows promises zeros past the live rows; the others computed real rows there.
        masked_call = contender in ("bucket_valid", "given_schedule")
        row.update(_check(out if masked_call else out[:live], xs[0], *weights[0], live, block_size))
        # the kernels (GPU) say what the call costs beyond the GEMM (the live-row count's switch, the quantizer)
        row["us"], kernels = timing.timed(fn, arg_sets, iterations=iterations, timer=timer)
        times[contender] = row["us"]
        row.update(bench_report.kernel_fields(kernels))
      except Exception as e:  # a failing contender is reported, not fatal for the others
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      case_rows.append(row)
    for row in case_rows:  # bucket_valid's ratio, and given_schedule's beside it
      if "exact" in times and row["contender"] in times and row["contender"] not in ("bucket_full", "exact"):
        row["valid_vs_exact"] = times[row["contender"]] / times["exact"]
    rows += case_rows
    for row in case_rows:
      log(results.row_line({key: value for key, value in row.items() if key != "plan"}))
  return rows


def _given(plan, live: int):
  """The Mosaic schedule the plan's switch picks for `live` rows (None: the plan's GEMM is not the Mosaic kernel's
  per-count schedules)."""
  schedules = plan.gemm.config
  if not isinstance(schedules, gemm_mosaic.LiveRowSchedules):
    return None
  return schedules.configs[schedules.table[int(schedules.step(live))]]


def _given_call(config, block_size):
  return jax.jit(lambda x, w_q, w_s, v: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size, valid_rows=v,
                                                                     config=config))


def summary_table(rows: list[dict]) -> str:
  """One line per (weight, bucket, live): the three calls' us and bucket_valid / exact, then given_schedule's where
  it was timed (us and its ratio to exact)."""
  by_key: dict = {}
  for r in rows:
    by_key.setdefault((r["shape"], r["live"]), {})[r["implementation"]] = r
  given = any("given_schedule" in cells for cells in by_key.values())
  lines = [f"valid_rows (us): x = bucket with valid_rows / exact rows (target <= {TARGET}).", "",
           "| weight@bucket | live | bucket, valid_rows | bucket, all rows | exact rows | x | rel err |"
           + (" given_schedule (x) |" if given else ""),
           "|---|---|---|---|---|---|---|" + ("---|" if given else "")]
  ratio = lambda row: f"{row['valid_vs_exact']:.2f}" if "valid_vs_exact" in row else "-"
  for (shape, live), cells in by_key.items():
    valid = cells.get("bucket_valid", {})
    exact = cells.get("exact")
    exact_cell = bench_report.cell_us(exact) + (f" ({exact['rows_computed']} rows)" if exact else "")
    err = f"{valid['rel_err']:.3g}" if "rel_err" in valid else "-"
    lines.append(f"| {shape} | {live} | {bench_report.cell_us(cells.get('bucket_valid'))} | "
                 f"{bench_report.cell_us(cells.get('bucket_full'))} | {exact_cell} | {ratio(valid)} | {err} |"
                 + (f" {bench_report.cell_us(cells.get('given_schedule'))} ({ratio(cells.get('given_schedule', {}))}) |"
                    if given else ""))
  return "\n".join(lines) + "\n"
