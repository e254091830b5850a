"""`python -m jaxfp8 tune` (GPU): time Triton GEMM configs per (weight shape, M bucket) and write the fastest into a
config table.

    python -m jaxfp8 tune --shapes="24576,7168;576,7168" --m=1,64,4096 --out=/tmp/triton_gemm_h200.json

Candidates come from a declared search space (SEARCH_SPACE: the values of each config axis, one space for decode,
M <= 64, one for prefill; each axis also takes the heuristic config's value): the product of the axes, without the
configs that cannot run (`config_problems`) or that launch like a nearer one (split counts that `split_k_steps` trims
alike), ordered by distance from the heuristic config (the number of steps along the axes' sorted values; the
heuristic first, ties in the order of the product). --max_configs keeps the nearest and the output says how many it
left out. The table's current entry for the key (the --out file's, else the shipped table's) is timed too, so that a
re-tune never swaps an entry for a slower one.

Every candidate is compiled, its output checked against the float64 reference on a sample (rows and whole column
blocks; bf16 output within 5e-3, docs/CONTRACT.md §2), then timed with CUPTI (`jaxfp8.tools.timing`, inputs rotated
when the weight would sit in L2). The fastest correct config of each (N, K, block_size, bucket) goes into the table
with its time and the heuristic's. The table is written after every entry, so a run cut short keeps what it
measured; entries already in the file for other keys are kept.

--out is required: the tuner writes nothing inside the package. The shipped table,
jaxfp8/gemm/configs/triton_gemm_h200.json, is a tuned table copied there by hand (tune into a copy of it to keep its
other entries).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxfp8 import _platform, gemm
from jaxfp8 import reference as ref
from pallas_kernels.gemm_triton import TritonGemmConfig, config_problems, pow2_ceil, split_k_steps
from jaxfp8.tools import args, bench_gemm, timing
from jaxfp8.tools import results as results_io

BF16_BOUND = 5e-3  # docs/CONTRACT.md §2: relative Frobenius error of a bf16 output
DECODE_MAX_M = 64
# The values each config axis takes, per regime. Decode streams the weight: narrow row tiles, the weight tile as the
# MMA's M side (swap_ab) or not, K split until the programs fill the SMs. Prefill is compute bound: wider tiles,
# grouped tile order for L2 reuse of the weight, split-K only where the tiles alone cannot fill the GPU.
SEARCH_SPACE: dict[str, dict[str, tuple]] = {
    "decode": {
        "block_m": (16, 32, 64),
        "block_n": (64, 128),
        "block_k": (128, 256),
        "group_m": (1, 8),
        "num_warps": (4, 8),
        "num_stages": (2, 3, 4, 5, 6),
        "split_k": (1, 2, 3, 4, 5, 6, 8, 12, 16),
        "swap_ab": (True, False),
    },
    "prefill": {
        "block_m": (64, 128, 256),
        "block_n": (64, 128, 256),
        "block_k": (128, 256),
        "group_m": (4, 8, 16),
        "num_warps": (4, 8),
        "num_stages": (2, 3, 4, 5),
        "split_k": (1, 2, 4),
        "swap_ab": (False,),
    },
}

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
args.define_shape_flags(FLAGS, __name__, shapes_default="DeepSeek-V3 and Qwen3-32B weights (bench_gemm.DEFAULT_SHAPES)",
                        m_default="every bucket of jaxfp8.gemm.triton.M_BUCKETS (M must be a bucket)")
flags.DEFINE_list("block_size", ["128", "128"], "Quantization block (gn, gk).", **_KW)
flags.DEFINE_integer("max_configs", 24, "Configs timed per (shape, M), the nearest to the heuristic (plus the "
                     "table's current entry); the output says how many of the search space are left out.",
                     lower_bound=1, **_KW)
flags.DEFINE_integer("iterations", 20, "Timed calls per config.", lower_bound=1, **_KW)
flags.DEFINE_float("time_budget_s", None, "Start no new (shape, M) after this many seconds.", lower_bound=0, **_KW)
flags.DEFINE_integer("seed", None, "Random seed of the inputs (default: fresh).", **_KW)
flags.DEFINE_string("out", None, "The table to write (required; entries already in it for other keys are kept).",
                    **_KW)
flags.mark_flag_as_required("out", flag_values=FLAGS)


# ---- the candidates --------------------------------------------------------------------------------------------------

def _buildable(fields: dict) -> TritonGemmConfig | None:
  """The config of `fields`, or None where it cannot build a kernel (it refuses itself)."""
  try:
    return TritonGemmConfig(**fields)
  except ValueError:
    return None


def search_space(m: int, heuristic: TritonGemmConfig) -> dict[str, tuple]:
  """The values of each axis for M: the regime's SEARCH_SPACE plus the heuristic's value, sorted. Decode row tiles
  stop at M rounded up to a power of two (at least 16): taller ones only compute zero rows."""
  regime = SEARCH_SPACE["decode" if m <= DECODE_MAX_M else "prefill"]
  space = {axis: tuple(sorted({*values, getattr(heuristic, axis)})) for axis, values in regime.items()}
  if m <= DECODE_MAX_M:
    space["block_m"] = tuple(v for v in space["block_m"] if v <= max(16, pow2_ceil(m)) or v == heuristic.block_m)
  return space


def candidate_space(m: int, n: int, k: int, block_size: tuple[int, int], *,
                    num_sms: int = 132) -> list[TritonGemmConfig]:
  """Every config of the search space that can run, one per launch, nearest to the heuristic first (see the module
  docstring); empty when no Triton config can serve `block_size`."""
  heuristic = gemm.triton.heuristic_config(m, n, k, block_size, num_sms=num_sms)
  if heuristic is None:
    return []
  space = search_space(m, heuristic)
  home = {axis: values.index(getattr(heuristic, axis)) for axis, values in space.items()}

  def distance(config: TritonGemmConfig) -> int:
    return sum(abs(values.index(getattr(config, axis)) - home[axis]) for axis, values in space.items())

  buildable = (config for values in itertools.product(*space.values())
               if (config := _buildable(dict(zip(space, values)))) is not None)
  configs = sorted(buildable, key=distance)
  seen, out = set(), []
  for config in configs:
    launched = dataclasses.replace(config, split_k=split_k_steps(k, config)[1])
    if launched not in seen and not config_problems(config, block_size):
      seen.add(launched)
      out.append(config)
  return out


def candidate_configs(m: int, n: int, k: int, block_size: tuple[int, int], *, max_configs: int = 24,
                      num_sms: int = 132) -> list[TritonGemmConfig]:
  """The `max_configs` nearest configs of `candidate_space`, the heuristic first."""
  return candidate_space(m, n, k, block_size, num_sms=num_sms)[:max_configs]


# ---- the table -------------------------------------------------------------------------------------------------------

def _load_or_new_table(path: str | None) -> dict:
  if path and os.path.exists(path):
    with open(path) as f:
      table = json.load(f)
    table.setdefault("entries", {})
    return table
  return {"device": None, "tuned": False, "entries": {}}


def _write_table(path: str, table: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(table, f, indent=1, sort_keys=False)
    f.write("\n")
  os.replace(tmp, path)


def _incumbent(entries, n: int, k: int, block_size: tuple[int, int], m: int) -> TritonGemmConfig | None:
  """The config of this key's entry in `entries`, else in the shipped table; None when neither has one."""
  key = gemm.triton.table_key(n, k, block_size, m)
  return gemm.triton.entry_config(entries.get(key) or gemm.triton.load_table().get("entries", {}).get(key),
                                   block_size)


def _short(config: TritonGemmConfig) -> str:
  return (f"{config.block_m}x{config.block_n}x{config.block_k} g{config.group_m} w{config.num_warps} "
          f"s{config.num_stages} split{config.split_k}{' swap' if config.swap_ab else ''}")


# ---- the sweep -------------------------------------------------------------------------------------------------------

def _time_candidates(candidates, arg_sets, sample, label: str, *, block_size, iterations: int, interpret: bool,
                     log) -> list[dict]:
  """Checks and times each candidate: [{config, us, err} or {config, error}]."""
  expected, sample_rows, cols = sample
  m, n, k = arg_sets[0][0].shape[0], arg_sets[0][1].shape[0], arg_sets[0][0].shape[1]
  outcomes = []
  for i, config in enumerate(candidates):
    fn = jax.jit(functools.partial(
        gemm.w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True, out_dtype=jnp.bfloat16,
        implementation="triton", config=config, interpret=interpret))
    line = f"[{label} {i + 1}/{len(candidates)}] {_short(config)}"
    try:
      out = np.asarray(jax.block_until_ready(fn(*arg_sets[0]))).astype(np.float32)
      err = ref.relative_error(out[np.ix_(sample_rows, cols)], expected)
      if not err <= BF16_BOUND:
        log(f"{line}: WRONG (rel err {err:.3g})")
        outcomes.append(dict(config=config, error=f"rel err {err:.3g}"))
        continue
      us = timing.median_kernel_us(fn, arg_sets, iterations=iterations)
      log(f"{line}: {us:9.2f} us  {2 * m * n * k / (us * 1e-6) / 1e12:7.1f} TFLOP/s  err {err:.2e}")
      outcomes.append(dict(config=config, us=us, err=err))
    except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
      log(f"{line}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
      outcomes.append(dict(config=config, error=f"{type(e).__name__}"))
  return outcomes


def _tune_entry(entries: dict, n: int, k: int, m: int, weights, key, *, block_size, max_configs: int, iterations: int,
                interpret: bool, num_sms: int, log) -> None:
  """Times the candidates of (N, K, M) and puts the fastest correct one into `entries`."""
  sets = len(weights)
  keys = jax.random.split(key, sets)
  acts = [bench_gemm.make_activation(keys[i], m, k, block_size[1]) for i in range(sets)]
  arg_sets = [(a_q, b_q, a_s, b_s) for (a_q, a_s), (b_q, b_s) in zip(acts, weights)]
  sample_rows, sample_blocks = results_io.sample_rows_and_blocks(m, n, block_size[0])
  expected, cols = bench_gemm.sample_reference(*arg_sets[0], block_size, sample_rows, sample_blocks)
  space = candidate_space(m, n, k, block_size, num_sms=num_sms)
  candidates, left_out = space[:max_configs], max(0, len(space) - max_configs)
  incumbent = _incumbent(entries, n, k, block_size, m)
  if incumbent is not None and incumbent not in candidates:
    candidates.insert(1, incumbent)
  log(f"N={n} K={k} M={m}: {min(len(space), max_configs)} of the {len(space)} configs of the search space"
      f"{' and the current entry' if incumbent is not None and incumbent not in space[:max_configs] else ''}"
      + (f"; {left_out} left out by max_configs={max_configs}" if left_out else ""))
  start = time.monotonic()
  outcomes = _time_candidates(candidates, arg_sets, (expected, sample_rows, cols), f"N={n} K={k} M={m}",
                              block_size=block_size, iterations=iterations, interpret=interpret, log=log)
  timed = [r for r in outcomes if "us" in r]
  if not timed:
    log(f"N={n} K={k} M={m}: no candidate ran correctly; no entry written")
    return
  best = min(timed, key=lambda r: r["us"])
  heuristic_us = next((r["us"] for r in timed if r["config"] == candidates[0]), None)
  incumbent_us = next((r["us"] for r in timed if r["config"] == incumbent), None)
  entries[gemm.triton.table_key(n, k, block_size, m)] = dict(
      config=best["config"].to_dict(), us=round(best["us"], 3),
      tflops=round(2 * m * n * k / (best["us"] * 1e-6) / 1e12, 1),
      heuristic_us=None if heuristic_us is None else round(heuristic_us, 3), candidates=len(candidates),
      search_space=len(space), left_out=left_out, failed=sum("error" in r for r in outcomes),
      date=datetime.date.today().isoformat())
  log(f"N={n} K={k} M={m}: best {_short(best['config'])} {best['us']:.2f} us"
      + (f" (heuristic {heuristic_us:.2f} us)" if heuristic_us else "")
      + (f" (previous entry {incumbent_us:.2f} us)" if incumbent_us else "")
      + f" [{len(candidates)} candidates in {time.monotonic() - start:.0f} s"
      + (f"; {left_out} of the search space left out]" if left_out else "]"))


def tune(
    shapes: Sequence[tuple[int, int]],
    m_buckets: Sequence[int],
    block_size: tuple[int, int] = (128, 128),
    out_path: str | None = None,
    *,
    max_configs: int = 24,
    iterations: int = 20,
    time_budget_s: float | None = None,
    interpret: bool = False,
    seed: int | None = None,
    log=print,
) -> dict:
  """Sweeps the candidates of every (N, K) in `shapes` and M in `m_buckets`; returns (and writes) the table."""
  block_size = tuple(int(v) for v in block_size)
  start = time.monotonic()
  table = _load_or_new_table(out_path)
  table.update(device=jax.devices()[0].device_kind, tuned=True, jax_version=jax.__version__,
               note="Measured by `python -m jaxfp8 tune`: CUPTI median kernel times, bf16 output, column-major "
                    "activation scales; heuristic_us times the heuristic config as it was when the entry was tuned.")
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  key = jax.random.key(seed)
  num_sms = _platform.num_sms()
  for n, k in shapes:
    sets = bench_gemm.rotation_sets(n * k, 0)
    key, *keys = jax.random.split(key, sets + 1)
    weights = [bench_gemm.make_weight(keys[i], n, k, block_size) for i in range(sets)]
    for m in m_buckets:
      if time_budget_s is not None and time.monotonic() - start > time_budget_s:
        log(f"time budget of {time_budget_s:.0f} s spent: stopping before N={n} K={k} M={m}")
        return table
      key, entry_key = jax.random.split(key)
      _tune_entry(table["entries"], n, k, int(m), weights, entry_key, block_size=block_size, max_configs=max_configs,
                  iterations=iterations, interpret=interpret, num_sms=num_sms, log=log)
      if out_path:  # after every entry: a run cut short keeps what it measured
        _write_table(out_path, table)
    del weights
  if out_path:
    log(f"wrote {out_path} ({len(table['entries'])} entries)")
  return table


# ---- command line ----------------------------------------------------------------------------------------------------

def main(command_line: str) -> int:
  """`python -m jaxfp8 tune` with this module's FLAGS."""
  del command_line
  shapes = args.selected_shapes(FLAGS) or [args.Shape(*s) for s in bench_gemm.DEFAULT_SHAPES]
  ms = args.parse_ms(FLAGS.m) if FLAGS.m else None
  shape_list, ms_by_shape = args.shapes_and_ms(shapes, ms)
  ms = ms or gemm.triton.M_BUCKETS
  not_buckets = sorted({m for values in [ms, *(ms_by_shape or {}).values()] for m in values
                        if gemm.triton.m_bucket(m) != m})
  if not_buckets:
    raise args.UsageError(f"--m: {not_buckets} are not buckets of the table; buckets: "
                          f"{','.join(map(str, gemm.triton.M_BUCKETS))}")
  if not _platform.has_fp8_gpu():
    raise args.CommandError(f"needs an NVIDIA GPU with FP8 (sm >= 8.9) to time the Triton kernels; this machine has "
                            f"{jax.devices()[0].device_kind}")
  # One sweep per list of Ms (shapes given as M,N,K bring their own), into the same table.
  groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
  for name, n, k in shape_list:
    groups.setdefault(tuple((ms_by_shape or {}).get(name, ms)), []).append((n, k))
  start = time.monotonic()
  for group_ms, group_shapes in groups.items():
    budget = None if FLAGS.time_budget_s is None else FLAGS.time_budget_s - (time.monotonic() - start)
    tune(list(dict.fromkeys(group_shapes)), group_ms, args.parse_ints(FLAGS.block_size, flag="--block_size", count=2),
         FLAGS.out, max_configs=FLAGS.max_configs, iterations=FLAGS.iterations, time_budget_s=budget, seed=FLAGS.seed)
  return 0
