"""`python -m jaxfp8 bench`: every implementation and baseline of the GEMM, the linear and the quantizer, in one run.

It drives the three benchmark modules (`bench_gemm`, `bench_linear`, `bench_quant`) over one list of weight shapes
(N, K) and row counts M, times them all in the same process, and puts their rows into one table and one JSON file:
time, TFLOP/s, GB/s, the share of the roofline (the op's FLOPs at the compute peak or its bytes at the copy bandwidth
measured in the same run, whichever takes longer) and the speedup over the best baseline of the same (op, shape, M).
The JSON (and a markdown table beside it) is written after every shape; --time_budget_s stops the run between
shapes, marking the JSON complete=false.

Roles of the implementations (names for --implementations):
  gemm    ours: mosaic, triton, xla (`w8a8_block_fp8_matmul`); baselines: dequant_bf16 (XLA dequantize to bf16, then
          dot), torch_scaled_mm (torch blockwise `_scaled_mm`, when torch imports and a GPU is there); ceiling:
          fp8_per_tensor (XLA fp8 dot with per-tensor scales: cuBLASLt speed without block scales).
  linear  ours: linear (`w8a8_block_fp8_linear` as dispatched); parts: gemm, quant; baselines: dequant_bf16,
          w8a16_bf16 (bf16 activations times the dequantized weight).
  quant   ours: mosaic, triton; baseline: xla (`per_token_group_quant_fp8_row_padded` in jnp). It depends on K only:
          it runs at the K of each weight shape, or at --k.
  grouped_gemm (only when asked for with --ops) ours: mosaic, xla, masked_mosaic; baselines: ragged_dot_bf16,
          pallas_ragged_bf16; reference point: dense_same_rows (`bench_grouped`). Its problems are expert shapes
          (E, N, K) and routed rows R (--expert_shapes, --routed_rows), each with balanced and skewed routing.

On a GPU the times are CUPTI kernel times (`jaxfp8.tools.timing`). On CPU there is no CUPTI: the XLA paths are timed
with a wall clock (median of `block_until_ready` calls) on small shapes, only to exercise the command; CPU times say
nothing about GPU speed, and the output says so.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from absl import flags

from jaxfp8 import _platform
from jaxfp8.tools import args, bench_gemm, bench_grouped, bench_linear, bench_quant
from jaxfp8.tools import results as results_io

OPS = ("gemm", "linear", "quant", "grouped_gemm")
DEFAULT_OPS = ("gemm", "linear", "quant")
# NVIDIA H200 (SXM) datasheet: FP8 Tensor Core 3958 TFLOP/s with 2:4 sparsity, i.e. 1979 dense.
H200_FP8_DENSE_TFLOPS = 1979.0
ROLES = {
    "gemm": {"mosaic": "ours", "triton": "ours", "xla": "ours", "dequant_bf16": "baseline",
             "torch_scaled_mm": "baseline", "fp8_per_tensor": "ceiling"},
    "linear": {"linear": "ours", "gemm": "part", "quant": "part", "dequant_bf16": "baseline",
               "w8a16_bf16": "baseline"},
    "quant": {"mosaic": "ours", "triton": "ours", "xla": "baseline"},
    "grouped_gemm": bench_grouped.ROLES,
}
IMPLEMENTATIONS = {op: tuple(roles) for op, roles in ROLES.items()}
GPU_MS = (1, 16, 64, 256, 1024, 4096)
CPU_MS = (1, 8, 64)
CPU_SHAPES = (("tiny.256x512", 256, 512), ("tiny.512x1024", 512, 1024))
CPU_WARNING = ("WARNING: no GPU here. These are CPU wall-clock times of the XLA code paths on small shapes; they "
               "exercise the command and say nothing about GPU speed.")

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
flags.DEFINE_list("ops", list(DEFAULT_OPS), "Ops to time: some of gemm, linear, quant, grouped_gemm.", **_KW)
args.define_shape_flags(FLAGS, __name__, shapes_default="GPU: DeepSeek-V3 and Qwen3-32B weights "
                        "(bench_gemm.DEFAULT_SHAPES); CPU: two tiny shapes",
                        m_default=f"GPU {','.join(map(str, GPU_MS))}; CPU {','.join(map(str, CPU_MS))}")
flags.DEFINE_string("k", None, "quant: widths K to quantize, ','-separated, instead of the K of each weight shape "
                    "(e.g. 512,2048,7168,18432 with --m=1,16,64,256,1024,4096,16384).", **_KW)
flags.DEFINE_string("expert_shapes", None, "grouped_gemm: expert GEMMs, ';'-separated, each a name of "
                    f"{', '.join(name for name, *_ in bench_grouped.DEFAULT_SHAPES)} or E,N,K. Default: all of those "
                    "(CPU: a tiny one).", **_KW)
flags.DEFINE_string("routed_rows", None, "grouped_gemm: routed rows R (tokens x top-k), ','-separated, for every "
                    "expert shape. Default: each shape's own (bench_grouped.DEFAULT_ROWS).", **_KW)
flags.DEFINE_list("implementations", None, "Implementations to time (see the roles above; a name may serve several "
                  "ops). Default: every one that runs here.", **_KW)
flags.DEFINE_list("block_size", ["128", "128"], "Quantization block (gn, gk).", **_KW)
flags.DEFINE_integer("iterations", None, "Timed calls per measurement. Default: 30 on a GPU, 5 on CPU.", lower_bound=1,
                     **_KW)
flags.DEFINE_float("peak_tflops", None, "Compute peak for the roofline. Default: 1979 on an H200 (FP8 dense).",
                   lower_bound=0, **_KW)
flags.DEFINE_float("time_budget_s", None, "Start no new shape after this many seconds (the JSON says complete=false).",
                   lower_bound=0, **_KW)
flags.DEFINE_integer("seed", None, "Random seed (default: fresh; the JSON records it).", **_KW)
flags.DEFINE_string("out", None, "Results JSON to write (a .md table goes beside it). Default: print only.", **_KW)


# ---- what to run -----------------------------------------------------------------------------------------------------

def unavailable(op: str, name: str, on_gpu: bool) -> str | None:
  """Why implementation `name` of `op` cannot be timed on this machine; None when it can."""
  if (op in ("gemm", "quant", "grouped_gemm") and name in ("mosaic", "masked_mosaic", "pallas_ragged_bf16")
      and not _platform.is_hopper()):
    return f"{name} needs a Hopper GPU (sm_90)"
  if op in ("gemm", "quant") and name == "triton" and not _platform.has_fp8_gpu():
    return "triton needs an NVIDIA GPU with FP8 (sm >= 8.9)"
  if name == "torch_scaled_mm" and not on_gpu:
    return "torch_scaled_mm needs a GPU"
  return None


def runnable_implementations(op: str, on_gpu: bool) -> tuple[str, ...]:
  """The implementations of `op` that run on this machine (torch_scaled_mm: bench_gemm finds out whether torch does)."""
  return tuple(name for name in IMPLEMENTATIONS[op] if unavailable(op, name, on_gpu) is None)


def select_implementations(requested: Sequence[str] | None, ops: Sequence[str], on_gpu: bool) -> dict[str, list[str]]:
  """Per op, the requested names that op knows (a name may serve several ops), or every runnable one. A requested
  name no op knows is a UsageError; one that cannot run here a CommandError."""
  if not requested:
    return {op: list(runnable_implementations(op, on_gpu)) for op in ops}
  known = {name for op in ops for name in IMPLEMENTATIONS[op]}
  unknown = [name for name in requested if name not in known]
  if unknown:
    raise args.UsageError(f"--implementations: unknown {unknown} for ops {list(ops)}; known: {sorted(known)}")
  chosen = {op: [name for name in IMPLEMENTATIONS[op] if name in requested] for op in ops}
  why = sorted({reason for op in ops for name in chosen[op] if (reason := unavailable(op, name, on_gpu))})
  if why:
    raise args.CommandError(f"--implementations: {'; '.join(why)}; this machine has "
                            f"{jax.devices()[0].device_kind} (leave --implementations out for every one that runs)")
  return chosen


def steps(ops: Sequence[str], shape_list: Sequence[tuple[str, int, int]], ms: Sequence[int],
          ms_by_shape: dict[str, Sequence[int]], quant_ks: Sequence[int] | None) -> list[tuple[str, object, list]]:
  """(op, shape or K, Ms) in the order they run. The quantizer depends on K only: one step per distinct K, at every M
  of the shapes of that K (or at `ms` for each of `quant_ks`)."""
  out = []
  for op in ops:
    if op == "grouped_gemm":
      continue  # its own problems: `grouped_steps`
    if op != "quant":
      out += [(op, shape, list(ms_by_shape.get(shape[0], ms))) for shape in shape_list]
      continue
    quant_ms: dict[int, set] = {k: set(ms) for k in quant_ks or ()}
    for name, _, k in ([] if quant_ks else shape_list):
      quant_ms.setdefault(k, set()).update(ms_by_shape.get(name, ms))
    out += [(op, k, sorted(quant_ms[k])) for k in sorted(quant_ms)]
  return out


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
  num_bytes = row.get("bytes") or op_bytes(row["op"], row["implementation"], row["m"], row["n"], row["k"],
                                           block_size)
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
_KEEP = ("us", "rel_err", "within_bf16_bound", "error", "note", "plan", "kernels", "rotation_sets", "bytes", "groups",
         "routing", "active_experts", "floor_us", "x_floor")


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

@dataclasses.dataclass(frozen=True)
class Setup:
  """What every step of a run shares: the implementations, how they are timed, the roofline they are measured
  against."""
  on_gpu: bool
  chosen: dict[str, list[str]]
  iterations: int
  timer: Callable[..., float] | None  # None: CUPTI, the sub-benchmarks' default
  timing_label: str
  copy_bandwidth: float
  peak_tflops: float | None
  block_size: tuple[int, int]


def setup(ops: Sequence[str], implementations: Sequence[str] | None, *, iterations: int | None,
          peak_tflops: float | None, block_size: tuple[int, int], log=print) -> Setup:
  """Chooses the implementations and the timer, and measures the copy bandwidth (the memory roofline) now."""
  on_gpu = _platform.gpu_compute_capability() is not None
  chosen = select_implementations(implementations, ops, on_gpu)
  iterations = iterations or (30 if on_gpu else 5)
  if peak_tflops is None and on_gpu and "H200" in jax.devices()[0].device_kind:
    peak_tflops = H200_FP8_DENSE_TFLOPS
  if on_gpu:
    timer, label = None, f"CUPTI kernel time (all kernels of a call), median of {iterations} calls"
    copy_bw = bench_quant.measure_copy_bandwidth()
  else:
    timer = median_wall_us
    label = f"CPU WALL-CLOCK time (block_until_ready), median of {iterations} calls: not a GPU measure"
    log(CPU_WARNING)
    copy_bw = bench_quant.measure_copy_bandwidth(64 << 20, timer=median_wall_us)
  return Setup(on_gpu, chosen, iterations, timer, label, copy_bw, peak_tflops, tuple(block_size))


def _metadata(s: Setup, *, ops, shape_list, ms, ms_by_shape, quant_ks, seed, command) -> dict:
  torch_version = None
  try:
    import torch
    torch_version = torch.__version__
  except ImportError:
    pass
  peak = s.peak_tflops
  return dict(
      benchmark="jaxfp8 bench: block FP8 GEMM, linear and activation quantizer, every implementation and baseline",
      **results_io.run_metadata(command), device_count=jax.device_count(), platform=jax.devices()[0].platform,
      jaxlib_version=_jaxlib_version(), torch_version=torch_version, seed=seed, iterations=s.iterations,
      timing=s.timing_label, cpu_warning=None if s.on_gpu else CPU_WARNING,
      copy_bandwidth_tbps=s.copy_bandwidth / 1e12, compute_peak_tflops=peak,
      compute_peak_source="NVIDIA H200 datasheet, FP8 Tensor Core dense" if peak == H200_FP8_DENSE_TFLOPS
      else ("given with --peak_tflops" if peak else None),
      roofline="pct_roofline = 100 * max(flops / peak, bytes / copy bandwidth) / time; bytes = inputs read once + "
               "output written once",
      speedup="speedup_vs_best_baseline = fastest baseline time of the same (op, shape, M) / this time",
      ops=list(ops), shapes=[list(x) for x in shape_list], ms=ms, ms_by_shape=ms_by_shape or None,
      quant_ks=list(quant_ks) if quant_ks else None, block_size=list(s.block_size), implementations=s.chosen,
      complete=False, rows=[], raw={op: [] for op in ops})


def grouped_steps(expert_shapes, routed_rows, on_gpu: bool) -> list[tuple[str, object, list]]:
  """("grouped_gemm", (name, E, N, K), Rs) per expert shape."""
  shapes = expert_shapes or (bench_grouped.DEFAULT_SHAPES if on_gpu else bench_grouped.CPU_SHAPES)
  default_rows = lambda name: bench_grouped.DEFAULT_ROWS.get(name, bench_grouped.CPU_ROWS)
  return [("grouped_gemm", shape, list(routed_rows or default_rows(shape[0]))) for shape in shapes]


def parse_expert_shapes(text: str) -> list[tuple[str, int, int, int]]:
  """--expert_shapes: names of bench_grouped.DEFAULT_SHAPES or E,N,K triples, ';'-separated."""
  known = {shape[0]: shape for shape in bench_grouped.DEFAULT_SHAPES}
  shapes = []
  for item in (part.strip() for part in text.split(";") if part.strip()):
    if item in known:
      shapes.append(known[item])
      continue
    if not all(part.strip().isdigit() for part in item.split(",")):
      raise args.UsageError(f"--expert_shapes: {item!r} is neither E,N,K nor one of {', '.join(known)}")
    values = args.parse_ints(item, flag="--expert_shapes", count=3)
    shapes.append((f"E{values[0]}.{values[1]}x{values[2]}", *values))
  if not shapes:
    raise args.UsageError("--expert_shapes: no shapes given")
  return shapes


def run_step(s: Setup, op: str, item, ms: Sequence[int], seed: int, log=print) -> list[dict]:
  """The raw rows of one op's benchmark on one shape (or K, for the quantizer) at the Ms given."""
  common = dict(iterations=s.iterations, timer=s.timer, timing_label=s.timing_label, log=lambda line: log("  " + line))
  if op == "grouped_gemm":
    return bench_grouped.run([item], {item[0]: ms}, s.chosen[op], block_size=s.block_size, seed=seed, **common)["rows"]
  if op == "gemm":
    raw = bench_gemm.run([item], ms, s.chosen[op], None, block_size=s.block_size, seed=seed, **common)
  elif op == "linear":
    raw = bench_linear.run([item], ms, s.chosen[op], None, block_size=s.block_size, seed=seed, **common)
  else:
    raw = bench_quant.run(ms, [item], s.chosen[op], group_size=s.block_size[1], copy_bandwidth=s.copy_bandwidth,
                          **common)
  return raw["rows"]


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
    quant_ks: Sequence[int] | None = None,
    expert_shapes: Sequence[tuple[str, int, int, int]] | None = None,
    routed_rows: Sequence[int] | None = None,
    command: str | None = None,
    log=print,
) -> dict:
  """Times every implementation of every op on every (shape, M) (`ms_by_shape`: a shape's own Ms instead of `ms`;
  `quant_ks`: the quantizer's Ks instead of the shapes').

  Prints progress and the table; writes JSON after every shape (a run cut short still leaves what it measured,
  marked complete=False) and a markdown table beside it."""
  started = time.perf_counter()
  if not ops or any(op not in OPS for op in ops):
    raise args.UsageError(f"--ops: expected some of {', '.join(OPS)}, got {list(ops)}")
  s = setup(ops, implementations, iterations=iterations, peak_tflops=peak_tflops, block_size=block_size, log=log)
  shape_list = list(shape_list if shape_list is not None else (bench_gemm.DEFAULT_SHAPES if s.on_gpu else CPU_SHAPES))
  ms = list(ms if ms else (GPU_MS if s.on_gpu else CPU_MS))
  ms_by_shape = {name: list(v) for name, v in (ms_by_shape or {}).items()}
  if ms_by_shape and all(name in ms_by_shape for name, _, _ in shape_list):
    ms = sorted({m for values in ms_by_shape.values() for m in values})  # what runs, for the record
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  log(f"jaxfp8 bench on {jax.devices()[0].device_kind} (jax {jax.__version__}): ops {list(ops)}, "
      f"{len(shape_list)} shapes, M {ms}; {s.timing_label}")
  peak = f"{s.peak_tflops:g} TFLOP/s (FP8 dense, datasheet)" if s.peak_tflops else "unknown here: memory roofline only"
  log(f"copy bandwidth {s.copy_bandwidth / 1e12:.3f} TB/s (read + write, measured now); compute peak {peak}")
  result = _metadata(s, ops=ops, shape_list=shape_list, ms=ms, ms_by_shape=ms_by_shape, quant_ks=quant_ks, seed=seed,
                     command=command)

  def write():
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    add_baseline_ratios(result["rows"])
    results_io.write_results(result, out_json, markdown_table)

  todo = steps(ops, shape_list, ms, ms_by_shape, quant_ks)
  if "grouped_gemm" in ops:
    todo += grouped_steps(expert_shapes, routed_rows, s.on_gpu)
  for index, (op, item, step_ms) in enumerate(todo):
    if not s.chosen[op]:
      continue
    if time_budget_s and time.perf_counter() - started > time_budget_s:
      log(f"time budget of {time_budget_s} s spent: stopping before {op} {item} ({len(todo) - index} steps left)")
      break
    log(f"[{index + 1}/{len(todo)}, {time.perf_counter() - started:.0f} s] {op} "
        f"{f'K={item}' if op == 'quant' else item[0]}" + (f" R={step_ms}" if op == "grouped_gemm" else ""))
    raw = run_step(s, op, item, step_ms, (seed + index) % (2**31), log)
    result["raw"][op] += raw
    for row in (new_rows := unify(op, raw)):
      add_roofline(row, peak_tflops=s.peak_tflops, copy_bandwidth=s.copy_bandwidth, block_size=s.block_size)
    result["rows"] += new_rows
    write()
  else:
    result["complete"] = True
  write()
  log("")
  log(text_table(result))
  if not s.on_gpu:
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

def main(command_line: str) -> int:
  """`python -m jaxfp8 bench` with this module's FLAGS."""
  ops = [op.strip() for op in FLAGS.ops]
  if not ops or any(op not in OPS for op in ops):
    raise args.UsageError(f"--ops: expected some of {', '.join(OPS)}, got {','.join(FLAGS.ops)!r}")
  shapes = args.selected_shapes(FLAGS)
  ms = args.parse_ms(FLAGS.m) if FLAGS.m else None
  shape_list, ms_by_shape = args.shapes_and_ms(shapes, ms) if shapes else (None, None)
  quant_ks = args.parse_ints(FLAGS.k, flag="--k") if FLAGS.k else None
  if quant_ks and "quant" not in ops:
    raise args.UsageError("--k: the quantizer's widths, but --ops has no quant")
  if (FLAGS.expert_shapes or FLAGS.routed_rows) and "grouped_gemm" not in ops:
    raise args.UsageError("--expert_shapes/--routed_rows: the grouped GEMM's problems, but --ops has no grouped_gemm")
  expert_shapes = parse_expert_shapes(FLAGS.expert_shapes) if FLAGS.expert_shapes else None
  routed_rows = args.parse_ints(FLAGS.routed_rows, flag="--routed_rows") if FLAGS.routed_rows else None
  run(ops, shape_list, ms, FLAGS.implementations, FLAGS.out,
      block_size=args.parse_ints(FLAGS.block_size, flag="--block_size", count=2), iterations=FLAGS.iterations,
      seed=FLAGS.seed, peak_tflops=FLAGS.peak_tflops, time_budget_s=FLAGS.time_budget_s, ms_by_shape=ms_by_shape,
      quant_ks=quant_ks, expert_shapes=expert_shapes, routed_rows=routed_rows, command=command_line)
  return 0
