"""Tensor-parallel block-FP8 linears over several devices: checked against one device, and timed against one device.

`python -m jaxfp8.tools.bench_tp` makes a 1-D mesh (axis "tp") over the first P local devices and, for each weight shape
(N, K) of shapes.json (DeepSeek-V3 by default) and each row count M, runs on random bf16 activations and weights made
by `quantize_weight_blockwise` (block (128, 128)), without bias:
  single         the whole layer on device 0: jitted `w8a8_block_fp8_linear` (the baseline);
  column         jitted `column_parallel_linear`: N split, x replicated, the output sharded along N;
  column_gather  the same with gather_output=True: the output all-gathered (replicated);
  row            jitted `row_parallel_linear`: K split, x and the weights sharded along K, float32 partial outputs
                 psum-ed, then cast; the output replicated.
Where each mode first runs, it is also checked (not timed) with a bias.

Checks (every one is recorded in the JSON; the command exits 1 when any fails or a case raises):
  single         no NaN/Inf; relative Frobenius error vs the float64 reference (`jaxfp8.reference`) on sampled rows and
                 column blocks <= 5e-3 (SPEC.md section 2, bf16 output).
  column(_gather) the output sharded along N (replicated with gather); bit-identical to single (each device runs the
                 unsharded computation on its columns); vs the float64 reference <= 5e-3.
  row            the output replicated; no NaN/Inf; vs single <= 1e-3 (only the float32 summation order of the K
                 slices differs, which flips a few bf16 roundings by one ulp: far below 1e-3 in Frobenius norm); vs
                 the float64 reference <= 5e-3.

Timing, per call of the layer, in microseconds (what each number is, is also written into the JSON):
  wall_us        median wall-clock time of one jitted call + block_until_ready over --iterations calls after a
                 warm-up: Python dispatch, launches on every device, collectives and the wait for the slowest device.
                 For small layers this is mostly dispatch and launch latency.
  kernel_us_*    GPU only: CUPTI kernel time. CUPTI records the kernels of every GPU of the process, without the GPU
                 (`timing.kernel_records`), so the sharded numbers are totals over all devices and calls, divided by
                 the calls and by P: the mean per device (every device runs the same SPMD program). Kernels are split
                 by name (`is_collective_kernel`) into collectives (NCCL's, XLA's own all-reduce / all-gather kernels
                 and fusions such as psum_7_0_fusion_1) and compute; a collective kernel's time includes waiting for
                 the other devices to arrive. Copies that are not kernels (peer memcpy) are not seen. For the single
                 device the same sum (mean over calls), so that both are timed the same way.
  speedup_*      single / sharded, for wall-clock, kernel and compute (kernel minus collective) time (P is the ideal).

Which layers run in which mode (--parallel): "serving" (default) splits each layer as tensor-parallel serving does
(sglang / Megatron: q_b_proj, kv_b_proj, q_proj_no_lora, gate_up column-parallel; o_proj, down row-parallel; the
low-rank q_a / kv_a projections stay replicated and are skipped), and shapes given with --shapes in both modes;
"both" runs every shape in both modes, "column" / "row" in one. A mode whose split would not give every device whole
128-blocks (N/P for column, K/P for row) is skipped and listed in the JSON.

    python -m jaxfp8.tools.bench_tp --out=benchmarks/tp_h200.json                       # all local GPUs, DeepSeek-V3
    python -m jaxfp8.tools.bench_tp --devices=2 --m=1,64,4096 --parallel=both --out=...
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m jaxfp8.tools.bench_tp --shapes="512,256;256,512" --m=1,5 --out=/tmp/tp_cpu.json   # CPU: checks only
    python -m jaxfp8.tools.bench_tp --rerender=/tmp/tp_h200.json --out=benchmarks/tp_h200.json   # runs nothing

--rerender re-derives a saved JSON with the current kernel classifier (the collective / compute split and the
speedups, from the per-kernel records it holds; every measurement and check stays) and records that in the JSON.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxfp8 import _platform, linear, weights
from jaxfp8.tools import results as _bench_io, bench, bench_gemm, bench_linear, timing
from jaxfp8 import reference as ref

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
BF16_BOUND = 5e-3            # SPEC.md section 2: relative Frobenius error of a bf16 output vs the float64 reference
ROW_VS_SINGLE_BOUND = 1e-3   # ours: see the module docstring
# Kernel names of collectives: NCCL's (ncclDevKernel_AllReduce_Sum_f32_RING_LL...), and XLA's own all-reduce kernels
# and collective fusions, named after the HLO op (all-reduce-start, stream_executor's AllReduceKernelImpl) or after the
# JAX primitive behind it (psum_7_0_fusion_1: XLA's small all-reduce of a psum). A name token counts only where no
# lowercase letter touches it on either side (camel case and digits may), so "small_reduce", a local gather
# ("loop_gather_fusion"), a scatter ("input_scatter_fusion") or "cumsum" stay compute.
_COLLECTIVE_TOKENS = (r"all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|collective[-_]?permute|"
                      r"collective[-_]?broadcast|cross[-_]?replica[-_]?sum|psum|pmax|pmin|ppermute|pbroadcast")
COLLECTIVE_KERNEL = re.compile(rf"(?i:nccl|nvshmem)|(?<![a-z])(?i:{_COLLECTIVE_TOKENS})(?![a-z])")
CPU_WARNING = ("WARNING: no GPU here. The devices are simulated CPU devices: the checks are real, the wall-clock "
               "times and speedups say nothing about GPUs.")
TIMING_NOTES = {
    "wall_us": "median wall-clock time of one jitted call + jax.block_until_ready, after a warm-up call, inputs "
               "rotated: includes Python dispatch, launches on every device, collectives and the wait for the "
               "slowest device",
    "kernel_us_per_device": "CUPTI kernel time per call: the sum over all kernels of all devices and all calls, / "
                            "calls / devices (1 for single): the mean per device; CUPTI does not say which GPU ran "
                            "a kernel",
    "collective_us_per_device": "the part of kernel_us_per_device spent in kernels whose name looks like a collective "
                                f"(/{COLLECTIVE_KERNEL.pattern}/); includes each device's wait for the others",
    "compute_us_per_device": "kernel_us_per_device - collective_us_per_device: quantizer, GEMM, casts, copies",
    "kernels": "per kernel name: launches per call and us per call, summed over all devices; collective: whether it "
               "counts in collective_us_per_device",
    "speedup_wall, speedup_kernel, speedup_compute": "single-device time / sharded time (the ideal is the device "
                                                     "count): wall clock, all kernels, kernels without collectives",
}


def is_collective_kernel(name: str) -> bool:
  """Whether a CUPTI kernel name is a collective's (see COLLECTIVE_KERNEL)."""
  return COLLECTIVE_KERNEL.search(name) is not None


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


# ---- checks ------------------------------------------------------------------------------------------------------

@jax.jit
def _diff_stats(out, expected) -> dict:
  """How `out` differs from `expected` (same shape, dtype and device), computed on the device."""
  uint = {2: jnp.uint16, 4: jnp.uint32}[out.dtype.itemsize]
  o, e = out.astype(jnp.float32), expected.astype(jnp.float32)
  d = o - e
  differing = jax.lax.bitcast_convert_type(out, uint) != jax.lax.bitcast_convert_type(expected, uint)
  return dict(max_abs_diff=jnp.max(jnp.abs(d)), elements_differing=jnp.sum(differing),
              err_sq=jnp.sum(d * d), ref_sq=jnp.sum(e * e), nonfinite=jnp.sum(~jnp.isfinite(o)))


def compare(out: jax.Array, expected: jax.Array) -> dict:
  """max |out - expected|, bitwise-differing elements, relative Frobenius error (float32 sums) and NaN/Inf count of
  `out`, which is first copied to `expected`'s device (the sharded output onto device 0)."""
  stats = {key: float(v) for key, v in jax.device_get(_diff_stats(jax.device_put(out, expected.sharding),
                                                                  expected)).items()}
  err_sq, ref_sq = stats.pop("err_sq"), stats.pop("ref_sq")
  stats["rel_err"] = math.sqrt(err_sq / ref_sq) if ref_sq else math.sqrt(err_sq)
  stats["elements_differing"] = int(stats["elements_differing"])
  stats["nonfinite"] = int(stats["nonfinite"])
  return stats


def _check(checks: list[dict], name: str, value, bound, passed: bool, about: str) -> None:
  checks.append(dict(name=name, value=value, bound=bound, passed=bool(passed), about=about))


class _Sample:
  """The float64 reference of one layer on sampled rows and whole column blocks (`_bench_io.sample_rows_and_blocks`).

  The weight's sampled rows are fetched to the host once per shape; per M only the sampled rows of x are."""

  def __init__(self, w_q, w_s, bias, block_size: tuple[int, int]):
    n = w_q.shape[0]
    gn = block_size[0]
    _, self.blocks = _bench_io.sample_rows_and_blocks(1, n, gn)
    self.cols = np.concatenate([np.arange(j * gn, min(n, (j + 1) * gn)) for j in self.blocks])
    self.w_q = np.asarray(w_q[jnp.asarray(self.cols)])
    self.w_s = np.asarray(w_s[jnp.asarray(self.blocks)])
    self.bias = np.asarray(bias)[self.cols]
    self.block_size = block_size

  def rel_err(self, out_on_device0: jax.Array, x: jax.Array, with_bias: bool) -> float:
    m = x.shape[0]
    rows, _ = _bench_io.sample_rows_and_blocks(m, 1, 1)
    x_rows = np.asarray(x[jnp.asarray(rows)])
    expected = ref.w8a8_block_fp8_linear(x_rows, self.w_q, self.w_s, self.block_size,
                                         bias=self.bias if with_bias else None)
    got = np.asarray(out_on_device0[jnp.asarray(rows)][:, jnp.asarray(self.cols)]).astype(np.float32)
    return ref.relative_error(got, expected)


def check_output(mode: str, out: jax.Array, single: jax.Array | None, mesh, sample: _Sample, x: jax.Array,
                 with_bias: bool) -> tuple[list[dict], dict]:
  """The checks of one output (see the module docstring); returns (checks, measured differences vs single)."""
  checks: list[dict] = []
  if mode == "single":
    stats = compare(out, out)
    _check(checks, "finite", stats["nonfinite"], 0, stats["nonfinite"] == 0, "NaN/Inf outputs")
    on_device0 = out
    diffs = {}
  else:
    if mode == "column":
      want = NamedSharding(mesh, PartitionSpec(None, AXIS))
      _check(checks, "sharded_along_n", str(out.sharding), str(want), out.sharding.is_equivalent_to(want, out.ndim),
             "the output stays sharded along N")
    else:
      _check(checks, "replicated", str(out.sharding), "fully replicated", out.sharding.is_fully_replicated,
             "the output is on every device")
    stats = compare(out, single)
    diffs = dict(max_abs_diff_vs_single=stats["max_abs_diff"], elements_differing_vs_single=stats["elements_differing"],
                 rel_err_vs_single=stats["rel_err"])
    if mode in ("column", "column_gather"):
      _check(checks, "bit_identical_to_single", stats["elements_differing"], 0, stats["elements_differing"] == 0,
             f"elements whose bits differ from the single-device output (max |diff| {stats['max_abs_diff']:.3g})")
    else:
      _check(checks, "finite", stats["nonfinite"], 0, stats["nonfinite"] == 0, "NaN/Inf outputs")
      _check(checks, "rel_err_vs_single", stats["rel_err"], ROW_VS_SINGLE_BOUND,
             stats["rel_err"] <= ROW_VS_SINGLE_BOUND,
             "relative Frobenius error vs the single-device output (float32 sum order of the K slices)")
    on_device0 = jax.device_put(out, single.sharding)
  err = sample.rel_err(on_device0, x, with_bias)
  _check(checks, "rel_err_vs_reference", err, BF16_BOUND, err <= BF16_BOUND,
         "relative Frobenius error vs the float64 reference on sampled rows and column blocks (SPEC.md, bf16 out)")
  return checks, diffs


# ---- timing ------------------------------------------------------------------------------------------------------

def kernel_time(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int, devices: int) -> dict:
  """CUPTI kernel time of `fn` per call and per device, split into collectives and compute (see TIMING_NOTES)."""
  records = timing.kernel_records(lambda i: fn(*arg_sets[i % len(arg_sets)]), iterations=iterations)
  by_name: dict[str, list] = {}
  for name, us in records:
    entry = by_name.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += us
  total = sum(us for _, us in records) / iterations
  collective = sum(us for name, (_, us) in by_name.items() if is_collective_kernel(name)) / iterations
  kernels = [dict(name=name, launches_per_call=count / iterations, us_per_call_all_devices=us / iterations,
                  collective=is_collective_kernel(name))
             for name, (count, us) in sorted(by_name.items(), key=lambda item: -item[1][1])]
  out = dict(kernel_us_per_device=total / devices, collective_us_per_device=collective / devices,
             compute_us_per_device=(total - collective) / devices, kernel_launches_per_call=len(records) / iterations,
             kernels=kernels)
  if len(records) % (iterations * devices):  # the SPMD program should launch the same kernels on every device
    out["kernel_note"] = (f"{len(records)} kernels over {iterations} calls on {devices} devices: not the same count "
                          "per call and device, so the per-device mean is only an average")
  return out


def _time(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int, devices: int, on_gpu: bool) -> dict:
  times = dict(wall_us=bench.median_wall_us(fn, arg_sets, iterations=iterations))
  if on_gpu:
    try:
      times.update(kernel_time(fn, arg_sets, iterations=iterations, devices=devices))
    except Exception as e:  # kernel times are a second opinion; the wall clock and the checks stand without them
      times["kernel_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return times


def _add_speedups(row: dict, single: dict) -> None:
  if "wall_us" in row and "wall_us" in single:
    row["speedup_wall"] = single["wall_us"] / row["wall_us"]
  if "kernel_us_per_device" in row and "kernel_us_per_device" in single:
    row["speedup_kernel"] = single["kernel_us_per_device"] / row["kernel_us_per_device"]
    if row["compute_us_per_device"] > 0:
      row["speedup_compute"] = single["compute_us_per_device"] / row["compute_us_per_device"]


# ---- the run -----------------------------------------------------------------------------------------------------

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
    command: str | None = None,
    log=print,
) -> dict:
  """Checks and times every (shape, M, mode); writes the JSON (after every (shape, M)) and the markdown table beside it.
  result["checks_passed"] says whether every check passed and no case raised."""
  started = time.perf_counter()
  available = len(jax.local_devices())
  devices = available if devices is None else devices
  if devices < 2 or devices > available:
    raise ValueError(f"tensor parallelism needs 2 or more devices, and at most the {available} local ones; got "
                     f"devices={devices} ({jax.local_devices()[0].device_kind}). On CPU simulate devices with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=2")
  block_size = tuple(block_size)
  on_gpu = _platform.gpu_compute_capability() is not None
  iterations = iterations or (30 if on_gpu else 3)
  mesh = make_mesh(devices)
  layers, skipped = plan_layers(shape_list, parallel, devices, block_size)
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  key = jax.random.key(seed)
  timing_label = (f"wall clock (median) and CUPTI kernel time (mean) of {iterations} calls" if on_gpu else
                  f"CPU WALL-CLOCK time, median of {iterations} calls, simulated devices: not a GPU measure")
  result = dict(
      benchmark="tensor-parallel block-FP8 linears (column- and row-parallel, bf16 in and out) vs one device",
      **_bench_io.run_metadata(command), platform=jax.devices()[0].platform, device_count=devices,
      devices=[str(d) for d in mesh.devices.flat], mesh_axis=AXIS, parallel=parallel, block_size=list(block_size),
      ms=list(ms), shapes=[list(s) for s in shape_list], layers=[[n, nn, kk, list(mo)] for n, nn, kk, mo in layers],
      skipped=skipped, iterations=iterations, implementation=implementation, seed=seed, timing=timing_label,
      timing_notes=TIMING_NOTES, cpu_warning=None if on_gpu else CPU_WARNING,
      tolerances=dict(rel_err_vs_reference=BF16_BOUND, rel_err_vs_single_row=ROW_VS_SINGLE_BOUND,
                      column_vs_single="bit-identical"),
      time_budget_s=time_budget_s, complete=False, checks_passed=False, failures=[], rows=[])
  rows: list[dict] = result["rows"]
  log(f"jaxfp8 bench_tp on {devices} x {jax.devices()[0].device_kind} (jax {jax.__version__}): "
      f"{len(layers)} layers, M {list(ms)}, parallel={parallel}; {timing_label}")
  if not on_gpu:
    log(CPU_WARNING)
  for s in skipped:
    log(f"skipped {s['shape']} {s['parallel'] or ''}: {s['reason']}")

  def write():
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["failures"] = [f"{r['shape']} M={r['m']} {r['mode']}{' +bias' if r['bias'] else ''}: " + (
        r["error"] if "error" in r else ", ".join(c["name"] for c in r["checks"] if not c["passed"]))
        for r in rows if not r["passed"]]
    result["checks_passed"] = bool(rows) and not result["failures"]
    _bench_io.write_results(result, out_json, markdown_table)

  def out_of_time() -> bool:
    return bool(time_budget_s) and time.perf_counter() - started > time_budget_s

  bias_pending = {"column", "row"}  # one bias case per parallel mode is enough
  stopped = False
  for index, (name, n, k, modes) in enumerate(layers):
    if out_of_time():
      stopped = True
      break
    log(f"[{index + 1}/{len(layers)}, {time.perf_counter() - started:.0f} s] {name} N={n} K={k}: {', '.join(modes)}")
    sets = min(bench_gemm.rotation_sets(n * k // devices, 0), iterations)  # per-device weights beyond L2
    key, bias_key, *weight_keys = jax.random.split(key, sets + 2)
    base = [_random_weight(weight_keys[i], n, k, block_size) for i in range(sets)]
    bias = jax.random.normal(bias_key, (n,), jnp.float32)
    sample = _Sample(*base[0], bias, block_size)
    placed: dict = {}  # (kind, set, with bias) -> weights where that kind wants them, placed once per shape

    def weights_for(kind: str, i: int, with_bias: bool) -> tuple:
      if (kind, i, with_bias) not in placed:
        placed[kind, i, with_bias] = _place_weights(kind, mesh, *base[i], bias if with_bias else None)
      return placed[kind, i, with_bias]

    run_modes = ["single"] + [mode for p in modes for mode in (("column", "column_gather") if p == "column" else (p,))]
    for m in ms:
      if out_of_time():
        stopped = True
        break
      key, *x_keys = jax.random.split(key, sets + 1)
      xs = [bench_linear._activations(x_keys[i], m, k) for i in range(sets)]
      bias_kinds = bias_pending & set(modes)  # checked with a bias at this M
      bias_pending -= bias_kinds
      single_out: dict[bool, jax.Array] = {}
      single_row: dict = {}
      for mode in run_modes:
        kind = _kind(mode)
        for with_bias in (False, True) if bias_kinds and (kind == "single" or kind in bias_kinds) else (False,):
          row = dict(shape=name, n=n, k=k, m=m, mode=mode, parallel=None if kind == "single" else kind,
                     devices=1 if kind == "single" else devices, gather_output=mode == "column_gather",
                     bias=with_bias, timed=not with_bias, checks=[])
          try:
            plan = _plan(mode, m, n, k, row["devices"], block_size, implementation)
            row.update(plan=str(plan), implementation=plan.implementation,
                       quant_implementation=plan.quant_implementation)
            if kind != "single" and with_bias not in single_out:
              raise RuntimeError("the single-device baseline failed: nothing to compare with")
            fn = _layer_fn(mode, mesh, block_size, implementation)
            arg_sets = [(_place_x(kind, mesh, xs[i]), *weights_for(kind, i, with_bias))
                        for i in range(1 if with_bias else sets)]
            out = jax.block_until_ready(fn(*arg_sets[0]))
            checks, diffs = check_output(mode, out, single_out.get(with_bias), mesh, sample, xs[0], with_bias)
            row.update(diffs, checks=checks, passed=all(c["passed"] for c in checks))
            if kind == "single":
              single_out[with_bias] = out
            del out
            if not with_bias:
              row.update(_time(fn, arg_sets, iterations=iterations, devices=row["devices"], on_gpu=on_gpu))
              if kind == "single":
                single_row = row
              else:
                _add_speedups(row, single_row)
          except Exception as e:  # reported (and failing the run), not fatal for the other cases
            row.update(error=f"{type(e).__name__}: {str(e)[:400]}", passed=False)
          rows.append(row)
          log("  " + format_row(row))
      del xs, single_out
      write()  # after every case: a run cut short still leaves what it measured
    base.clear()  # frees this shape's weights before the next shape's are made
    placed.clear()
    if stopped:
      break
  if stopped:
    log(f"time budget of {time_budget_s} s spent: stopped early (the JSON says complete=false)")
  result["complete"] = not stopped
  write()
  log("")
  log(markdown_table(result))
  log("ALL CHECKS PASSED" if result["checks_passed"] else
      f"{len(result['failures'])} FAILED CASES:\n  " + "\n  ".join(result["failures"] or ["(no case ran)"]))
  if out_json:
    log(f"wrote {out_json} and {out_json.removesuffix('.json')}.md")
  return result


# ---- re-deriving a saved result ----------------------------------------------------------------------------------

RECOMPUTED = ("kernels[].collective", "collective_us_per_device", "compute_us_per_device", "speedup_wall",
              "speedup_kernel", "speedup_compute", "timing_notes")


def rederive(result: dict) -> tuple[dict, dict[str, bool]]:
  """A copy of `result` (a saved JSON of `run`) with every per-kernel record reclassified by `is_collective_kernel`,
  and the fields of RECOMPUTED derived again from the records; what was measured (wall_us, kernel_us_per_device, the
  records' launches and times) and the checks are left as they are. Also returns the kernel names whose class
  changed, with their new class."""
  out = copy.deepcopy(result)
  reclassified: dict[str, bool] = {}
  for row in out["rows"]:
    if "kernels" not in row:
      continue
    devices = row["devices"]
    total = sum(k["us_per_call_all_devices"] for k in row["kernels"]) / devices
    if not math.isclose(total, row["kernel_us_per_device"], rel_tol=1e-9, abs_tol=1e-9):
      raise ValueError(f"{row['shape']} M={row['m']} {row['mode']}: its kernel records sum to {total} us per device, "
                       f"not its kernel_us_per_device={row['kernel_us_per_device']}: the records are incomplete")
    for kernel in row["kernels"]:
      collective = is_collective_kernel(kernel["name"])
      if kernel.get("collective") != collective:
        reclassified[kernel["name"]] = collective
      kernel["collective"] = collective
    row["collective_us_per_device"] = sum(
        k["us_per_call_all_devices"] for k in row["kernels"] if k["collective"]) / devices
    row["compute_us_per_device"] = row["kernel_us_per_device"] - row["collective_us_per_device"]
  singles = {(r["shape"], r["m"]): r for r in out["rows"] if r["mode"] == "single" and r["timed"]}
  for row in out["rows"]:
    if row["mode"] != "single" and row["timed"]:
      for key in ("speedup_wall", "speedup_kernel", "speedup_compute"):
        row.pop(key, None)
      _add_speedups(row, singles.get((row["shape"], row["m"]), {}))
  out["timing_notes"] = dict(TIMING_NOTES)
  return out, reclassified


def rerender(in_json: str, out_json: str, *, command: str, log=print) -> dict:
  """Re-derives the results saved in `in_json` (`rederive`) and writes them to `out_json` and its markdown table; the
  JSON's "rederived" list gains a record of this: the source file and its sha256, when, the command, the classifier,
  what was reclassified and what was recomputed. The run's own command, date and measurements stay."""
  with open(in_json, "rb") as f:
    raw = f.read()
  result, reclassified = rederive(json.loads(raw))
  result.setdefault("rederived", []).append(dict(
      source=in_json, source_sha256=hashlib.sha256(raw).hexdigest(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(), command=command,
      collective_kernel_pattern=COLLECTIVE_KERNEL.pattern,
      reclassified=[dict(name=name, collective=collective) for name, collective in sorted(reclassified.items())],
      recomputed=list(RECOMPUTED),
      measurements="unchanged: every wall-clock and kernel time, per-kernel record and check is the source's"))
  _bench_io.write_results(result, out_json, markdown_table)
  log(markdown_table(result))
  log(f"re-derived {in_json} ({len(reclassified)} kernel names reclassified: "
      f"{', '.join(f'{n} -> {"collective" if c else "compute"}' for n, c in sorted(reclassified.items())) or '-'}); "
      f"wrote {out_json} and {out_json.removesuffix('.json')}.md")
  return result


# ---- tables ------------------------------------------------------------------------------------------------------

def _us(value: float | None) -> str:
  return "-" if value is None else f"{value:.1f}"


def _checks_cell(row: dict) -> str:
  if "error" in row:
    return "**ERROR**"
  failed = [c["name"] for c in row["checks"] if not c["passed"]]
  if failed:
    return "**FAIL** " + ", ".join(failed)
  if row["mode"] == "single":
    return "ok"
  if row["mode"] == "row":
    return f"ok ({row['rel_err_vs_single']:.1e} vs 1 dev)"
  return "ok (bit-identical)"


def format_row(row: dict) -> str:
  head = f"{row['shape']:<34} M={row['m']:<5} {row['mode'] + (' +bias' if row['bias'] else ''):<19}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  err = next((c["value"] for c in row["checks"] if c["name"] == "rel_err_vs_reference"), float("nan"))
  timed = ""
  if "wall_us" in row:
    timed = f" wall {row['wall_us']:9.1f} us"
    if "kernel_us_per_device" in row:
      timed += (f"  kernel/dev {row['kernel_us_per_device']:8.1f} us (collective "
                f"{row['collective_us_per_device']:.1f})")
    if "speedup_wall" in row:
      timed += f"  speedup wall x{row['speedup_wall']:.2f}"
    if "speedup_kernel" in row:
      timed += f" kernel x{row['speedup_kernel']:.2f}"
    if "speedup_compute" in row:
      timed += f" compute x{row['speedup_compute']:.2f}"
  return f"{head} {_checks_cell(row):<28} ref err {err:8.1e}{timed}"


def _wall_note(result: dict) -> str:
  """What the wall-clock columns measure; with kernel times, how much of them is the GPUs' work (the fastest call)."""
  p = result["device_count"]
  note = ("Wall-clock columns are host-side: the median of one jitted call + block_until_ready, Python dispatch and "
          f"the launch of the {p}-device program included.")
  timed = [r for r in result["rows"] if r["timed"] and "kernel_us_per_device" in r]
  fastest = [min(rows, key=lambda r: r["wall_us"]) for rows in ([r for r in timed if r["mode"] == "single"],
                                                                [r for r in timed if r["mode"] != "single"]) if rows]
  if fastest:
    note += (" At these sizes that overhead dominates (fastest call: " + "; ".join(
        f"{r['devices']} dev {r['wall_us']:.1f} us wall for {r['kernel_us_per_device']:.1f} us of kernels"
        f"{' per device' if r['devices'] > 1 else ''}" for r in fastest) +
        "), so the kernel columns (CUPTI) are the ones that compare the GPUs' work.")
  return note


def markdown_table(result: dict) -> str:
  p = result["device_count"]
  lines = [f"Tensor-parallel block-FP8 linears on {p} x {result['device']} vs one, jax {result['jax_version']}, "
           f"{result['date'][:10]}{'' if result['complete'] else ' (INCOMPLETE run: time budget)'}; "
           f"{result['timing']}. Checks: {'all passed' if result['checks_passed'] else '**FAILURES**'}.", "",
           _wall_note(result), "",
           f"Speedup = 1 device / {p} devices (ideal {p}). Kernel time per device = CUPTI sum over all devices / "
           f"{p}; 'coll.' = its collective kernels (NCCL's and XLA's own all-reduce / all-gather; they include "
           "waiting for the other devices); compute speedup = the same without them.", "",
           f"Command: `{result['command']}`", ""]
  for entry in result.get("rederived", [])[-1:]:
    changed = ", ".join(f"`{k['name']}` -> {'collective' if k['collective'] else 'compute'}"
                        for k in entry["reclassified"]) or "none"
    lines += [f"Re-derived {entry['date'][:10]} from `{entry['source']}` (`{entry['command']}`): kernels reclassified "
              f"by the current collective classifier (changed: {changed}), times per device and speedups "
              "recomputed; the measurements are the original run's.", ""]
  if result.get("cpu_warning"):
    lines += [f"**{result['cpu_warning']}**", ""]
  lines += ["| shape | M | N | K | mode | path per device | wall us, 1 dev | wall us, "
            f"{p} dev | wall speedup | kernel us, 1 dev | kernel us per dev (coll.) | kernel speedup | "
            "compute speedup | checks |",
            "|" + "---|" * 14]
  singles = {(r["shape"], r["m"]): r for r in result["rows"] if r["mode"] == "single" and not r["bias"]}
  for r in result["rows"]:
    if r["mode"] == "single" and not r["bias"]:
      continue  # its times are in the sharded rows' 1-device columns
    single = singles.get((r["shape"], r["m"]), {}) if r["timed"] else {}
    mode = r["mode"] + (" +bias (check only)" if r["bias"] else "")
    path = f"{r.get('quant_implementation', '?')}+{r.get('implementation', '?')}"
    kernel = "-"
    if "kernel_us_per_device" in r:
      kernel = f"{r['kernel_us_per_device']:.1f} ({r['collective_us_per_device']:.1f})"
    lines.append(
        f"| {r['shape']} | {r['m']} | {r['n']} | {r['k']} | {mode} | {path} | {_us(single.get('wall_us'))} | "
        f"{_us(r.get('wall_us'))} | {f'{r['speedup_wall']:.2f}x' if 'speedup_wall' in r else '-'} | "
        f"{_us(single.get('kernel_us_per_device'))} | {kernel} | "
        f"{f'{r['speedup_kernel']:.2f}x' if 'speedup_kernel' in r else '-'} | "
        f"{f'{r['speedup_compute']:.2f}x' if 'speedup_compute' in r else '-'} | {_checks_cell(r)} |")
  if result["skipped"]:
    lines += ["", "Skipped: " + "; ".join(f"{s['shape']} {s['parallel'] or ''} ({s['reason']})"
                                          for s in result["skipped"])]
  return "\n".join(lines) + "\n"


# ---- command line ------------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> dict:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(prog="python -m jaxfp8.tools.bench_tp", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None,
                      help="results JSON (a .md table goes beside it; default benchmarks/tp_h200.json)")
  parser.add_argument("--rerender", default=None, metavar="IN.json",
                      help="run nothing: re-derive the saved results IN.json with the current kernel classifier and "
                           "write them to --out (required) and its table")
  parser.add_argument("--devices", type=int, default=None, help="devices of the mesh (default: every local device)")
  parser.add_argument("--m", default=",".join(map(str, DEFAULT_MS)), help="comma-separated M (default %(default)s)")
  parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                      help="comma-separated shapes.json models or model.layer names (default %(default)s)")
  parser.add_argument("--shapes", default=None, help="'N,K;N,K' weight shapes instead of --models")
  parser.add_argument("--parallel", default="serving", choices=PARALLEL_CHOICES,
                      help="which layers run column- or row-parallel (default %(default)s; see the docstring)")
  parser.add_argument("--implementation", default=None, help="force the GEMM implementation (default: dispatch)")
  parser.add_argument("--iterations", type=int, default=None, help="timed calls per measurement (30 on GPU, 3 on CPU)")
  parser.add_argument("--time_budget_s", type=float, default=DEFAULT_TIME_BUDGET_S,
                      help="start no new case after this many seconds (0: no limit; default %(default)s)")
  parser.add_argument("--seed", type=int, default=None)
  args = parser.parse_args(argv)
  command = "python -m jaxfp8.tools.bench_tp " + " ".join(argv)
  if args.rerender:
    run_options = [f"--{name}" for name, value in vars(args).items()
                   if name not in ("out", "rerender") and value != parser.get_default(name)]
    if not args.out:
      parser.error("--rerender needs --out: where the re-derived JSON goes")
    if run_options:
      parser.error(f"--rerender runs nothing: {' '.join(run_options)} would have no effect")
    return rerender(args.rerender, args.out, command=command)
  args.out = args.out or "benchmarks/tp_h200.json"
  available = len(jax.local_devices())
  devices = available if args.devices is None else args.devices
  if available < 2 or not 2 <= devices <= available:
    parser.error(f"tensor parallelism needs at least 2 devices; this process sees {available} "
                 f"({jax.local_devices()[0].device_kind}) and --devices={args.devices}. On CPU simulate devices with "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=2")
  shape_list = bench.parse_shapes(args.shapes) if args.shapes else bench.model_shapes(args.models.split(","))
  return run(shape_list, [int(v) for v in args.m.split(",")], args.out, devices=devices, parallel=args.parallel,
             iterations=args.iterations, implementation=args.implementation, time_budget_s=args.time_budget_s or None,
             seed=args.seed, command=command)


if __name__ == "__main__":
  sys.exit(0 if main()["checks_passed"] else 1)
