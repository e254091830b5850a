"""`python -m jaxfp8 bench`: every implementation and baseline of the GEMM, the linear and the quantizer, in one run.

It drives the three benchmark modules (`bench_gemm`, `bench_linear`, `bench_quant`) over one list of weight shapes
(N, K) and row counts M, times them all in the same process, and puts their rows into one table and one JSON file:
time, TFLOP/s, GB/s, the share of the roofline (the op's FLOPs at the compute peak or its bytes at the copy bandwidth
measured in the same run, whichever takes longer) and the speedup over the best baseline of the same (op, shape, M).

Roles of the implementations:
  gemm    ours: "mosaic", "triton", "xla" (`w8a8_block_fp8_matmul`); baselines: "dequant_bf16" (XLA dequantize to
          bf16, then dot), "torch_scaled_mm" (torch blockwise `_scaled_mm`, when torch imports and a GPU is there);
          ceiling: "fp8_per_tensor" (XLA fp8 dot with per-tensor scales: cuBLASLt speed without block scales).
  linear  ours: "linear" (`w8a8_block_fp8_linear` as dispatched); parts: "gemm", "quant"; baselines: "dequant_bf16",
          "w8a16_bf16" (bf16 activations times the dequantized weight).
  quant   ours: "mosaic", "triton"; baseline: "xla" (`per_token_group_quant_fp8_row_padded` in jnp).

On a GPU the times are CUPTI kernel times (`jaxfp8.timing`). On CPU there is no CUPTI: calls are timed with a wall
clock (median of `block_until_ready` calls) on small shapes, only to exercise the command; CPU times say nothing
about GPU speed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxfp8 import _platform, shapes
from jaxfp8.tools import results as _bench_io, bench_gemm, bench_linear, bench_quant

OPS = ("gemm", "linear", "quant")
# NVIDIA H200 (SXM) datasheet: FP8 Tensor Core 3958 TFLOP/s with 2:4 sparsity, i.e. 1979 dense.
H200_FP8_DENSE_TFLOPS = 1979.0
ROLES = {
    "gemm": {"mosaic": "ours", "triton": "ours", "xla": "ours", "dequant_bf16": "baseline",
             "torch_scaled_mm": "baseline", "fp8_per_tensor": "ceiling"},
    "linear": {"linear": "ours", "gemm": "part", "quant": "part", "dequant_bf16": "baseline",
               "w8a16_bf16": "baseline"},
    "quant": {"mosaic": "ours", "triton": "ours", "xla": "baseline"},
}
IMPLEMENTATIONS = {op: tuple(roles) for op, roles in ROLES.items()}
GPU_MS = (1, 16, 64, 256, 1024, 4096)
CPU_MS = (1, 8, 64)
CPU_SHAPES = (("tiny.256x512", 256, 512), ("tiny.512x1024", 512, 1024))
CPU_WARNING = ("WARNING: no GPU here. These are CPU wall-clock times of the XLA code paths on small shapes; they "
               "exercise the command and say nothing about GPU speed.")


# ---- what to run -----------------------------------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[str, int, int]]:
  """'N,K;N,K' (or 'M,N,K;...', the M ignored here: give M with --m) -> [(name, N, K)]."""
  out = []
  for item in (s.strip() for s in text.split(";")):
    if not item:
      continue
    values = [int(v) for v in item.replace("x", ",").split(",")]
    if len(values) not in (2, 3) or min(values) <= 0:
      raise ValueError(f"shapes: expected 'N,K' or 'M,N,K' positive integers separated by ';', got {item!r}")
    n, k = values[-2:]
    out.append((f"{n}x{k}", n, k))
  return out


def parse_mnk(text: str) -> tuple[list[tuple[str, int, int]], dict[str, list[int]]] | None:
  """'M,N,K;...' with M on every item -> (shapes, the Ms of each shape), else None (items without M)."""
  items = [s.strip() for s in text.split(";") if s.strip()]
  if not items or any(len(i.split(",")) != 3 for i in items):
    return None
  shape_list, ms_by_shape = parse_shapes(text), {}
  for item, (name, _, _) in zip(items, shape_list):
    ms_by_shape.setdefault(name, []).append(int(item.split(",")[0]))
  unique = list(dict.fromkeys(shape_list))
  return unique, {name: sorted(set(ms)) for name, ms in ms_by_shape.items()}


def model_shapes(models: Sequence[str], path: str | None = None) -> list[tuple[str, int, int]]:
  """(model.layer, N, K) of shapes.json models; 'model.layer' picks one layer, 'all' every model but the unaligned
  test shapes. `path`: another shapes.json instead of the shipped one."""
  if path:
    table = bench_gemm.shapes_from_json(path, None)
  else:
    table = [(name.replace("/", "."), n, k) for name, n, k in shapes.weight_shapes()]
  if list(models) == ["all"]:
    return [s for s in table if not s[0].startswith("unaligned")]
  out = []
  for model in models:
    picked = [s for s in table if s[0] == model or s[0].split(".")[0] == model]
    if not picked:
      known = sorted({s[0].split(".")[0] for s in table})
      raise ValueError(f"models: {model!r} is no model (or model.layer) of shapes.json; models: {known}")
    out += [s for s in picked if s not in out]
  return out


def runnable_implementations(op: str, on_gpu: bool) -> tuple[str, ...]:
  """The implementations of `op` that run on this machine (torch_scaled_mm: left to bench_gemm to find torch)."""
  out = []
  for name in IMPLEMENTATIONS[op]:
    if name in ("mosaic", "triton") and op in ("gemm", "quant"):
      if (name == "mosaic" and not _platform.is_hopper()) or (name == "triton" and not _platform.has_fp8_gpu()):
        continue
    if name == "torch_scaled_mm" and not on_gpu:
      continue
    out.append(name)
  return tuple(out)


def select_implementations(requested: Sequence[str] | None, ops: Sequence[str], on_gpu: bool) -> dict[str, list[str]]:
  """Per op, the requested names that op knows (a name may serve several ops), or every runnable one."""
  if not requested:
    return {op: list(runnable_implementations(op, on_gpu)) for op in ops}
  known = {name for op in ops for name in IMPLEMENTATIONS[op]}
  unknown = [name for name in requested if name not in known]
  if unknown:
    raise ValueError(f"implementations: unknown {unknown} for ops {list(ops)}; known: {sorted(known)}")
  return {op: [name for name in IMPLEMENTATIONS[op] if name in requested] for op in ops}


# ---- timing ----------------------------------------------------------------------------------------------------------

def median_wall_us(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int = 30,
                   sync: Callable = jax.block_until_ready) -> float:
  """Median wall time of `fn(*args)` + sync, after one warm-up (compile) call: the CPU stand-in for CUPTI."""
  sync(fn(*arg_sets[0]))
  times = []
  for i in range(iterations):
    start = time.perf_counter()
    sync(fn(*arg_sets[i % len(arg_sets)]))
    times.append((time.perf_counter() - start) * 1e6)
  return statistics.median(times)


# ---- the roofline ----------------------------------------------------------------------------------------------------

def op_flops(op: str, m: int, n: int | None, k: int) -> int | None:
  return None if op == "quant" else 2 * m * n * k


def op_bytes(op: str, implementation: str, m: int, n: int | None, k: int, block_size: tuple[int, int]) -> int:
  """Fewest bytes the call must move: read its inputs once, write its output once (bf16 out, fp8 codes, f32 scales)."""
  gn, gk = block_size
  groups = -(-k // gk)
  if op == "quant" or implementation == "quant":
    return bench_quant.quant_bytes(m, k, gk)
  weight = n * k + -(-n // gn) * groups * 4
  out = m * n * 2
  if op == "linear" and implementation in ("linear", "w8a16_bf16"):
    return m * k * 2 + weight + out  # bf16 activations in
  return m * k + m * groups * 4 + weight + out  # fp8 activations and their scales in


def add_roofline(row: dict, *, peak_tflops: float | None, copy_bandwidth: float, block_size) -> None:
  """Adds bytes, GB/s, the roofline time (max of compute and memory time), its bound and the share reached."""
  if "us" not in row:
    return
  flops = op_flops(row["op"], row["m"], row["n"], row["k"])
  num_bytes = op_bytes(row["op"], row["implementation"], row["m"], row["n"], row["k"], block_size)
  if row["implementation"] == "quant":
    flops = None
  memory_us = num_bytes / copy_bandwidth * 1e6
  compute_us = flops / (peak_tflops * 1e12) * 1e6 if flops and peak_tflops else 0.0
  roofline_us = max(memory_us, compute_us)
  row.update(bytes=num_bytes, gbps=num_bytes / (row["us"] * 1e-6) / 1e9, roofline_us=roofline_us,
             bound="compute" if compute_us > memory_us else "memory",
             pct_roofline=100 * roofline_us / row["us"])
  if flops:
    row.update(flops=flops, tflops=flops / (row["us"] * 1e-6) / 1e12)


def add_baseline_ratios(rows: list[dict]) -> None:
  """speedup_vs_best_baseline = (fastest baseline of the same op, shape, M) / this time, for every timed row."""
  best: dict = {}
  for r in rows:
    if r.get("role") == "baseline" and "us" in r and r.get("within_bf16_bound", True):
      key = (r["op"], r["shape"], r["m"])
      if key not in best or r["us"] < best[key][0]:
        best[key] = (r["us"], r["implementation"])
  for r in rows:
    key = (r["op"], r["shape"], r["m"])
    if "us" in r and key in best:
      r["best_baseline"] = best[key][1]
      r["speedup_vs_best_baseline"] = best[key][0] / r["us"]


# ---- rows of the sub-benchmarks, in one form -------------------------------------------------------------------------

# (x_weight_floor, against a fixed 4.3 TB/s, stays in the raw rows: pct_roofline uses this run's copy bandwidth.)
_KEEP = ("us", "rel_err", "within_bf16_bound", "error", "note", "plan", "kernels", "rotation_sets")


def unify(op: str, raw_rows: Sequence[dict]) -> list[dict]:
  out = []
  for raw in raw_rows:
    name = raw.get("contender", raw.get("implementation"))
    if name == "linear_vs_gemm":  # a summary row; stays in the op's raw results
      continue
    row = dict(op=op, shape=raw.get("shape", f"K={raw['k']}"), m=raw["m"], n=raw.get("n"), k=raw["k"],
               implementation=name, role=ROLES[op][name])
    row.update({key: raw[key] for key in _KEEP if key in raw})
    out.append(row)
  return out


# ---- the run ---------------------------------------------------------------------------------------------------------

def run(
    ops: Sequence[str] = OPS,
    shape_list: Sequence[tuple[str, int, int]] | None = None,
    ms: Sequence[int] | None = None,
    implementations: Sequence[str] | None = None,
    out_json: str | None = None,
    *,
    block_size: tuple[int, int] = (128, 128),
    iterations: int | None = None,
    seed: int | None = None,
    peak_tflops: float | None = None,
    time_budget_s: float | None = None,
    ms_by_shape: dict[str, Sequence[int]] | None = None,
    command: str | None = None,
    log=print,
) -> dict:
  """Times every implementation of every op on every (shape, M) (`ms_by_shape`: a shape's own Ms instead of `ms`).

  Prints progress and the table; writes JSON after every shape (a run cut short still leaves what it measured,
  marked complete=False) and a markdown table beside it."""
  started = time.perf_counter()
  unknown_ops = [op for op in ops if op not in OPS]
  if unknown_ops or not ops:
    raise ValueError(f"ops: expected some of {OPS}, got {list(ops)}")
  block_size = tuple(block_size)
  on_gpu = _platform.gpu_compute_capability() is not None
  shape_list = list(shape_list if shape_list is not None else (
      [s for s in bench_gemm.DEFAULT_SHAPES] if on_gpu else CPU_SHAPES))
  ms = list(ms if ms else (GPU_MS if on_gpu else CPU_MS))
  if ms_by_shape and all(name in ms_by_shape for name, _, _ in shape_list):
    ms = sorted({m for values in ms_by_shape.values() for m in values})  # what runs, for the record
  iterations = iterations or (30 if on_gpu else 5)
  chosen = select_implementations(implementations, ops, on_gpu)
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  device = jax.devices()[0].device_kind
  if peak_tflops is None and on_gpu and "H200" in device:
    peak_tflops = H200_FP8_DENSE_TFLOPS
  if on_gpu:
    timer, timer_label = None, f"CUPTI kernel time (all kernels of a call), median of {iterations} calls"
    copy_bw = bench_quant.measure_copy_bandwidth()
  else:
    timer = median_wall_us
    timer_label = f"CPU WALL-CLOCK time (block_until_ready), median of {iterations} calls: not a GPU measure"
    log(CPU_WARNING)
    copy_bw = bench_quant.measure_copy_bandwidth(64 << 20, timer=median_wall_us)
  log(f"jaxfp8 bench on {device} (jax {jax.__version__}): ops {list(ops)}, {len(shape_list)} shapes, M {ms}; "
      f"{timer_label}")
  log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write, measured now); compute peak "
      f"{f'{peak_tflops:g} TFLOP/s (FP8 dense, datasheet)' if peak_tflops else 'unknown here: memory roofline only'}")
  torch_version = None
  try:
    import torch
    torch_version = torch.__version__
  except ImportError:
    pass
  result = dict(
      benchmark="jaxfp8 bench: block FP8 GEMM, linear and activation quantizer, every implementation and baseline",
      **_bench_io.run_metadata(command), device_count=jax.device_count(), platform=jax.devices()[0].platform,
      jaxlib_version=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
      torch_version=torch_version, seed=seed, iterations=iterations,
      timing=timer_label, cpu_warning=None if on_gpu else CPU_WARNING,
      copy_bandwidth_tbps=copy_bw / 1e12, compute_peak_tflops=peak_tflops,
      compute_peak_source="NVIDIA H200 datasheet, FP8 Tensor Core dense" if peak_tflops == H200_FP8_DENSE_TFLOPS
      else ("given with --peak_tflops" if peak_tflops else None),
      roofline="pct_roofline = 100 * max(flops / peak, bytes / copy bandwidth) / time; bytes = inputs read once + "
               "output written once",
      speedup="speedup_vs_best_baseline = fastest baseline time of the same (op, shape, M) / this time",
      ops=list(ops), shapes=[list(s) for s in shape_list], ms=ms, ms_by_shape=ms_by_shape or None,
      block_size=list(block_size),
      implementations=chosen, complete=False, rows=[], raw={op: [] for op in ops})
  rows: list[dict] = result["rows"]

  def write():
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    add_baseline_ratios(rows)
    _bench_io.write_results(result, out_json, markdown_table)

  common = dict(iterations=iterations, timer=timer, timing_label=timer_label)
  # Quantization depends on K only: one entry per distinct K.
  ms_by_shape = {name: list(v) for name, v in (ms_by_shape or {}).items()}
  quant_ms = {}  # K -> Ms
  for name, _, k in shape_list:
    quant_ms[k] = sorted(set(quant_ms.get(k, [])) | set(ms_by_shape.get(name, ms)))
  quant_ks = sorted(quant_ms)
  steps = [(op, s) for op in ops for s in (quant_ks if op == "quant" else shape_list)]
  out_of_time = False
  for index, (op, item) in enumerate(steps):
    if not chosen[op]:
      continue
    if time_budget_s and time.perf_counter() - started > time_budget_s:
      log(f"time budget of {time_budget_s} s spent: stopping before {op} {item} ({len(steps) - index} steps left)")
      out_of_time = True
      break
    log(f"[{index + 1}/{len(steps)}, {time.perf_counter() - started:.0f} s] {op} "
        f"{f'K={item}' if op == 'quant' else item[0]}")
    step_seed = (seed + index) % (2**31)
    shape_ms = quant_ms[item] if op == "quant" else ms_by_shape.get(item[0], ms)
    if op == "gemm":
      raw = bench_gemm.run([item], shape_ms, chosen[op], None, block_size=block_size, seed=step_seed,
                           log=lambda line: log("  " + line), **common)
    elif op == "linear":
      raw = bench_linear.run([item], shape_ms, chosen[op], None, block_size=block_size, seed=step_seed,
                             log=lambda line: log("  " + line), **common)
    else:
      raw = bench_quant.run(shape_ms, [item], chosen[op], group_size=block_size[1], log=lambda line: log("  " + line),
                            copy_bandwidth=copy_bw, **common)
    result["raw"][op] += raw["rows"]
    new_rows = unify(op, raw["rows"])
    for row in new_rows:
      add_roofline(row, peak_tflops=peak_tflops, copy_bandwidth=copy_bw, block_size=block_size)
    rows += new_rows
    write()
  result["complete"] = not out_of_time
  write()
  log("")
  log(text_table(result))
  if not on_gpu:
    log(CPU_WARNING)
  if out_json:
    log(f"wrote {out_json} and {out_json.removesuffix('.json')}.md")
  return result


def _jaxlib_version() -> str | None:
  try:
    import jaxlib
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


# ---- tables ----------------------------------------------------------------------------------------------------------

def _cells(r: dict) -> list[str]:
  if "error" in r:
    return ["n/a" if "needs" in r["error"] else "error"] + [""] * 5
  bad = "" if r.get("within_bf16_bound", True) else " WRONG"
  return [f"{r['us']:.2f}{bad}", f"{r['tflops']:.1f}" if "tflops" in r else "-", f"{r['gbps']:.1f}",
          f"{r['pct_roofline']:.0f}% {r['bound'][:3]}",
          f"{r['speedup_vs_best_baseline']:.2f}x" if "speedup_vs_best_baseline" in r else "-",
          f"{r['rel_err']:.1e}" if "rel_err" in r else "-"]


HEADER = ("op", "shape", "M", "N", "K", "implementation", "role", "us", "TFLOP/s", "GB/s", "roofline",
          "vs best baseline", "rel err")


def text_table(result: dict) -> str:
  lines = [[r["op"], r["shape"], str(r["m"]), str(r["n"] or "-"), str(r["k"]), r["implementation"], r["role"],
            *_cells(r)] for r in result["rows"]]
  header = list(HEADER)
  if result.get("cpu_warning"):
    header[7] = "wall us"
  widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([fmt(header), "-" * (sum(widths) + 2 * len(widths))] + [fmt(line) for line in lines])


def markdown_table(result: dict) -> str:
  header = list(HEADER)
  if result.get("cpu_warning"):
    header[7] = "wall us (CPU)"
  peak, source = result["compute_peak_tflops"], result["compute_peak_source"]
  lines = [f"jaxfp8 bench, {result['device']}, jax {result['jax_version']}, {result['date'][:10]}"
           f"{'' if result['complete'] else ' (INCOMPLETE run)'}; {result['timing']}. Roofline: "
           f"{f'{peak:g} TFLOP/s FP8 dense ({source})' if peak else 'no compute peak'}"
           f" and the copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s measured in the same run; "
           f"'vs best baseline' = fastest baseline / this (above 1: faster).", "",
           f"Command: `{result['command']}`", ""]
  if result.get("cpu_warning"):
    lines += [f"**{result['cpu_warning']}**", ""]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in result["rows"]:
    cells = [r["op"], r["shape"], str(r["m"]), str(r["n"] or "-"), str(r["k"]), r["implementation"], r["role"],
             *_cells(r)]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# ---- command line ----------------------------------------------------------------------------------------------------

def main_from_flags(flags_values, argv: Sequence[str]) -> dict:
  """`python -m jaxfp8 bench` with the absl flags of jaxfp8.__main__."""
  f = flags_values
  ms = [int(v) for v in f.m] if f.m else None
  ms_by_shape = None
  if f.shapes:
    mnk = parse_mnk(f.shapes)
    if mnk is not None and not f.m:
      shape_list, ms_by_shape = mnk
    else:
      shape_list = parse_shapes(f.shapes)
  elif f.models or f.shapes_json:
    shape_list = model_shapes(f.models or [], f.shapes_json)
  else:
    shape_list = None
  command = "python -m jaxfp8 " + " ".join(argv[1:])
  return run(f.ops, shape_list, ms, f.implementations, f.out, block_size=tuple(int(v) for v in f.block_size),
             iterations=f.iterations, seed=f.seed, peak_tflops=f.peak_tflops, time_budget_s=f.time_budget_s,
             ms_by_shape=ms_by_shape, command=command)

