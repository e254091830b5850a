"""`python -m jaxfp8 bench`: every implementation and baseline of every op, in one run and one table.

Ops (--ops; default gemm,linear,quant), each a module of its own with its contenders and their roles:
  quant       `bench_quant`: the activation quantizer; ours mosaic, triton; baseline xla. It depends on K only: it runs
              at the K of each weight shape, or at --k.
  gemm        `bench_gemm`: ours mosaic, triton, xla (`w8a8_block_fp8_matmul`); baselines dequant_bf16,
              torch_scaled_mm (torch blockwise `_scaled_mm`, when torch imports and a GPU is there); ceiling
              fp8_per_tensor (XLA's fp8 dot with per-tensor scales). --gemm_configs adds explicit kernel configs.
  linear      `bench_linear`: ours linear (`w8a8_block_fp8_linear`); parts gemm, quant; baselines dequant_bf16,
              w8a16_bf16.
  linear_grad `bench_linear_grad`: forward + backward of the linear: ours fp8_fwd_bwd, bf16_bwd; part fp8_fwd;
              baseline bf16_layer.
  grouped     `bench_grouped`: the MoE experts' grouped GEMM, ragged and masked; ours mosaic, xla, masked_mosaic;
              baselines ragged_dot_bf16, pallas_ragged_bf16; reference point dense_same_rows. Its problems are expert
              shapes (E, N, K) at routed rows R (--expert_shapes, --routed_rows, --routing).
  moe         `bench_moe`: the MoE layer step by step (its steps: "steps"), whole ("layer") and in bf16
              (ragged_dot_bf16, pallas_ragged_bf16), for --moe_layers at --tokens.
  valid_rows  `bench_valid_rows`: a bucket with valid_rows live against the exact rows and the whole bucket
              (--valid_rows_cases).
gemm, linear and linear_grad run over one list of weight shapes (N, K) and row counts M (--shapes, --models, --m).

Every row has its time, TFLOP/s, GB/s, the share of the roofline (the op's FLOPs at the compute peak or its bytes at
the copy bandwidth measured in the same run, whichever takes longer), the speedup over the best baseline of the same
(op, shape, M), and its check: each output is compared with the float64 reference (`jaxfp8.reference`, the
tolerances of docs/CONTRACT.md) before it is timed. The JSON (and a markdown table beside it, with each op's own
summary table) is written after every step; --time_budget_s stops the run between steps, marking it complete=false.
The command exits 1 when an output was outside its bound (a contender that cannot run is an error row, not a
failure).

On a GPU the times are CUPTI kernel times (`jaxfp8.tools.timing`). On CPU there is no CUPTI: the XLA paths are timed
with a wall clock (median of `block_until_ready` calls) on tiny shapes, only to exercise the command; CPU times say
nothing about GPU speed, and the output says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from absl import flags

from jaxfp8 import _platform
from jaxfp8.tools import args, bench_gemm, bench_grouped, bench_linear, bench_linear_grad, bench_moe, bench_quant
from jaxfp8.tools import bench_report, bench_valid_rows, timing
from jaxfp8.tools import results as results_io

MODULES = {"quant": bench_quant, "gemm": bench_gemm, "linear": bench_linear, "linear_grad": bench_linear_grad,
           "grouped": bench_grouped, "moe": bench_moe, "valid_rows": bench_valid_rows}
OPS = tuple(MODULES)
DEFAULT_OPS = ("gemm", "linear", "quant")
ROLES = {op: module.ROLES for op, module in MODULES.items()}
IMPLEMENTATIONS = {op: tuple(roles) for op, roles in ROLES.items()}
SUMMARIES = {op: module.summary_table for op, module in MODULES.items() if hasattr(module, "summary_table")}
# NVIDIA H200 (SXM) datasheet: FP8 Tensor Core 3958 TFLOP/s with 2:4 sparsity, i.e. 1979 dense.
H200_FP8_DENSE_TFLOPS = 1979.0
GPU_MS = (1, 16, 64, 256, 1024, 4096)
CPU_MS = (1, 8, 64)
CPU_SHAPES = (("tiny.256x512", 256, 512), ("tiny.512x1024", 512, 1024))
CPU_WARNING = ("WARNING: no GPU here. These are CPU wall-clock times of the XLA code paths on small shapes; they "
               "exercise the command and say nothing about GPU speed.")

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
flags.DEFINE_list("ops", list(DEFAULT_OPS), f"Ops to time: some of {', '.join(OPS)}.", **_KW)
args.define_shape_flags(FLAGS, __name__, shapes_default="GPU: DeepSeek-V3 and Qwen3-32B weights "
                        "(bench_gemm.DEFAULT_SHAPES); CPU: two tiny shapes",
                        m_default=f"GPU {','.join(map(str, GPU_MS))}; CPU {','.join(map(str, CPU_MS))}")
flags.DEFINE_string("k", None, "quant: widths K to quantize, ','-separated, instead of the K of each weight shape "
                    "(e.g. 512,2048,7168,18432 with --m=1,16,64,256,1024,4096,16384).", **_KW)
flags.DEFINE_string("gemm_configs", None, "gemm, grouped: explicit kernel configs to time beside the planner's "
                    "choice, ';'-separated, each 'mosaic:field=value,...' (both ops), 'triton:...' (gemm) or "
                    "'masked_mosaic:...' (grouped, the masked layout), e.g. "
                    "'mosaic:tile_m=128,tile_n=256,max_concurrent_steps=4,wg_split=N'.", **_KW)
flags.DEFINE_string("expert_shapes", None, "grouped: expert GEMMs, ';'-separated, each a name of "
                    f"{', '.join(name for name, *_ in bench_grouped.DEFAULT_SHAPES)} or E,N,K. Default: all of those "
                    "(CPU: a tiny one).", **_KW)
flags.DEFINE_string("routed_rows", None, "grouped: routed rows R (tokens x top-k), ','-separated, for every "
                    "expert shape. Default: each shape's own (bench_grouped.DEFAULT_ROWS).", **_KW)
flags.DEFINE_list("routing", ["balanced"], f"grouped: routings, some of {', '.join(bench_grouped.ROUTINGS)}.", **_KW)
flags.DEFINE_list("moe_layers", None, f"moe: layers, some of {', '.join(bench_moe.LAYERS)}. Default: "
                  f"{','.join(bench_moe.GPU_LAYERS)} (CPU: {','.join(bench_moe.CPU_LAYERS)}).", **_KW)
flags.DEFINE_string("tokens", None, "moe: token counts T, ','-separated. Default: "
                    f"{','.join(map(str, bench_moe.DEFAULT_TOKENS))} "
                    f"(CPU: {','.join(map(str, bench_moe.CPU_TOKENS))}).", **_KW)
flags.DEFINE_string("valid_rows_cases", None, f"valid_rows: {bench_valid_rows.CASES_HELP}. Default: DeepSeek-V3 "
                    "q_proj at 4096:2100 and 1024:300, dense_down and Qwen3-32B qkv at 256:70 (CPU: a tiny one).",
                    **_KW)
flags.DEFINE_list("implementations", None, "Implementations to time (see the roles above; a name may serve several "
                  "ops). Default: every one that runs here.", **_KW)
flags.DEFINE_list("block_size", ["128", "128"], "Quantization block (gn, gk).", **_KW)
flags.DEFINE_integer("iterations", None, "Timed calls per measurement. Default: 30 on a GPU, 5 on CPU.", lower_bound=1,
                     **_KW)
flags.DEFINE_float("peak_tflops", None, "Compute peak for the roofline. Default: 1979 on an H200 (FP8 dense).",
                   lower_bound=0, **_KW)
flags.DEFINE_float("time_budget_s", None, "Start no new step after this many seconds (the JSON says complete=false).",
                   lower_bound=0, **_KW)
flags.DEFINE_integer("seed", None, "Random seed (default: fresh; the JSON records it).", **_KW)
flags.DEFINE_string("out", None, "Results JSON to write (a .md table goes beside it). Default: print only.", **_KW)


# ---- what to run -----------------------------------------------------------------------------------------------------

# the implementations whose kernel configs --gemm_configs times, per op
CONFIG_IMPLEMENTATIONS = {"gemm": bench_gemm.CONFIG_IMPLEMENTATIONS, "grouped": ("mosaic", "masked_mosaic")}


def unavailable(name: str, on_gpu: bool) -> str | None:
  """Why implementation `name` (or a config of it, 'mosaic[...]') cannot be timed here; None when it can."""
  base = name.split("[")[0]
  if base in ("mosaic", "masked_mosaic", "masked_mosaic_live", "pallas_ragged_bf16") and not _platform.is_hopper():
    return f"{name} needs a Hopper GPU (sm_90)"
  if base == "triton" and not _platform.has_fp8_gpu():
    return f"{name} needs an NVIDIA GPU with FP8 (sm >= 8.9)"
  if base == "torch_scaled_mm" and not on_gpu:
    return "torch_scaled_mm needs a GPU"
  return None


def runnable_implementations(op: str, on_gpu: bool) -> tuple[str, ...]:
  """The implementations of `op` that run on this machine (torch_scaled_mm: bench_gemm finds out whether torch does)."""
  return tuple(name for name in IMPLEMENTATIONS[op] if unavailable(name, on_gpu) is None)


def select_implementations(requested: Sequence[str] | None, ops: Sequence[str], on_gpu: bool,
                           gemm_configs: Sequence[str] = ()) -> dict[str, list[str]]:
  """Per op, the requested names that op knows (a name may serve several ops), or every runnable one; the gemm and
  grouped ops also time the config contenders of `gemm_configs` that are theirs (CONFIG_IMPLEMENTATIONS). A
  requested name no op knows is a UsageError; one that cannot run here a CommandError."""
  if requested:
    known = {name for op in ops for name in IMPLEMENTATIONS[op]}
    unknown = [name for name in requested if name not in known]
    if unknown:
      raise args.UsageError(f"--implementations: unknown {unknown} for ops {list(ops)}; known: {sorted(known)}")
    chosen = {op: [name for name in IMPLEMENTATIONS[op] if name in requested] for op in ops}
  else:
    chosen = {op: list(runnable_implementations(op, on_gpu)) for op in ops}
  for op, bases in CONFIG_IMPLEMENTATIONS.items():
    if op in chosen:
      chosen[op] += [name for name in gemm_configs if name.split("[")[0] in bases]
  if gemm_configs and not any(name in chosen.get(op, ()) for op in CONFIG_IMPLEMENTATIONS for name in gemm_configs):
    ops_text = " or ".join(f"the {op} op's ({', '.join(bases)})" for op, bases in CONFIG_IMPLEMENTATIONS.items())
    raise args.UsageError(f"--gemm_configs: none of {list(gemm_configs)} is a config of {ops_text} among --ops")
  asked = [name for op in ops for name in chosen[op] if requested or "[" in name]
  why = sorted({reason for name in asked if (reason := unavailable(name, on_gpu))})
  if why:
    flag = "--implementations" if requested else "--gemm_configs"
    raise args.CommandError(f"{flag}: {'; '.join(why)}; this machine has {jax.devices()[0].device_kind} (leave "
                            f"{flag} out for every one that runs)")
  return chosen


@dataclasses.dataclass(frozen=True)
class Problems:
  """What the ops run on (None: the op's default here; see the flags)."""
  shape_list: Sequence[tuple[str, int, int]] | None = None
  ms: Sequence[int] | None = None
  ms_by_shape: Mapping[str, Sequence[int]] | None = None
  quant_ks: Sequence[int] | None = None
  expert_shapes: Sequence[tuple[str, int, int, int]] | None = None
  routed_rows: Sequence[int] | None = None
  routings: Sequence[str] = ("balanced",)
  moe_layers: Sequence[str] | None = None
  tokens: Sequence[int] | None = None
  valid_rows_cases: Sequence[tuple] | None = None


def steps(ops: Sequence[str], shape_list: Sequence[tuple[str, int, int]], ms: Sequence[int],
          ms_by_shape: Mapping[str, Sequence[int]], quant_ks: Sequence[int] | None) -> list[tuple[str, object, list]]:
  """(op, shape or K, Ms) of the ops over weight shapes, in the order they run. The quantizer depends on K only: one
  step per distinct K, at every M of the shapes of that K (or at `ms` for each of `quant_ks`)."""
  out = []
  for op in ops:
    if op in ("gemm", "linear", "linear_grad"):
      out += [(op, shape, list(ms_by_shape.get(shape[0], ms))) for shape in shape_list]
    elif op == "quant":
      quant_ms: dict[int, set] = {k: set(ms) for k in quant_ks or ()}
      for name, _, k in ([] if quant_ks else shape_list):
        quant_ms.setdefault(k, set()).update(ms_by_shape.get(name, ms))
      out += [(op, k, sorted(quant_ms[k])) for k in sorted(quant_ms)]
  return out


def problem_steps(ops: Sequence[str], p: Problems, on_gpu: bool) -> list[tuple[str, object, list | None]]:
  """(op, problem, sizes) of the ops with problems of their own: grouped (expert shape, R), moe (layer, T),
  valid_rows (a weight's cases)."""
  out = []
  if "grouped" in ops:
    shapes = p.expert_shapes or (bench_grouped.DEFAULT_SHAPES if on_gpu else bench_grouped.CPU_SHAPES)
    out += [("grouped", shape, list(p.routed_rows or bench_grouped.DEFAULT_ROWS.get(shape[0], bench_grouped.CPU_ROWS)))
            for shape in shapes]
  if "moe" in ops:
    tokens = p.tokens or (bench_moe.DEFAULT_TOKENS if on_gpu else bench_moe.CPU_TOKENS)
    out += [("moe", name, list(tokens)) for name in p.moe_layers or (
        bench_moe.GPU_LAYERS if on_gpu else bench_moe.CPU_LAYERS)]
  if "valid_rows" in ops:
    cases = p.valid_rows_cases or (bench_valid_rows.DEFAULT_CASES if on_gpu else bench_valid_rows.CPU_CASES)
    out += [("valid_rows", case, None) for case in cases]
  return out


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


# ---- the run ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
  """What every step of a run shares: the implementations, how they are timed, the roofline they are measured
  against."""
  on_gpu: bool
  chosen: dict[str, list[str]]
  iterations: int
  timer: Callable[..., float] | None  # None: CUPTI, the op modules' default
  timing_label: str
  copy_bandwidth: float
  peak_tflops: float | None
  block_size: tuple[int, int]
  routings: tuple[str, ...] = ("balanced",)
  gemm_configs: Mapping[str, object] = dataclasses.field(default_factory=dict)


def setup(ops: Sequence[str], implementations: Sequence[str] | None, *, iterations: int | None,
          peak_tflops: float | None, block_size: tuple[int, int], routings: Sequence[str] = ("balanced",),
          gemm_configs: Mapping[str, object] | None = None, log=print) -> Setup:
  """Chooses the implementations and the timer, and measures the copy bandwidth (the memory roofline) now."""
  on_gpu = _platform.gpu_compute_capability() is not None
  gemm_configs = dict(gemm_configs or {})
  chosen = select_implementations(implementations, ops, on_gpu, tuple(gemm_configs))
  iterations = iterations or (30 if on_gpu else 5)
  if peak_tflops is None and on_gpu and "H200" in jax.devices()[0].device_kind:
    peak_tflops = H200_FP8_DENSE_TFLOPS
  if on_gpu:
    timer, label = None, f"CUPTI kernel time (all kernels of a call), median of {iterations} calls"
    copy_bw = bench_quant.measure_copy_bandwidth()
  else:
    timer = timing.median_wall_us
    label = f"CPU WALL-CLOCK time (block_until_ready), median of {iterations} calls: not a GPU measure"
    log(CPU_WARNING)
    copy_bw = bench_quant.measure_copy_bandwidth(64 << 20, timer=timing.median_wall_us)
  return Setup(on_gpu, chosen, iterations, timer, label, copy_bw, peak_tflops, tuple(block_size), tuple(routings),
               gemm_configs)


def _metadata(s: Setup, ops, p: Problems, seed: int, command: str | None) -> dict:
  torch_version = None
  try:
    import torch
    torch_version = torch.__version__
  except ImportError:
    pass
  peak = s.peak_tflops
  return dict(
      benchmark="jaxfp8 bench: " + ", ".join(ops) + ", every implementation and baseline",
      **results_io.run_metadata(command), device_count=jax.device_count(), platform=jax.devices()[0].platform,
      jaxlib_version=_jaxlib_version(), torch_version=torch_version, seed=seed, iterations=s.iterations,
      timing=s.timing_label, cpu_warning=None if s.on_gpu else CPU_WARNING,
      copy_bandwidth_tbps=s.copy_bandwidth / 1e12, compute_peak_tflops=peak,
      compute_peak_source="NVIDIA H200 datasheet, FP8 Tensor Core dense" if peak == H200_FP8_DENSE_TFLOPS
      else ("given with --peak_tflops" if peak else None),
      roofline="pct_roofline = 100 * max(flops / peak, bytes / copy bandwidth) / time; bytes = inputs read once + "
               "output written once",
      speedup="speedup_vs_best_baseline = fastest baseline time of the same (op, shape, M) / this time",
      check="rel_err against the float64 reference (jaxfp8.reference) before timing; within_bound: within `bound`",
      ops=list(ops), shapes=[list(x) for x in p.shape_list], ms=list(p.ms), ms_by_shape=dict(p.ms_by_shape) or None,
      quant_ks=list(p.quant_ks) if p.quant_ks else None, block_size=list(s.block_size), implementations=s.chosen,
      routings=list(s.routings), gemm_configs={name: str(c) for name, c in s.gemm_configs.items()} or None,
      complete=False, rows=[], raw={op: [] for op in ops})


def run_step(s: Setup, op: str, item, ms: Sequence[int] | None, seed: int, log=print) -> list[dict]:
  """The raw rows of one op's benchmark on one problem (a weight shape, a K, an expert shape, a layer, a weight's
  valid_rows cases) at the sizes given."""
  common = dict(iterations=s.iterations, timer=s.timer, log=lambda line: log("  " + line))
  chosen = s.chosen[op]
  if op == "quant":
    return bench_quant.run(ms, [item], chosen, group_size=s.block_size[1], copy_bandwidth=s.copy_bandwidth,
                           timing_label=s.timing_label, **common)["rows"]
  if op == "gemm":
    return bench_gemm.run([item], ms, chosen, None, block_size=s.block_size, seed=seed, configs=s.gemm_configs,
                          timing_label=s.timing_label, **common)["rows"]
  if op == "linear":
    return bench_linear.run([item], ms, chosen, None, block_size=s.block_size, seed=seed, timing_label=s.timing_label,
                            **common)["rows"]
  if op == "linear_grad":
    return bench_linear_grad.run(item, ms, chosen, block_size=s.block_size, seed=seed, **common)
  if op == "grouped":
    return bench_grouped.run([item], {item[0]: ms}, chosen, routings=s.routings, block_size=s.block_size, seed=seed,
                             configs=s.gemm_configs, **common)
  if op == "moe":
    return bench_moe.run(item, ms, chosen, seed=seed, **common)
  return bench_valid_rows.run(item, chosen, block_size=s.block_size, seed=seed, **common)


def _step_label(op: str, item, ms) -> str:
  name = f"K={item}" if op == "quant" else (item if isinstance(item, str) else item[0])
  sizes = {"grouped": "R", "moe": "T", "valid_rows": None}.get(op, "M")
  if op == "valid_rows":
    return f"{op} {name} bucket:live {', '.join(f'{b}:{v}' for b, v in item[3])}"
  return f"{op} {name} {sizes}={list(ms)}"


def run(
    ops: Sequence[str] = DEFAULT_OPS,
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
    problems: Problems = Problems(),
    gemm_configs: Mapping[str, object] | None = None,
    command: str | None = None,
    log=print,
) -> dict:
  """Times every implementation of every op on its problems (`shape_list` and `ms` for the ops over weight shapes,
  `problems` for the rest; None: the defaults here).

  Prints progress and the table; writes JSON after every step (a run cut short still leaves what it measured,
  marked complete=False) and a markdown table beside it."""
  started = time.perf_counter()
  if not ops or any(op not in OPS for op in ops):
    raise args.UsageError(f"--ops: expected some of {', '.join(OPS)}, got {list(ops)}")
  s = setup(ops, implementations, iterations=iterations, peak_tflops=peak_tflops, block_size=block_size,
            routings=problems.routings, gemm_configs=gemm_configs, log=log)
  shape_list = list(shape_list if shape_list is not None else (bench_gemm.DEFAULT_SHAPES if s.on_gpu else CPU_SHAPES))
  ms = list(ms if ms else (GPU_MS if s.on_gpu else CPU_MS))
  ms_by_shape = {name: list(v) for name, v in (problems.ms_by_shape or {}).items()}
  if ms_by_shape and all(name in ms_by_shape for name, _, _ in shape_list):
    ms = sorted({m for values in ms_by_shape.values() for m in values})  # what runs, for the record
  problems = dataclasses.replace(problems, shape_list=shape_list, ms=ms, ms_by_shape=ms_by_shape)
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  todo = steps(ops, shape_list, ms, ms_by_shape, problems.quant_ks) + problem_steps(ops, problems, s.on_gpu)
  log(f"jaxfp8 bench on {jax.devices()[0].device_kind} (jax {jax.__version__}): ops {list(ops)}, {len(todo)} steps; "
      f"{s.timing_label}")
  peak = f"{s.peak_tflops:g} TFLOP/s (FP8 dense, datasheet)" if s.peak_tflops else "unknown here: memory roofline only"
  log(f"copy bandwidth {s.copy_bandwidth / 1e12:.3f} TB/s (read + write, measured now); compute peak {peak}")
  result = _metadata(s, ops, problems, seed, command)

  def write():
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    bench_report.add_baseline_ratios(result["rows"])
    results_io.write_results(result, out_json, lambda r: bench_report.markdown_table(r, SUMMARIES))

  for index, (op, item, step_ms) in enumerate(todo):
    if not s.chosen[op]:
      continue
    if time_budget_s and time.perf_counter() - started > time_budget_s:
      log(f"time budget of {time_budget_s} s spent: stopping before {_step_label(op, item, step_ms)} "
          f"({len(todo) - index} steps left)")
      break
    log(f"[{index + 1}/{len(todo)}, {time.perf_counter() - started:.0f} s] {_step_label(op, item, step_ms)}")
    raw = run_step(s, op, item, step_ms, (seed + index) % (2**31), log)
    result["raw"][op] += raw
    for row in (new_rows := bench_report.unify(op, raw, ROLES[op])):
      bench_report.add_roofline(row, peak_tflops=s.peak_tflops, copy_bandwidth=s.copy_bandwidth,
                                block_size=s.block_size, quant_bytes=bench_quant.quant_bytes)
    result["rows"] += new_rows
    write()
  else:
    result["complete"] = True
  write()
  _report(result, s, out_json, log)
  return result


def _report(result: dict, s: Setup, out_json: str | None, log) -> None:
  log("")
  log(bench_report.text_table(result))
  for op, summary in SUMMARIES.items():
    rows = [r for r in result["rows"] if r["op"] == op]
    if rows:
      log("")
      log(summary(rows).rstrip("\n"))
  failed = bench_report.failed_checks(result["rows"])
  log(f"\n{len(failed)} of {len(result['rows'])} rows FAILED their check or errored" if failed else
      f"\nevery checked output of the {len(result['rows'])} rows is within its bound")
  if not s.on_gpu:
    log(CPU_WARNING)
  if out_json:
    log(f"wrote {out_json} and {out_json.removesuffix('.json')}.md")


def _jaxlib_version() -> str | None:
  try:
    import jaxlib
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


# ---- command line ----------------------------------------------------------------------------------------------------

def _problems_from_flags(ops: Sequence[str], ms_by_shape) -> Problems:
  """The op-specific flags, parsed; a flag of an op --ops leaves out is a UsageError (it would have no effect)."""
  for flag, flag_ops in (("k", ("quant",)), ("gemm_configs", ("gemm", "grouped")), ("expert_shapes", ("grouped",)),
                         ("routed_rows", ("grouped",)), ("moe_layers", ("moe",)), ("tokens", ("moe",)),
                         ("valid_rows_cases", ("valid_rows",))):
    if getattr(FLAGS, flag) and not set(flag_ops) & set(ops):
      raise args.UsageError(f"--{flag}: a flag of the {' and '.join(flag_ops)} op, but --ops has no "
                            f"{' or '.join(flag_ops)}")
  routings = [r.strip() for r in FLAGS.routing]
  if any(r not in bench_grouped.ROUTINGS for r in routings) or not routings:
    raise args.UsageError(f"--routing: expected some of {', '.join(bench_grouped.ROUTINGS)}, got {FLAGS.routing}")
  layers = [name.strip() for name in FLAGS.moe_layers or ()]
  if any(name not in bench_moe.LAYERS for name in layers):
    raise args.UsageError(f"--moe_layers: unknown {[n for n in layers if n not in bench_moe.LAYERS]}; known: "
                          f"{', '.join(bench_moe.LAYERS)}")
  return Problems(
      ms_by_shape=ms_by_shape, quant_ks=args.parse_ints(FLAGS.k, flag="--k") if FLAGS.k else None,
      expert_shapes=parse_expert_shapes(FLAGS.expert_shapes) if FLAGS.expert_shapes else None,
      routed_rows=args.parse_ints(FLAGS.routed_rows, flag="--routed_rows") if FLAGS.routed_rows else None,
      routings=tuple(routings), moe_layers=tuple(layers) or None,
      tokens=args.parse_ints(FLAGS.tokens, flag="--tokens") if FLAGS.tokens else None,
      valid_rows_cases=bench_valid_rows.parse_cases(FLAGS.valid_rows_cases) if FLAGS.valid_rows_cases else None)


def parse_gemm_configs(text: str | None) -> dict[str, object]:
  """--gemm_configs -> {contender name: kernel config}."""
  configs = {}
  for item in (part.strip() for part in (text or "").split(";") if part.strip()):
    try:
      name, config = bench_gemm.config_contender(item)
    except ValueError as e:
      raise args.UsageError(f"--gemm_configs: {e}") from None
    configs[name] = config
  return configs


def main(command_line: str) -> int:
  """`python -m jaxfp8 bench` with this module's FLAGS."""
  ops = [op.strip() for op in FLAGS.ops]
  if not ops or any(op not in OPS for op in ops):
    raise args.UsageError(f"--ops: expected some of {', '.join(OPS)}, got {','.join(FLAGS.ops)!r}")
  shapes = args.selected_shapes(FLAGS)
  ms = args.parse_ms(FLAGS.m) if FLAGS.m else None
  shape_list, ms_by_shape = args.shapes_and_ms(shapes, ms) if shapes else (None, None)
  problems = _problems_from_flags(ops, ms_by_shape)
  result = run(ops, shape_list, ms, FLAGS.implementations, FLAGS.out,
               block_size=args.parse_ints(FLAGS.block_size, flag="--block_size", count=2),
               iterations=FLAGS.iterations, seed=FLAGS.seed, peak_tflops=FLAGS.peak_tflops,
               time_budget_s=FLAGS.time_budget_s, problems=problems,
               gemm_configs=parse_gemm_configs(FLAGS.gemm_configs), command=command_line)
  return 1 if any(r.get("within_bound") is False for r in result["rows"]) else 0
