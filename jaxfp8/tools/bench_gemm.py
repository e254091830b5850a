"""Benchmark of the block-scaled FP8 GEMM, all contenders in one process: `python -m jaxfp8 bench --ops=gemm`.

On a GPU the times are CUPTI kernel times; `run` takes another timer (bench's wall clock on CPU).

Contenders (names for `implementations`):
  "triton", "mosaic", "xla": `w8a8_block_fp8_matmul` with that implementation (the config table or heuristic).
                   "mosaic" reads the quantizer's row-padded buffers with out_rows=M where `gemm.mosaic.row_alignment`
                   pads (below 64 rows a whole decode tile; an M % 8 != 0 to a multiple of 8, the rows of a_q's
                   tiled TMA view), the way `jaxfp8.linear` calls it (the row's note says so).
  "dequant_bf16":  BASELINE, XLA dequantize-to-bf16 then dot: what JAX users do today.
  "fp8_per_tensor": BASELINE, XLA fp8 `dot_general` with per-tensor scales (cuBLASLt FP8): the library ceiling without
                   block scales. It computes a coarser quantization, so its output is not checked.
  "torch_scaled_mm": torch._scaled_mm with 1x128 activation / 128x128 weight blockwise scales (cuBLASLt), when torch
                   imports; needs M % 4 == 0 and block (128, 128).
  "mosaic[field=value,...]", "triton[...]": an explicit kernel config (`--gemm_configs`, `config_contender`), timed
                   beside the planner's own choice: how a developer tries a schedule. Fields are the config class's
                   (pallas_kernels.gemm_mosaic_common.MosaicGemmConfig, TritonGemmConfig); M and N name a Dim.

Every contender's output is first checked against the float64 reference (jaxfp8.reference.block_fp8_matmul) on a sample
of rows and whole column blocks; the row reports the relative error and whether it is within the bf16 bound of
docs/CONTRACT.md §2.
Inputs are fresh random data per run (quantized normal values, weight blocks with different scales); when a weight is
small enough to be served from the 60 MB L2, several copies of the inputs are rotated between calls.
For M <= 64 the row also reports the ratio to the weight-streaming floor, weight bytes / 4.3 TB/s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import gemm
from jaxfp8.tools import results as results_io, baselines, timing
from jaxfp8 import reference as ref

CONTENDERS = ("triton", "mosaic", "xla", "dequant_bf16", "fp8_per_tensor", "torch_scaled_mm")
ROLES = {"mosaic": "ours", "triton": "ours", "xla": "ours", "dequant_bf16": "baseline", "torch_scaled_mm": "baseline",
         "fp8_per_tensor": "ceiling"}
CONFIG_IMPLEMENTATIONS = ("mosaic", "triton")
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth of the H200 (benchmarks/README.md)
L2_BYTES = 60 << 20
# (name, N, K): DeepSeek-V3 and Qwen3-32B weights from shapes.json.
DEFAULT_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("dsv3.q_proj_no_lora", 24576, 7168),
    ("dsv3.fused_qkv_a_proj", 2112, 7168),
    ("dsv3.kv_a_proj_with_mqa", 576, 7168),
    ("dsv3.q_b_proj", 24576, 1536),
    ("dsv3.o_proj", 7168, 16384),
    ("dsv3.dense_down", 7168, 18432),
    ("qwen3_32b.qkv_proj", 10240, 5120),
    ("qwen3_32b.down_proj", 5120, 25600),
)
DEFAULT_MS = (1, 16, 64, 256, 1024, 4096)
BF16_BOUND = 5e-3  # docs/CONTRACT.md §2: relative Frobenius error of a bf16 output


# ---- inputs ------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("rows", "cols", "block"))
def _random_blockwise_fp8(key, *, rows: int, cols: int, block: tuple[int, int]):
  """Random (rows, cols) data quantized per (block) with scales amax/448, times a random factor per block so that
  blocks differ in magnitude. Returns (q e4m3fn, row-major scales float32). Not bit-exact to docs/CONTRACT.md §1 (not
  needed here)."""
  br, bc = block
  nr, nc = -(-rows // br), -(-cols // bc)
  k1, k2 = jax.random.split(key)
  factor = jnp.exp2(jax.random.uniform(k1, (nr, nc), minval=-3, maxval=3))
  x = jax.random.normal(k2, (nr * br, nc * bc), jnp.float32)
  x = x * jnp.repeat(jnp.repeat(factor, br, axis=0), bc, axis=1)
  amax = jnp.abs(x.reshape(nr, br, nc, bc)).max(axis=(1, 3))
  s = jnp.maximum(amax, 1e-10) * np.float32(1 / 448)
  q = jnp.clip(x / jnp.repeat(jnp.repeat(s, br, axis=0), bc, axis=1), -448, 448).astype(jnp.float8_e4m3fn)
  return q[:rows, :cols], s


def make_weight(key, n: int, k: int, block_size: tuple[int, int]):
  """(b_q (N, K), b_s (ceil(N/gn), ceil(K/gk)))."""
  return _random_blockwise_fp8(key, rows=n, cols=k, block=tuple(block_size))


def make_activation(key, m: int, k: int, gk: int):
  """(a_q (M, K), a_s column-major (ceil(K/gk), round_up(M, 4))): the quantizer's TMA-aligned layout, pad columns
  1.0."""
  a_q, a_s = _random_blockwise_fp8(key, rows=m, cols=k, block=(1, gk))
  m_pad = -(-m // 4) * 4
  a_s_col = jnp.ones((a_s.shape[1], m_pad), jnp.float32).at[:, :m].set(a_s.T)
  return a_q, a_s_col


def row_padded_buffers(a_q, b_q, a_s_col, b_s, rows: int):
  """The arguments with the activations as the quantizer's buffers padded to `rows` rows (its row_alignment): zero
  codes and scale 1.0 past M, which is what the Mosaic contender reads (with out_rows=M) where the GEMM's row
  alignment pads, as `jaxfp8.linear` hands them to it."""
  a_q = jnp.pad(a_q, ((0, rows - a_q.shape[0]), (0, 0)))
  a_s_col = jnp.pad(a_s_col, ((0, 0), (0, rows - a_s_col.shape[1])), constant_values=1.0)
  return a_q, b_q, a_s_col, b_s


def rotation_sets(weight_bytes: int, activation_bytes: int) -> int:
  """How many input copies to cycle through so that a call never finds its inputs in L2."""
  return max(1, min(64, math.ceil(3 * L2_BYTES / max(1, weight_bytes + activation_bytes))))


def sample_reference(a_q, b_q, a_s_col, b_s, block_size, rows: np.ndarray, col_blocks: np.ndarray):
  """float64 reference on a sample: the given rows, and whole gn-blocks of columns (in increasing order, so that the
  scale index n // gn of the sample matches the full problem's). Returns (reference, column indices)."""
  gn, _ = block_size
  n = b_q.shape[0]
  cols = np.concatenate([np.arange(j * gn, min(n, (j + 1) * gn)) for j in col_blocks])
  a_q_h = np.asarray(a_q)[rows]
  a_s_h = np.asarray(a_s_col)[:, rows].T
  b_q_h = np.asarray(b_q)[cols]
  b_s_h = np.asarray(b_s)[col_blocks]
  return ref.block_fp8_matmul(a_q_h, b_q_h, a_s_h, b_s_h, block_size), cols


# ---- contenders --------------------------------------------------------------------------------------------------

def config_contender(text: str) -> tuple[str, object]:
  """'mosaic:tile_m=128,tile_n=256,wg_split=N' (an item of --gemm_configs) -> ('mosaic[tile_m=128,...]', the config):
  the contender's name and its kernel config, built (and so checked) by the config class. ValueError names what is
  wrong."""
  implementation, _, fields = (part.strip() for part in text.partition(":"))
  if implementation not in CONFIG_IMPLEMENTATIONS + ("masked_mosaic",):
    raise ValueError(f"{text!r}: starts with one of {', '.join(CONFIG_IMPLEMENTATIONS)}, masked_mosaic (the grouped "
                     "op's masked layout) and ':'")
  # the grouped Mosaic kernels take the dense Mosaic kernel's config class
  cls = gemm.planner.BACKENDS[implementation.removeprefix("masked_")].config_class()
  known = {f.name for f in dataclasses.fields(cls)}
  kwargs, given = {}, []
  for item in (f.strip() for f in fields.split(",") if f.strip()):
    name, equals, value = (part.strip() for part in item.partition("="))
    if not equals or name not in known:
      raise ValueError(f"{text!r}: {item!r} is not field=value with a field of {cls.__name__} "
                       f"({', '.join(sorted(known))})")
    kwargs[name] = _config_value(value, cls)
    given.append(f"{name}={value}")
  try:
    config = cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{text!r}: {e}") from None
  return f"{implementation}[{','.join(given)}]", config


def _config_value(text: str, cls):
  """A config field's value: an integer, true/false, none, or (Mosaic) a Dim name, M or N."""
  if text.lstrip("-").isdigit():
    return int(text)
  if text.lower() in ("true", "false", "none"):
    return {"true": True, "false": False, "none": None}[text.lower()]
  dim = getattr(__import__(cls.__module__, fromlist=["Dim"]), "Dim", None)
  if dim is not None and text.upper() in dim.__members__:
    return dim[text.upper()]
  raise ValueError(f"{text!r} is not an integer, true, false, none or a Dim (M, N)")


def jax_contender(name: str, block_size: tuple[int, int], out_rows: int | None = None, config=None) -> Callable:
  """The jitted JAX contender `name` as the benchmark times it: f(a_q, b_q, a_s_col, b_s) -> (M, N) bf16; a config
  contender ('mosaic[tile_n=256]', `config_contender`) runs its implementation with `config`."""
  implementation = name.split("[")[0]
  if implementation in ("triton", "mosaic", "xla"):
    f = functools.partial(gemm.w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True,
                          out_dtype=jnp.bfloat16, implementation=implementation, config=config, interpret=False,
                          out_rows=out_rows)
    return jax.jit(lambda a_q, b_q, a_s, b_s: f(a_q, b_q, a_s, b_s))
  if name == "dequant_bf16":
    return jax.jit(lambda a_q, b_q, a_s, b_s: baselines.dequant_bf16_matmul_baseline(
        a_q, b_q, a_s, b_s, block_size=block_size, a_s_column_major=True, out_dtype=jnp.bfloat16))
  if name == "fp8_per_tensor":
    one = jnp.float32(1.0)
    return jax.jit(lambda a_q, b_q, a_s, b_s: baselines.per_tensor_fp8_matmul_baseline(
        a_q, b_q, one, one, out_dtype=jnp.bfloat16))
  raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


class _TorchScaledMM:
  """torch._scaled_mm with blockwise scales: a 1x128 (scale_a (M, K/128), M-major) x b 128x128.

  The scale_b layout torch expects has changed between releases ((K/128, N/128) K-major, or padded to a multiple of 4
  K-blocks); the candidates are tried in order and the first whose output matches the reference is used.
  """

  def __init__(self):
    import torch  # noqa: F401  (ImportError means: not available)
    self.torch = torch
    self.layout = None

  def to_torch(self, a_q, b_q, a_s_col, b_s):
    torch = self.torch
    m = a_q.shape[0]

    def fp8(x):
      return torch.from_numpy(np.asarray(x).view(np.uint8)).cuda().view(torch.float8_e4m3fn)

    a = fp8(a_q)
    b = fp8(b_q).t()  # (K, N), column-major: cuBLASLt's "TN" layout
    scale_a = torch.from_numpy(np.ascontiguousarray(np.asarray(a_s_col)[:, :m])).cuda().t()  # (M, K/128), stride (1, M)
    b_s_t = torch.from_numpy(np.asarray(b_s)).cuda()  # (N/128, K/128)
    return a, b, scale_a, b_s_t

  def scale_b_candidates(self, b_s_t):
    torch = self.torch
    groups = b_s_t.shape[1]
    padded = torch.nn.functional.pad(b_s_t, (0, (-groups) % 4)) if groups % 4 else b_s_t
    return {"(K/128, N/128) K-major": b_s_t.t(), "(L4, N/128) K-major, padded": padded.t(),
            "(N/128, K/128)": b_s_t}

  def call(self, layout, a, b, scale_a, b_s_t):
    scale_b = self.scale_b_candidates(b_s_t)[layout]
    return self.torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=self.torch.bfloat16)


# ---- the run -----------------------------------------------------------------------------------------------------

def run(
    shapes: Sequence[tuple[str, int, int]] = DEFAULT_SHAPES,
    ms: Sequence[int] = DEFAULT_MS,
    implementations: Sequence[str] = CONTENDERS,
    out_json: str | None = None,
    *,
    block_size: tuple[int, int] = (128, 128),
    iterations: int = 30,
    seed: int | None = None,
    log=print,
    timer: Callable[..., float] | None = None,
    timing_label: str | None = None,
    configs: Mapping[str, object] | None = None,
) -> dict:
  """Times every contender on every (shape, M); checks each output on a sample first. Returns (and writes) the
  results. `configs`: the kernel config of each config contender (`config_contender`) among `implementations`."""
  configs = dict(configs or {})
  block_size = tuple(block_size)
  timer = timer or timing.median_kernel_us
  seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
  key = jax.random.key(seed)
  torch_mm = None
  if "torch_scaled_mm" in implementations:
    try:
      torch_mm = _TorchScaledMM()
    except ImportError:
      log("torch is not importable: torch_scaled_mm skipped")
  jax_fns = {name: jax_contender(name, block_size, config=configs.get(name)) for name in implementations
             if name != "torch_scaled_mm"}
  rows_out = []
  log(f"{'shape':<26} {'M':>5} {'N':>6} {'K':>6} {'contender':<16} {'us':>10} {'TFLOP/s':>8} {'x floor':>8} "
      f"{'rel err':>9}")
  for shape_name, n, k in shapes:
    weight_bytes = n * k
    sets = rotation_sets(weight_bytes, 0)
    key, *keys = jax.random.split(key, sets + 1)
    weights = [make_weight(keys[i], n, k, block_size) for i in range(sets)]
    for m in ms:
      key, *keys = jax.random.split(key, sets + 1)
      acts = [make_activation(keys[i], m, k, block_size[1]) for i in range(sets)]
      arg_sets = [(a_q, b_q, a_s, b_s) for (a_q, a_s), (b_q, b_s) in zip(acts, weights)]
      sample_rows, sample_blocks = results_io.sample_rows_and_blocks(m, n, block_size[0])
      expected, cols = sample_reference(*arg_sets[0], block_size, sample_rows, sample_blocks)
      base = dict(shape=shape_name, m=m, n=n, k=k, block_size=list(block_size), rotation_sets=sets,
                  weight_floor_us=n * k / HBM_BYTES_PER_S * 1e6)
      record = _recorder(base, rows_out, log)
      for name in implementations:
        if name == "torch_scaled_mm":
          if torch_mm is not None:
            _run_torch(torch_mm, arg_sets, m, block_size, expected, sample_rows, cols, iterations, record, timer)
        else:
          _time_jax(name, jax_fns[name], arg_sets, block_size, (expected, sample_rows, cols), iterations, record,
                    timer, configs.get(name))
      del arg_sets, acts
    del weights
  result = dict(
      benchmark="w8a8 block FP8 GEMM, bf16 output, column-major activation scales",
      **results_io.run_metadata(), seed=seed,
      timing=timing_label or f"CUPTI kernel time (all kernels of a call), median of {iterations} calls",
      weight_floor=f"N*K bytes / {HBM_BYTES_PER_S / 1e12} TB/s", rows=rows_out)
  results_io.write_results(result, out_json, markdown_table)
  return result


def _recorder(base: dict, rows_out: list[dict], log) -> Callable[..., None]:
  """record(contender, us=, err=, error=, note=): appends the contender's row for the problem `base` describes."""
  m, flops = base["m"], 2 * base["m"] * base["n"] * base["k"]

  def record(name, us=None, err=None, error=None, note=None):
    row = dict(base, contender=name)
    if error is not None:
      row["error"] = error
    else:
      row.update(us=us, tflops=flops / (us * 1e-6) / 1e12)
      if m <= 64:
        row["x_weight_floor"] = us / base["weight_floor_us"]
    if err is not None:
      row["rel_err"] = err
      row["within_bf16_bound"] = bool(err <= BF16_BOUND)
    if note:
      row["note"] = note
    rows_out.append(row)
    log(format_row(row))

  return record


def _time_jax(name: str, fn: Callable, arg_sets: list[tuple], block_size, sample, iterations: int, record,
              timer, config=None) -> None:
  """Checks the JAX contender `name` on the sample (expected, rows, cols), times it, records its row."""
  expected, sample_rows, cols = sample
  m = arg_sets[0][0].shape[0]
  note = None
  align = gemm.mosaic.row_alignment(m)[0] if name.split("[")[0] == "mosaic" else 1
  if align > 1:
    rows = -(-m // align) * align
    fn = jax_contender(name, block_size, out_rows=m, config=config)
    arg_sets = [row_padded_buffers(*arg_set, rows=rows) for arg_set in arg_sets]
    note = f"the quantizer's {rows}-row buffers (row_alignment={align}), out_rows=M (as jaxfp8.linear calls it)"
  try:
    out = np.asarray(jax.block_until_ready(fn(*arg_sets[0]))).astype(np.float32)
    err = None if name == "fp8_per_tensor" else ref.relative_error(out[np.ix_(sample_rows, cols)], expected)
    us = timer(fn, arg_sets, iterations=iterations)
    if err is None:
      note = "speed reference only (per-tensor scales)"
    record(name, us=us, err=err, note=note)
  except Exception as e:  # a failing contender is reported, not fatal for the others
    record(name, error=f"{type(e).__name__}: {str(e)[:300]}")


def _run_torch(torch_mm, arg_sets, m, block_size, expected, sample_rows, cols, iterations, record, timer):
  name = "torch_scaled_mm"
  if tuple(block_size) != (128, 128):
    record(name, error="needs block_size (128, 128)")
    return
  if m % 4:
    record(name, error=f"needs M % 4 == 0 (M={m})")
    return
  torch = torch_mm.torch
  try:
    torch_sets = [torch_mm.to_torch(*args) for args in arg_sets]
    layouts = [torch_mm.layout] if torch_mm.layout else list(torch_mm.scale_b_candidates(torch_sets[0][3]))
    tried = []
    for layout in layouts:
      try:
        out = torch_mm.call(layout, *torch_sets[0]).float().cpu().numpy()
      except Exception as e:
        tried.append(f"{layout}: {type(e).__name__}: {str(e)[:120]}")
        continue
      err = ref.relative_error(out[np.ix_(sample_rows, cols)], expected)
      if err <= BF16_BOUND:
        torch_mm.layout = layout
        break
      tried.append(f"{layout}: rel err {err:.3g}")
    else:
      record(name, error="no scale_b layout matched the reference: " + "; ".join(tried))
      return
    us = timer(lambda *args: torch_mm.call(torch_mm.layout, *args), torch_sets,
                                 iterations=iterations, sync=lambda _: torch.cuda.synchronize())
    record(name, us=us, err=err, note=f"scale_b {torch_mm.layout}")
  except Exception as e:
    record(name, error=f"{type(e).__name__}: {str(e)[:300]}")


def format_row(row: dict) -> str:
  head = f"{row['shape']:<26} {row['m']:>5} {row['n']:>6} {row['k']:>6} {row['contender']:<16}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  floor = f"{row['x_weight_floor']:8.2f}" if "x_weight_floor" in row else f"{'':>8}"
  err = f"{row['rel_err']:9.2e}" if "rel_err" in row else f"{'n/a':>9}"
  flag = "" if row.get("within_bf16_bound", True) else "  <-- above bf16 bound"
  return f"{head} {row['us']:10.2f} {row['tflops']:8.1f} {floor} {err}{flag}"


def markdown_table(result: dict) -> str:
  """One line per (shape, M), one column per contender: us (TFLOP/s, or x weight floor for M <= 64)."""
  seen = dict.fromkeys(r["contender"] for r in result["rows"])
  contenders = [c for c in CONTENDERS if c in seen] + [c for c in seen if c not in CONTENDERS]
  lines = [f"Block FP8 GEMM, {result['device']}, jax {result['jax_version']}, {result['date'][:10]}; "
           f"{result['timing']}; bf16 output. Cells: us (TFLOP/s; for M <= 64: x of the weight-streaming floor "
           f"{result['weight_floor']}).", "",
           "| shape | M | N | K | " + " | ".join(contenders) + " |",
           "|---|---|---|---|" + "---|" * len(contenders)]
  by_key: dict = {}
  for r in result["rows"]:
    by_key.setdefault((r["shape"], r["m"], r["n"], r["k"]), {})[r["contender"]] = r
  for (shape, m, n, k), cells in by_key.items():
    texts = []
    for c in contenders:
      r = cells.get(c)
      if r is None:
        texts.append("-")
      elif "error" in r:
        texts.append("n/a" if "needs" in r["error"] else "error")
      else:
        extra = f"{r['x_weight_floor']:.2f}x" if "x_weight_floor" in r else f"{r['tflops']:.0f} TF"
        bad = "" if r.get("within_bf16_bound", True) else " (WRONG)"
        texts.append(f"{r['us']:.1f} ({extra}){bad}")
    lines.append(f"| {shape} | {m} | {n} | {k} | " + " | ".join(texts) + " |")
  return "\n".join(lines) + "\n"
