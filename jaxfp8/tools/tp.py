"""`python -m jaxfp8 tp`: tensor-parallel block-FP8 linears over several devices, checked and timed against one.

It makes a 1-D mesh (axis "tp") over the first P local devices and, for each weight shape (N, K) (DeepSeek-V3's by
default) and each row count M, runs on random bf16 activations and weights made by `quantize_weight_blockwise`
(block (128, 128)), without bias:
  single         the whole layer on device 0: jitted `w8a8_block_fp8_linear` (the baseline);
  column         jitted `column_parallel_linear`: N split, x replicated, the output sharded along N;
  column_gather  the same with gather_output=True: the output all-gathered (replicated);
  row            jitted `row_parallel_linear`: K split, x and the weights sharded along K, float32 partial outputs
                 psum-ed, then cast; the output replicated.
Where each mode first runs, it is also checked (not timed) with a bias. The checks (jaxfp8.tools.tp_checks) are
recorded in the JSON; the command exits 1 when any fails or a case raises.

Timing, per call of the layer, in microseconds (what each number is, is also written into the JSON):
  wall_us        median wall-clock time of one jitted call + block_until_ready over --iterations calls after a
                 warm-up: Python dispatch, launches on every device, collectives and the wait for the slowest device.
                 For small layers this is mostly dispatch and launch latency.
  kernel_us_*    GPU only: CUPTI kernel time. CUPTI records the kernels of every GPU of the process, without the GPU
                 (`timing.kernel_records`), so the sharded numbers are totals over all devices and calls, divided by
                 the calls and by P: the mean per device (every device runs the same SPMD program). Kernels are split
                 by name (`tp_report.is_collective_kernel`) into collectives (NCCL's, XLA's own all-reduce /
                 all-gather kernels and fusions such as psum_7_0_fusion_1) and compute; a collective kernel's time
                 includes waiting for the other devices to arrive. Copies that are not kernels (peer memcpy) are not
                 seen. For the single device the same sum (mean over calls), so that both are timed the same way.
  speedup_*      single / sharded, for wall-clock, kernel and compute (kernel minus collective) time (P is the ideal).

Which layers run in which mode (--parallel): "serving" (default) splits each layer as tensor-parallel serving does
(sglang / Megatron: q_b_proj, kv_b_proj, q_proj_no_lora, gate_up column-parallel; o_proj, down row-parallel; the
low-rank q_a / kv_a projections stay replicated and are skipped), and shapes given as numbers in both modes;
"both" runs every shape in both modes, "column" / "row" in one. A mode whose split would not give every device whole
128-blocks (N/P for column, K/P for row) is skipped and listed in the JSON.

    python -m jaxfp8 tp --out=$OUT/tp_h200.json                                  # every local GPU, DeepSeek-V3
    python -m jaxfp8 tp --devices=2 --m=1,64,4096 --parallel=both --out=...
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m jaxfp8 tp --shapes="512,256;256,512" --m=1,5 --out=/tmp/tp_cpu.json     # CPU: checks only
    python -m jaxfp8 tp --rerender=/tmp/tp_h200.json --out=benchmarks/tp_h200.json      # runs nothing

--rerender re-derives a saved JSON with the current kernel classifier (the collective / compute split and the
speedups, from the per-kernel records it holds; every measurement and check stays) and records that in the JSON.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import _platform, linear, weights
from jaxfp8.tools import args, bench_gemm, bench_linear, timing
from jaxfp8.tools import results as results_io
from jaxfp8.tools.tp_checks import BF16_BOUND, ROW_VS_SINGLE_BOUND, Sample, check_output
from jaxfp8.tools.tp_report import (TIMING_NOTES, add_speedups, format_row, is_collective_kernel, markdown_table,
                                    rerender)

AXIS = "tp"
BLOCK_SIZE = (128, 128)
DEFAULT_MODELS = ("deepseek_v3",)
DEFAULT_MS = (1, 16, 64, 256, 1024, 4096)
DEFAULT_TIME_BUDGET_S = 420.0  # leaves gpu_round.sh's 540 s phase limit room to write the results
PARALLEL_CHOICES = ("serving", "both", "column", "row")
MODES = ("single", "column", "column_gather", "row")
# How tensor-parallel serving splits each layer: the first linear of a pair by columns, the one after it by rows;
# None: replicated (DeepSeek-V3's low-rank q_a / kv_a projections). Layers not named here run in both modes.
SERVING_PARALLEL: dict[str, str | None] = {
    "q_b_proj": "column", "kv_b_proj": "column", "q_proj_no_lora": "column", "dense_gate_up": "column",
    "shared_expert_gate_up": "column", "qkv_proj": "column", "gate_up_proj": "column",
    "o_proj": "row", "dense_down": "row", "shared_expert_down": "row", "down_proj": "row",
    "q_a_proj": None, "kv_a_proj_with_mqa": None, "fused_qkv_a_proj": None,
}
CPU_WARNING = ("WARNING: no GPU here. The devices are simulated CPU devices: the checks are real, the wall-clock "
               "times and speedups say nothing about GPUs.")

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
args.define_shape_flags(FLAGS, __name__, shapes_default=",".join(DEFAULT_MODELS),
                        m_default=",".join(map(str, DEFAULT_MS)), shapes_json=False)
flags.DEFINE_string("out", None, "Results JSON (a .md table goes beside it). Required.", **_KW)
flags.DEFINE_string("rerender", None, "Run nothing: re-derive the saved results at this path with the current kernel "
                    "classifier and write them to --out and its table.", **_KW)
flags.DEFINE_integer("devices", None, "Devices of the mesh (default: every local device; at least 2).", **_KW)
flags.DEFINE_enum("parallel", "serving", PARALLEL_CHOICES, "Which layers run column- or row-parallel (see above).",
                  **_KW)
flags.DEFINE_string("implementation", None, "Force the GEMM implementation (mosaic, triton, xla). Default: dispatch.",
                    **_KW)
flags.DEFINE_integer("iterations", None, "Timed calls per measurement. Default: 30 on a GPU, 3 on CPU.", lower_bound=1,
                     **_KW)
flags.DEFINE_float("time_budget_s", DEFAULT_TIME_BUDGET_S, "Start no new case after this many seconds (0: no limit).",
                   lower_bound=0, **_KW)
flags.DEFINE_integer("seed", None, "Random seed (default: fresh; the JSON records it).", **_KW)


# ---- what runs ---------------------------------------------------------------------------------------------------

def plan_layers(shape_list: Sequence[tuple[str, int, int]], parallel: str, devices: int,
                block_size: tuple[int, int] = BLOCK_SIZE) -> tuple[list[tuple[str, int, int, tuple[str, ...]]],
                                                                    list[dict]]:
  """Per shape (name, N, K), the parallel modes ("column", "row") to run on `devices` devices; and the skipped
  (shape, mode) pairs with the reason."""
  if parallel not in PARALLEL_CHOICES:
    raise ValueError(f"parallel must be one of {PARALLEL_CHOICES}, got {parallel!r}")
  gn, gk = block_size
  layers, skipped = [], []
  for name, n, k in shape_list:
    layer = name.split(".")[-1]
    if parallel == "serving" and layer in SERVING_PARALLEL:
      wanted = (SERVING_PARALLEL[layer],) if SERVING_PARALLEL[layer] else ()
      if not wanted:
        skipped.append(dict(shape=name, n=n, k=k, parallel=None, reason="replicated in tensor-parallel serving"))
    elif parallel in ("serving", "both"):
      wanted = ("column", "row")
    else:
      wanted = (parallel,)
    modes = []
    for mode in wanted:
      size, block, what = (n, gn, "N") if mode == "column" else (k, gk, "K")
      if size % (devices * block):
        skipped.append(dict(shape=name, n=n, k=k, parallel=mode,
                            reason=f"{what}={size} does not split into whole {block}-blocks over {devices} devices"))
      else:
        modes.append(mode)
    if modes:
      layers.append((name, n, k, tuple(modes)))
  return layers, skipped


def make_mesh(devices: int) -> jax.sharding.Mesh:
  """A 1-D mesh over the first `devices` local devices (Explicit axis: what jax.make_mesh gives users)."""
  return jax.make_mesh((devices,), (AXIS,), devices=jax.local_devices()[:devices])


def _random_weight(key, n: int, k: int, block_size: tuple[int, int]):
  """(w_q, w_s) of a normal weight whose row magnitudes span a few octaves, through quantize_weight_blockwise."""
  k1, k2 = jax.random.split(key)
  w = jax.random.normal(k1, (n, k), jnp.float32) * jnp.exp2(jax.random.uniform(k2, (n, 1), minval=-4, maxval=0))
  return weights.quantize_weight_blockwise(w, block_size)


def _kind(mode: str) -> str:
  """"single", "column" or "row": how a mode places its operands."""
  return mode.split("_")[0]


def _place_weights(kind: str, mesh, w_q, w_s, bias) -> tuple:
  """(w_q, w_s, bias) on device 0 (single) or on the mesh with the specs of the parallel linear."""
  if kind == "single":
    device = mesh.devices.flat[0]
    return tuple(None if a is None else jax.device_put(a, device) for a in (w_q, w_s, bias))
  return linear.shard_linear_weights(w_q, w_s, bias, mesh=mesh, axis_name=AXIS, parallel=kind)


def _place_x(kind: str, mesh, x) -> jax.Array:
  """x on device 0, replicated on the mesh (column), or sharded along K (row)."""
  if kind == "single":
    return jax.device_put(x, mesh.devices.flat[0])
  return jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, AXIS) if kind == "row" else PartitionSpec()))


def _layer_fn(mode: str, mesh, block_size: tuple[int, int], implementation: str | None) -> Callable:
  """The jitted layer call of `mode`: fn(x, w_q, w_s, bias)."""
  if mode == "single":
    return jax.jit(lambda x, w_q, w_s, b: linear.w8a8_block_fp8_linear(
        x, w_q, w_s, block_size, b, implementation=implementation))
  if mode == "row":
    return jax.jit(lambda x, w_q, w_s, b: linear.row_parallel_linear(
        x, w_q, w_s, block_size, b, mesh=mesh, axis_name=AXIS, implementation=implementation))
  gather = mode == "column_gather"
  return jax.jit(lambda x, w_q, w_s, b: linear.column_parallel_linear(
      x, w_q, w_s, block_size, b, mesh=mesh, axis_name=AXIS, gather_output=gather, implementation=implementation))


def _plan(mode: str, m: int, n: int, k: int, devices: int, block_size, implementation) -> linear.LinearPlan:
  """What each device runs: the linear's plan for its shard (float32 partial outputs for row-parallel)."""
  n_dev = n // devices if mode.startswith("column") else n
  k_dev = k // devices if mode == "row" else k
  x = jax.ShapeDtypeStruct((m, k_dev), jnp.bfloat16)
  w_q = jax.ShapeDtypeStruct((n_dev, k_dev), jnp.float8_e4m3fn)
  return linear.explain(x, w_q, block_size, implementation=implementation,
                        out_dtype=jnp.float32 if mode == "row" else None)


# ---- timing ------------------------------------------------------------------------------------------------------

def kernel_time(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int, devices: int) -> dict:
  """CUPTI kernel time of `fn` per call and per device, split into collectives and compute (see TIMING_NOTES)."""
  records = timing.kernel_records(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations)
  kernels = [dict(name=k["name"], launches_per_call=k["launches_per_call"], us_per_call_all_devices=k["us_per_call"],
                  collective=is_collective_kernel(k["name"])) for k in timing.kernel_breakdown(records, iterations)]
  total = sum(us for _, us in records) / iterations
  collective = sum(k["us_per_call_all_devices"] for k in kernels if k["collective"])
  out = dict(kernel_us_per_device=total / devices, collective_us_per_device=collective / devices,
             compute_us_per_device=(total - collective) / devices, kernel_launches_per_call=len(records) / iterations,
             kernels=kernels)
  if len(records) % (iterations * devices):  # the SPMD program should launch the same kernels on every device
    out["kernel_note"] = (f"{len(records)} kernels over {iterations} calls on {devices} devices: not the same count "
                          "per call and device, so the per-device mean is only an average")
  return out


def _time(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int, devices: int, on_gpu: bool) -> dict:
  times = dict(wall_us=timing.median_wall_us(fn, arg_sets, iterations=iterations))
  if on_gpu:
    try:
      times.update(kernel_time(fn, arg_sets, iterations=iterations, devices=devices))
    except Exception as e:  # kernel times are a second opinion; the wall clock and the checks stand without them
      times["kernel_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return times


# ---- the run ---------------------------------------------------------------------------------------------------------

class _Layer:
  """One weight shape's random weights (`sets` copies, to rotate past L2), its bias and its reference sample; the
  weights are placed where each kind of mode wants them once per shape."""

  def __init__(self, name: str, n: int, k: int, modes: tuple[str, ...], key, *, sets: int, mesh, block_size):
    self.name, self.n, self.k, self.modes, self.mesh, self.block_size = name, n, k, modes, mesh, block_size
    bias_key, *weight_keys = jax.random.split(key, sets + 1)
    self.base = [_random_weight(weight_keys[i], n, k, block_size) for i in range(sets)]
    self.bias = jax.random.normal(bias_key, (n,), jnp.float32)
    self.sample = Sample(*self.base[0], self.bias, block_size)
    self._placed: dict = {}  # (kind, set, with bias) -> the weights where that kind wants them

  def weights_for(self, kind: str, i: int, with_bias: bool) -> tuple:
    if (kind, i, with_bias) not in self._placed:
      self._placed[kind, i, with_bias] = _place_weights(kind, self.mesh, *self.base[i],
                                                         self.bias if with_bias else None)
    return self._placed[kind, i, with_bias]

  def run_modes(self) -> list[str]:
    return ["single"] + [mode for p in self.modes for mode in (("column", "column_gather") if p == "column" else (p,))]


def _run_mode(layer: _Layer, mode: str, m: int, xs: list, with_bias: bool, single_out: dict, single_row: dict, *,
              devices: int, implementation: str | None, iterations: int, on_gpu: bool) -> dict:
  """The row of one (shape, M, mode, bias) case: its plan, checks and (without bias) times. A single-device output
  goes into `single_out` (by bias), which the sharded modes after it are compared with."""
  kind = _kind(mode)
  row = dict(shape=layer.name, n=layer.n, k=layer.k, m=m, mode=mode, parallel=None if kind == "single" else kind,
             devices=1 if kind == "single" else devices, gather_output=mode == "column_gather", bias=with_bias,
             timed=not with_bias, checks=[])
  try:
    plan = _plan(mode, m, layer.n, layer.k, row["devices"], layer.block_size, implementation)
    row.update(plan=str(plan), implementation=plan.implementation, quant_implementation=plan.quant_implementation)
    if kind != "single" and with_bias not in single_out:
      raise RuntimeError("the single-device baseline failed: nothing to compare with")
    fn = _layer_fn(mode, layer.mesh, layer.block_size, implementation)
    arg_sets = [(_place_x(kind, layer.mesh, xs[i]), *layer.weights_for(kind, i, with_bias))
                for i in range(1 if with_bias else len(xs))]
    out = jax.block_until_ready(fn(*arg_sets[0]))
    checks, diffs = check_output(mode, out, single_out.get(with_bias), layer.mesh, layer.sample, xs[0], with_bias)
    row.update(diffs, checks=checks, passed=all(c["passed"] for c in checks))
    if kind == "single":
      single_out[with_bias] = out
    del out
    if not with_bias:
      row.update(_time(fn, arg_sets, iterations=iterations, devices=row["devices"], on_gpu=on_gpu))
      if kind != "single":
        add_speedups(row, single_row)
  except Exception as e:  # reported (and failing the run), not fatal for the other cases
    row.update(error=f"{type(e).__name__}: {str(e)[:400]}", passed=False)
  return row


def _run_case(layer: _Layer, m: int, key, bias_kinds: set[str], log, **options) -> list[dict]:
  """Every mode of one (shape, M): single first (the baseline of the others), then the layer's parallel modes; with
  a bias too where `bias_kinds` asks for one."""
  xs = [bench_linear._activations(k, m, layer.k) for k in jax.random.split(key, len(layer.base))]
  single_out: dict[bool, jax.Array] = {}
  single_row: dict = {}
  rows = []
  for mode in layer.run_modes():
    kind = _kind(mode)
    for with_bias in (False, True) if bias_kinds and (kind == "single" or kind in bias_kinds) else (False,):
      row = _run_mode(layer, mode, m, xs, with_bias, single_out, single_row, **options)
      if kind == "single" and not with_bias:
        single_row.update(row)
      rows.append(row)
      log("  " + format_row(row))
  return rows


def _metadata(*, devices: int, mesh, parallel, block_size, ms, ms_by_shape, shape_list, layers, skipped, iterations,
              implementation, seed, timing_label, on_gpu, time_budget_s, command) -> dict:
  return dict(
      benchmark="tensor-parallel block-FP8 linears (column- and row-parallel, bf16 in and out) vs one device",
      **results_io.run_metadata(command), platform=jax.devices()[0].platform, device_count=devices,
      devices=[str(d) for d in mesh.devices.flat], mesh_axis=AXIS, parallel=parallel, block_size=list(block_size),
      ms=list(ms), ms_by_shape=ms_by_shape or None, shapes=[list(s) for s in shape_list],
      layers=[[n, nn, kk, list(mo)] for n, nn, kk, mo in layers], skipped=skipped, iterations=iterations,
      implementation=implementation, seed=seed, timing=timing_label, timing_notes=TIMING_NOTES,
      cpu_warning=None if on_gpu else CPU_WARNING,
      tolerances=dict(rel_err_vs_reference=BF16_BOUND, rel_err_vs_single_row=ROW_VS_SINGLE_BOUND,
                      column_vs_single="bit-identical"),
      time_budget_s=time_budget_s, complete=False, checks_passed=False, failures=[], rows=[])


def _write(result: dict, out_json: str | None, started: float) -> None:
  rows = result["rows"]
  result["elapsed_s"] = round(time.perf_counter() - started, 1)
  result["failures"] = [f"{r['shape']} M={r['m']} {r['mode']}{' +bias' if r['bias'] else ''}: " + (
      r["error"] if "error" in r else ", ".join(c["name"] for c in r["checks"] if not c["passed"]))
      for r in rows if not r["passed"]]
  result["checks_passed"] = bool(rows) and not result["failures"]
  results_io.write_results(result, out_json, markdown_table)


def run(
    shape_list: Sequence[tuple[str, int, int]],
    ms: Sequence[int] = DEFAULT_MS,
    out_json: str | None = None,
    *,
    devices: int | None = None,
    parallel: str = "serving",
    block_size: tuple[int, int] = BLOCK_SIZE,
    iterations: int | None = None,
    implementation: str | None = None,
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
    seed: int | None = None,
    ms_by_shape: dict[str, Sequence[int]] | None = None,
    command: str | None = None,
    log=print,
) -> dict:
  """Checks and times every (shape, M, mode) (`ms_by_shape`: a shape's own Ms instead of `ms`); writes the JSON
  (after every (shape, M)) and the markdown table beside it. result["checks_passed"] says whether every check passed
  and no case raised."""
  started = time.perf_counter()
  available = len(jax.local_devices())
  devices = available if devices is None else devices
  if devices < 2 or devices > available:
    raise args.CommandError(
        f"tensor parallelism needs 2 or more devices, and at most the {available} local ones; got {devices} "
        f"({jax.local_devices()[0].device_kind}). On CPU simulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=2")
  block_size = tuple(block_size)
  on_gpu = _platform.gpu_compute_capability() is not None
  iterations = iterations or (30 if on_gpu else 3)
  mesh = make_mesh(devices)
  layers, skipped = plan_layers(shape_list, parallel, devices, block_size)
  ms_by_shape = {name: list(v) for name, v in (ms_by_shape or {}).items()}
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  key = jax.random.key(seed)
  timing_label = (f"wall clock (median) and CUPTI kernel time (mean) of {iterations} calls" if on_gpu else
                  f"CPU WALL-CLOCK time, median of {iterations} calls, simulated devices: not a GPU measure")
  result = _metadata(devices=devices, mesh=mesh, parallel=parallel, block_size=block_size, ms=ms,
                     ms_by_shape=ms_by_shape, shape_list=shape_list, layers=layers, skipped=skipped,
                     iterations=iterations, implementation=implementation, seed=seed, timing_label=timing_label,
                     on_gpu=on_gpu, time_budget_s=time_budget_s, command=command)
  log(f"jaxfp8 tp on {devices} x {jax.devices()[0].device_kind} (jax {jax.__version__}): "
      f"{len(layers)} layers, M {list(ms)}, parallel={parallel}; {timing_label}")
  if not on_gpu:
    log(CPU_WARNING)
  for s in skipped:
    log(f"skipped {s['shape']} {s['parallel'] or ''}: {s['reason']}")
  options = dict(devices=devices, implementation=implementation, iterations=iterations, on_gpu=on_gpu)
  todo = [(layer, m) for layer in layers for m in ms_by_shape.get(layer[0], ms)]
  bias_pending = {"column", "row"}  # one bias case per parallel mode is enough
  current = None
  stopped = False
  for (name, n, k, modes), m in todo:
    if time_budget_s and time.perf_counter() - started > time_budget_s:
      stopped = True
      break
    if current is None or current.name != name:
      current = None  # frees the last shape's weights before this shape's are made
      log(f"[{layers.index((name, n, k, modes)) + 1}/{len(layers)}, {time.perf_counter() - started:.0f} s] {name} "
          f"N={n} K={k}: {', '.join(modes)}")
      sets = min(bench_gemm.rotation_sets(n * k // devices, 0), iterations)  # per-device weights beyond L2
      key, layer_key = jax.random.split(key)
      current = _Layer(name, n, k, modes, layer_key, sets=sets, mesh=mesh, block_size=block_size)
    bias_kinds = bias_pending & set(modes)  # checked with a bias at this M
    bias_pending -= bias_kinds
    key, case_key = jax.random.split(key)
    result["rows"] += _run_case(current, m, case_key, bias_kinds, log, **options)
    _write(result, out_json, started)  # after every case: a run cut short still leaves what it measured
  if stopped:
    log(f"time budget of {time_budget_s} s spent: stopped early (the JSON says complete=false)")
  result["complete"] = not stopped
  _write(result, out_json, started)
  log("")
  log(markdown_table(result))
  log("ALL CHECKS PASSED" if result["checks_passed"] else
      f"{len(result['failures'])} FAILED CASES:\n  " + "\n  ".join(result["failures"] or ["(no case ran)"]))
  if out_json:
    log(f"wrote {out_json} and {out_json.removesuffix('.json')}.md")
  return result


# ---- command line ----------------------------------------------------------------------------------------------------

def main(command_line: str) -> int:
  """`python -m jaxfp8 tp` with this module's FLAGS: exit status 1 when a check failed or a case raised."""
  if FLAGS.rerender:
    run_options = [f"--{name}" for name in ("shapes", "models", "m", "devices", "parallel", "implementation",
                                            "iterations", "time_budget_s", "seed") if FLAGS[name].present]
    if not FLAGS.out:
      raise args.UsageError("--rerender needs --out: where the re-derived JSON goes")
    if run_options:
      raise args.UsageError(f"--rerender runs nothing: {' '.join(run_options)} would have no effect")
    if not os.path.isfile(FLAGS.rerender):
      raise args.UsageError(f"--rerender: no such file {FLAGS.rerender}")
    rerender(FLAGS.rerender, FLAGS.out, command=command_line)
    return 0
  if not FLAGS.out:
    raise args.UsageError("--out is required: the results JSON to write (a .md table goes beside it)")
  if FLAGS.implementation not in (None, *linear.IMPLEMENTATIONS):
    raise args.UsageError(f"--implementation: {FLAGS.implementation!r} is not one of "
                          f"{', '.join(linear.IMPLEMENTATIONS)}")
  shapes = args.selected_shapes(FLAGS) or args.parse_shapes(",".join(DEFAULT_MODELS))
  ms = args.parse_ms(FLAGS.m) if FLAGS.m else None
  shape_list, ms_by_shape = args.shapes_and_ms(shapes, ms)
  result = run(shape_list, ms or DEFAULT_MS, FLAGS.out, devices=FLAGS.devices, parallel=FLAGS.parallel,
               iterations=FLAGS.iterations, implementation=FLAGS.implementation,
               time_budget_s=FLAGS.time_budget_s or None, seed=FLAGS.seed, ms_by_shape=ms_by_shape,
               command=command_line)
  return 0 if result["checks_passed"] else 1
