"""Benchmark of the grouped (MoE expert) GEMM, all contenders in one process: `python -m jaxfp8 bench --ops=grouped`.

Each problem is E expert weights (N, K) in the block-FP8 layout and R routed rows (tokens x top-k) spread over the
experts: balanced (random top-k routing: a multinomial draw; the default) or skewed (one expert with half the rows,
every third expert empty; `--routing`). Contenders (names for --implementations), ragged and masked layouts:
  "mosaic", "xla":        ours, `ragged_w8a8_block_fp8_matmul` with that implementation (ragged layout).
  "masked_mosaic":        ours, `masked_w8a8_block_fp8_matmul` on the same rows laid out per expert (T = the largest
                          expert's rows rounded up to 64), at R <= MASKED_MAX_ROWS (decode).
  "masked_mosaic_live":   the same with zero_unowned_rows=False: each expert's rows past its count are not written
                          (what a caller that never reads them pays).
  "mosaic[f=v,...]", "masked_mosaic[f=v,...]":   an explicit kernel config (bench's --gemm_configs) on that layout.
  "ragged_dot_bf16":      BASELINE, `jax.lax.ragged_dot` on bf16 activations and bf16 weights (E, K, N).
  "pallas_ragged_bf16":   BASELINE, JAX's Hopper Pallas ragged dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu)
                          on the same bf16 operands, the fastest of PALLAS_CONFIGS (the config is in the row's note).
  "dense_same_rows":      REFERENCE POINT, our dense GEMM on R rows against one expert's weight: what raggedness
                          costs.
Every output is checked against the float64 reference on sampled rows of every expert that has rows (bf16 bound of
docs/CONTRACT.md §2) before it is timed; rows no expert owns must be 0. The floor of a problem is
max(2 R N K / 1979 TFLOP/s, (FP8 weights and scales of the experts that have rows + the rows' codes and scales in
+ the bf16 output) / 4.3 TB/s); x_floor = time / floor.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import gemm, grouped
from jaxfp8 import reference as ref
from jaxfp8.tools import bench_gemm, bench_report, timing

CONTENDERS = ("mosaic", "xla", "masked_mosaic", "masked_mosaic_live", "ragged_dot_bf16", "pallas_ragged_bf16",
              "dense_same_rows")
MASKED = ("masked_mosaic", "masked_mosaic_live")
ROLES = {"mosaic": "ours", "xla": "ours", "masked_mosaic": "ours", "masked_mosaic_live": "ours",
         "ragged_dot_bf16": "baseline", "pallas_ragged_bf16": "baseline", "dense_same_rows": "reference"}
ROUTINGS = ("balanced", "skewed")
HBM_BYTES_PER_S = bench_gemm.HBM_BYTES_PER_S
FP8_DENSE_TFLOPS = 1979.0
BF16_BOUND = bench_gemm.BF16_BOUND
MASKED_MAX_ROWS = 1024
# (name, E, N, K): the expert GEMMs of DeepSeek-V3 with its 256 experts split over 8 GPUs, Qwen3-30B-A3B (128
# experts on one) and Qwen3-235B-A22B under EP8 (16 local of 128 experts).
DEFAULT_SHAPES: tuple[tuple[str, int, int, int], ...] = (
    ("dsv3_ep8.gate_up", 32, 4096, 7168),
    ("dsv3_ep8.down", 32, 7168, 2048),
    ("qwen3_30b_a3b.gate_up", 128, 1536, 2048),
    ("qwen3_30b_a3b.down", 128, 2048, 768),
    ("qwen3_235b_a22b_ep8.gate_up", 16, 3072, 4096),
)
_EP8_ROWS = (8, 64, 256, 4096, 16384)
DEFAULT_ROWS = {"dsv3_ep8.gate_up": _EP8_ROWS, "dsv3_ep8.down": _EP8_ROWS,
                "qwen3_30b_a3b.gate_up": (8, 64, 512, 8192, 32768), "qwen3_30b_a3b.down": (8, 64, 512, 8192, 32768),
                "qwen3_235b_a22b_ep8.gate_up": _EP8_ROWS}
CPU_SHAPES = (("tiny.8x256x512", 8, 256, 512),)
CPU_ROWS = (16, 128)
# JAX's Pallas ragged dot: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n).
PALLAS_CONFIGS = tuple(itertools.product((64, 128), (128, 256), (64,), (4,), (1, 8)))


def floor_us(e_active: int, r: int, n: int, k: int, block_size=(128, 128)) -> tuple[float, int]:
  """(floor in us, its bytes): the math at the FP8 dense peak or the bytes at the copy bandwidth, the longer."""
  gn, gk = block_size
  groups = -(-k // gk)
  num_bytes = e_active * (n * k + -(-n // gn) * groups * 4) + r * (k + groups * 4) + r * n * 2
  return max(num_bytes / HBM_BYTES_PER_S, 2 * r * n * k / (FP8_DENSE_TFLOPS * 1e12)) * 1e6, num_bytes


def group_sizes(rng: np.random.Generator, rows: int, experts: int, routing: str) -> np.ndarray:
  """Rows per expert summing to `rows`."""
  if routing == "balanced":
    return rng.multinomial(rows, np.full(experts, 1.0 / experts))
  if routing == "skewed":
    weights = np.where(np.arange(experts) % 3 == 0, 0.0, 1.0)
    weights[1] = 0.0
    sizes = rng.multinomial(rows - rows // 2, weights / weights.sum())
    sizes[1] = rows // 2
    return sizes
  raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")


def make_problem(key, e: int, n: int, k: int, rows: int, block_size):
  """(a_q (R, K), b_q (E, N, K), a_s column-major (K/gk, round_up(R, 4)), b_s (E, ceil(N/gn), K/gk))."""
  gn, gk = block_size
  kw, ka = jax.random.split(key)
  n_blocks = -(-n // gn)  # each expert's rows quantized in whole blocks, the rows past N then cut
  b_q, b_s = bench_gemm.make_weight(kw, e * n_blocks * gn, k, block_size)
  a_q, a_s = bench_gemm.make_activation(ka, rows, k, gk)
  return a_q, b_q.reshape(e, n_blocks * gn, k)[:, :n], a_s, b_s.reshape(e, n_blocks, -1)


def masked_layout(a_q, a_s_col, sizes: np.ndarray, rows_per_expert: int):
  """The ragged rows laid out per expert: (E, T, K) codes and (E, K/gk, T) column-major scales, pad rows 0 / 1.0."""
  e = len(sizes)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  index = np.full((e, rows_per_expert), -1)
  for g in range(e):
    index[g, :sizes[g]] = starts[g] + np.arange(sizes[g])
  index = jnp.asarray(index)
  live = index >= 0
  codes = jnp.where(live[..., None], a_q[jnp.maximum(index, 0)], jnp.zeros((), a_q.dtype))
  scales = jnp.where(live[:, None, :], a_s_col[:, jnp.maximum(index, 0)].transpose(1, 0, 2), 1.0)
  return codes, scales


def dequantized_bf16(a_q, b_q, a_s_col, b_s, block_size):
  """bf16 operands of the bf16 baselines: activations (R, K), weights (E, K, N)."""
  gn, gk = block_size
  r = a_q.shape[0]
  a = (a_q.astype(jnp.float32) * jnp.repeat(a_s_col[:, :r].T, gk, axis=1)).astype(jnp.bfloat16)
  w = b_q.astype(jnp.float32) * jnp.repeat(jnp.repeat(b_s, gn, axis=1), gk, axis=2)
  return a, jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)


def contender(name: str, block_size, pallas_config=None, config=None) -> Callable:
  """The jitted contender `name` (a config contender 'mosaic[...]' with its kernel `config`): f(operands..., sizes)
  -> output."""
  base = name.split("[")[0]
  if base in ("mosaic", "xla"):
    f = functools.partial(grouped.ragged_w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True,
                          implementation=base, config=config, interpret=False)
    return jax.jit(lambda a_q, b_q, a_s, b_s, sizes: f(a_q, b_q, a_s, b_s, sizes))
  if base in MASKED:
    f = functools.partial(grouped.masked_w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True,
                          implementation="mosaic", config=config, interpret=False,
                          zero_unowned_rows=base == "masked_mosaic")
    return jax.jit(lambda a_q, b_q, a_s, b_s, sizes: f(a_q, b_q, a_s, b_s, sizes))
  if name == "ragged_dot_bf16":
    return jax.jit(lambda a, w, sizes: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32
                                                          ).astype(jnp.bfloat16))
  if name == "pallas_ragged_bf16":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    bm, bn, bk, steps, gbn = pallas_config
    return jax.jit(lambda a, w, sizes: ragged_dot_mgpu.ragged_dot(
        a, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn))
  if name == "dense_same_rows":
    f = functools.partial(gemm.w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True)
    return jax.jit(lambda a_q, b_q, a_s, b_s: f(a_q, b_q[0], a_s, b_s[0]))
  raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def _sample(sizes: np.ndarray, rng: np.random.Generator, per_expert: int = 2) -> list[tuple[int, np.ndarray]]:
  """(expert, rows) to check: up to `per_expert` rows of every expert that has rows."""
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  return [(g, starts[g] + rng.choice(sizes[g], min(per_expert, sizes[g]), replace=False))
          for g in range(len(sizes)) if sizes[g]]


def reference_rows(a_q, b_q, a_s_col, b_s, sample, block_size):
  """float64 reference of the sampled rows against their experts, on the first and last column blocks: one array
  per sample entry."""
  gn, _ = block_size
  n = b_q.shape[1]
  blocks = np.unique([0, -(-n // gn) - 1])
  cols = np.concatenate([np.arange(j * gn, min(n, (j + 1) * gn)) for j in blocks])
  out = []
  for g, rows in sample:
    out.append(ref.block_fp8_matmul(np.asarray(a_q)[rows], np.asarray(b_q[g])[cols], np.asarray(a_s_col)[:, rows].T,
                                  np.asarray(b_s[g])[blocks], block_size))
  return out, cols


def _error(out, sample, expected, cols, owned_rows: int) -> float:
  """The sampled rows' relative error; infinite when a row no expert owns is not 0."""
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  if out.shape[0] > owned_rows and np.asarray(out[owned_rows:]).any():
    return float("inf")
  got = np.concatenate([out[np.ix_(rows, cols)] for _, rows in sample])
  want = np.concatenate(expected)
  return ref.relative_error(got, want)


def _masked_error(out, sizes, sample, expected, cols, zeroed: bool = True) -> float:
  """`_error` of the masked layout's (E, T, N) output: back to the ragged row order; rows past an expert's count must
  be 0 (`zeroed`) or are not looked at."""
  flat = np.asarray(jnp.asarray(out).astype(jnp.float32))
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  ragged = np.zeros((int(sizes.sum()), flat.shape[-1]), np.float32)
  for g, count in enumerate(sizes):
    if zeroed and flat[g, count:].any():
      return float("inf")
    ragged[starts[g]:starts[g] + count] = flat[g, :count]
  return _error(ragged, sample, expected, cols, ragged.shape[0])


def run(shapes: Sequence[tuple[str, int, int, int]], rows_by_shape: dict[str, Sequence[int]],
        implementations: Sequence[str], *, routings: Sequence[str] = ("balanced",), block_size=(128, 128),
        iterations: int = 30, seed: int = 0, timer: Callable[..., float] | None = None,
        configs: dict | None = None, log=print) -> list[dict]:
  """Times every contender on every (shape, R, routing); checks each output on a sample first. Returns raw rows.
  `configs`: the kernel config of each config contender ('mosaic[...]') among `implementations`."""
  block_size = tuple(block_size)
  timer = timer or timing.median_kernel_us
  rng = np.random.default_rng(seed)
  key = jax.random.key(seed)
  configs = configs or {}
  fns = {name: contender(name, block_size, config=configs.get(name)) for name in implementations
         if name != "pallas_ragged_bf16"}
  rows_out: list[dict] = []
  for name, e, n, k in shapes:
    for r in rows_by_shape[name]:
      key, sub = jax.random.split(key)
      operands = make_problem(sub, e, n, k, r, block_size)
      bf16 = []  # the bf16 baselines' operands, made once per problem when one of them runs
      for routing in routings:
        sizes = group_sizes(rng, r, e, routing)
        active = int((sizes > 0).sum())
        floor, num_bytes = floor_us(active, r, n, k, block_size)
        sample = _sample(sizes, rng)
        expected, cols = reference_rows(*operands, sample, block_size)
        base = dict(shape=f"{name}/{routing}", groups=e, m=r, n=n, k=k, routing=routing, active_experts=active,
                    floor_us=floor, bytes=num_bytes, flops=2 * r * n * k)
        for impl in implementations:
          masked = impl.split("[")[0] in MASKED
          if masked and r > MASKED_MAX_ROWS:
            continue
          row = dict(base, contender=impl, layout="masked" if masked else "ragged")
          try:
            row.update(_measure(impl, fns.get(impl), operands, bf16, sizes, (sample, expected, cols), block_size,
                                iterations, timer))
            row.update(x_floor=row["us"] / floor)
          except Exception as ex:  # a failing contender is reported, not fatal for the others
            row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
          rows_out.append(row)
          log(format_row(row))
      del operands, bf16
  return rows_out


def _measure(impl: str, fn, operands, bf16: list, sizes: np.ndarray, check, block_size, iterations: int,
             timer) -> dict:
  """us, rel_err, within_bound (and a note) of one contender on one problem: its output checked, then timed."""
  sample, expected, cols = check
  a_q, b_q, a_s, b_s = operands
  r = a_q.shape[0]
  sizes_dev = jnp.asarray(sizes, jnp.int32)
  note = None
  impl = impl.split("[")[0]  # a config contender runs as its implementation
  if impl in ("mosaic", "xla"):
    args = (*operands, sizes_dev)
  elif impl in MASKED:
    codes, scales = masked_layout(a_q, a_s, sizes, -(-int(sizes.max()) // 64) * 64)
    args = (codes, b_q, scales, b_s, sizes_dev)
  elif impl == "dense_same_rows":
    args = operands
  else:
    if not bf16:
      bf16.extend(dequantized_bf16(*operands, block_size))
    args = (*bf16, sizes_dev)
  if impl == "pallas_ragged_bf16":
    config = _best_pallas(args, block_size, iterations, timer)
    fn, note = contender(impl, block_size, config), f"config {config} (the fastest of PALLAS_CONFIGS)"
  out = fn(*args)
  if impl in MASKED:
    err = _masked_error(out, sizes, sample, expected, cols, zeroed=impl == "masked_mosaic")
  elif impl == "dense_same_rows":
    dense_sample = [(0, rows) for _, rows in sample]
    dense_expected, _ = reference_rows(*operands, dense_sample, block_size)
    err = _error(out, dense_sample, dense_expected, cols, r)
    note = "every row against expert 0's weight"
  else:
    err = _error(out, sample, expected, cols, r)
  row = dict(us=timer(fn, [args], iterations=iterations), rel_err=err, bound=BF16_BOUND,
             within_bound=bool(err <= BF16_BOUND))
  return row if note is None else dict(row, note=note)


def _best_pallas(args, block_size, iterations, timer):
  """The fastest of PALLAS_CONFIGS that builds for these operands (each timed with a third of the iterations)."""
  best = None
  failures = []
  for config in PALLAS_CONFIGS:
    try:
      us = timer(contender("pallas_ragged_bf16", block_size, config), [args], iterations=max(5, iterations // 3))
    except Exception as ex:
      failures.append(f"{config}: {type(ex).__name__}")
      continue
    if best is None or us < best[0]:
      best = (us, config)
  if best is None:
    raise RuntimeError("no Pallas ragged-dot config ran: " + "; ".join(failures))
  return best[1]


def format_row(row: dict) -> str:
  head = f"{row['shape']:<34} {row['m']:>6} {row['n']:>6} {row['k']:>6} {row['contender']:<20}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  flag = "" if row["within_bound"] else "  <-- above bf16 bound"
  tflops = row["flops"] / (row["us"] * 1e-6) / 1e12
  return f"{head} {row['us']:10.2f} us {tflops:8.1f} TFLOP/s {row['x_floor']:7.2f}x floor {row['rel_err']:9.2e}{flag}"


def summary_table(rows: list[dict]) -> str:
  """One line per (expert shape, R): each contender's us (x the floor), the floor and the experts with rows."""
  present = list(dict.fromkeys(r["implementation"] for r in rows))
  names = [c for c in CONTENDERS if c in present] + [c for c in present if c not in CONTENDERS]
  by_key: dict = {}
  for r in rows:
    by_key.setdefault((r["shape"], r["m"]), {})[r["implementation"]] = r
  lines = ["Grouped GEMM: us (x the floor: max(FLOPs / 1979 TFLOP/s, bytes of the experts with rows and of the rows "
           "/ 4.3 TB/s)); masked_mosaic: the masked layout, the others ragged.", "",
           "| experts, N, K / routing | R | experts with rows | floor us | " + " | ".join(names) + " |",
           "|---|---|---|---|" + "---|" * len(names)]
  for (shape, m), cells in by_key.items():
    any_row = next(iter(cells.values()))
    lines.append(f"| {shape} (E={any_row['groups']}, N={any_row['n']}, K={any_row['k']}) | {m} | "
                 f"{any_row['active_experts']} | {any_row['floor_us']:.2f} | " +
                 " | ".join(bench_report.cell_us(cells.get(c), "x_floor") for c in names) + " |")
  return "\n".join(lines) + "\n"
