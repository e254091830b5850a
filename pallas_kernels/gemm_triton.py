"""Block-scaled FP8 GEMM (docs/CONTRACT.md §2) as a Triton-lowered Pallas kernel, for any sm >= 8.9 GPU.

    C[m, n] = out( bias[n] + sum_g a_s[m, g] * b_s[n // gn, g] * sum_{k in group g} f32(a_q[m, k]) * f32(b_q[n, k]) )

One program computes a (block_m, block_n) tile of C (or, with split_k > 1, one K-slice of it into an f32 partial
buffer that the caller sums). The K loop steps block_k at a time; every step runs fp8 x fp8 dots with f32 results,
each dot no wider than one scale group (min(block_k, gk) columns of K, at most 128), and adds dot * a_s * b_s into an
f32 register accumulator. So the tensor cores' own low-precision FP8 accumulation never runs over more than 128
columns (docs/CONTRACT.md §2: promote at least every 128 K); inside a group the dot is `fp8_group_dot`, which for bf16/fp16
outputs lets Triton chain the wgmmas (plain `lax.dot_general` makes it add every 32-wide wgmma into f32 separately:
about 2x slower, and what float32 outputs still get, for precision).
Every relation of block_k to gk is handled the same way:
  * block_k < gk: several steps per group; the scale index k // gk only advances after a group's last step.
  * block_k == gk: one dot per step.
  * block_k > gk: block_k // gk dots per step, each with its own group's scale.
A partial last group of K uses its own scale column; K columns past the end load as zeros.
The scales stay off the loop's critical path: a program whose column tile lies in one gn block holds that block's
row of b_s in registers (loaded before the loop), and each step's a_s vectors are loaded one step ahead.

Pallas Triton (JAX 0.11.2) does not mask partial edge blocks, so the refs are whole arrays and every load and store
of a possibly partial tile is masked (masks are left out statically where a dimension divides evenly).
This file holds no policy: callers validate arguments (`check_config` says what a config can run) and pick configs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ._jax_compat import out_struct
from .triton_fp8_dot import fp8_group_dot

# Triton's tt.dot needs every dimension >= 16; an 8-bit MMA consumes K in steps of 32.
MIN_DOT_MN = 16
MIN_DOT_K = 32
# Hopper's FP8 MMAs accumulate with about 14 bits: a dot's partial sum goes into the f32 accumulator at least this often.
MAX_DOT_K = 128
# The most weight-scale groups whose row a program holds in registers through the K loop (8 per thread at 4 warps).
_MAX_HOISTED_GROUPS = 1024
# Shared memory one block may use on sm_90 (227 KiB); Triton keeps num_stages copies of the A and B tiles there.
MAX_SHARED_MEMORY_BYTES = 232448


@dataclasses.dataclass(frozen=True)
class TritonGemmConfig:
  """Tile shape and launch parameters of the Triton block-FP8 GEMM.

  block_m, block_n, block_k: tile of C and K step (powers of two). block_k must divide gk or be a multiple of it.
  group_m: how many row-tiles share a column sweep (L2 reuse of the weight); 1 = plain row-major tile order.
  num_warps, num_stages: Triton launch parameters (warps per program, software-pipelining depth of the K loop).
  split_k: number of K slices computed by separate programs into an f32 (split_k, M, N) buffer, summed afterwards;
    for decode shapes whose (M, N) tiles alone cannot fill the GPU.
  swap_ab: compute the transposed tile B @ A^T, so that the weight tile is the MMA's M side (>= 64 rows on Hopper's
    wgmma) and a small block_m (decode) is its N side, instead of a block_m-row MMA that pads or falls back.
  """
  block_m: int = 128
  block_n: int = 128
  block_k: int = 128
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3
  split_k: int = 1
  swap_ab: bool = False

  def __post_init__(self):
    if problems := _own_problems(self):
      raise ValueError(f"TritonGemmConfig cannot build a kernel: {'; '.join(problems)}")

  def to_dict(self) -> dict[str, int | bool]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "TritonGemmConfig":
    kwargs = {}
    for f in dataclasses.fields(cls):
      if f.name in d:
        kwargs[f.name] = bool(d[f.name]) if f.name == "swap_ab" else int(d[f.name])
    return cls(**kwargs)


def _is_power_of_two(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _own_problems(config: TritonGemmConfig) -> list[str]:
  """What makes a config unbuildable whatever the problem (its `__post_init__` refuses these)."""
  problems = []
  for name in ("block_m", "block_n", "block_k"):
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or not _is_power_of_two(value):
      problems.append(f"{name}={value!r} is not a power of two (Triton block shapes must be)")
  for name in ("group_m", "num_warps", "num_stages", "split_k"):
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      problems.append(f"{name}={value!r} must be a positive int")
  if not isinstance(config.swap_ab, bool):
    problems.append(f"swap_ab={config.swap_ab!r} must be a bool")
  if problems:
    return problems
  if not _is_power_of_two(config.num_warps):
    problems.append(f"num_warps={config.num_warps} is not a power of two")
  if config.block_m < MIN_DOT_MN or config.block_n < MIN_DOT_MN:
    problems.append(f"block_m={config.block_m}, block_n={config.block_n}: Triton dots need both >= {MIN_DOT_MN}")
  smem = config.num_stages * (config.block_m + config.block_n) * config.block_k  # the pipelined fp8 A and B tiles
  if smem > MAX_SHARED_MEMORY_BYTES:
    problems.append(
        f"num_stages={config.num_stages} x (block_m + block_n) x block_k = {smem} bytes of pipelined FP8 tiles, more "
        f"than the {MAX_SHARED_MEMORY_BYTES} bytes of shared memory a Hopper block can have: use fewer stages")
  return problems


def config_problems(config: TritonGemmConfig, block_size: tuple[int, int]) -> list[str]:
  """Why `config` (a valid one: it checked itself) cannot run with scale blocks `block_size = (gn, gk)`; empty when
  it can."""
  _, gk = block_size
  problems = []
  bk = config.block_k
  if bk % gk and gk % bk:
    problems.append(f"block_k={bk} is neither a divisor nor a multiple of the scale group gk={gk}")
  elif min(bk, gk) < MIN_DOT_K:
    problems.append(
        f"block_k={bk} with gk={gk} gives dots {min(bk, gk)} wide in K; 8-bit MMAs need at least {MIN_DOT_K}")
  elif min(bk, gk) > MAX_DOT_K:
    problems.append(
        f"block_k={bk} with gk={gk} gives dots {min(bk, gk)} wide in K; FP8 partial sums must be promoted into the "
        f"f32 accumulator at least every {MAX_DOT_K} K: use block_k <= {MAX_DOT_K}")
  elif bk > gk and not _is_power_of_two(gk):
    problems.append(f"block_k={bk} > gk={gk} needs a power-of-two gk (each group is its own Triton block)")
  return problems


def check_config(config: TritonGemmConfig, block_size: tuple[int, int]) -> None:
  if problems := config_problems(config, block_size):
    raise ValueError(f"config={config} cannot run with block_size={tuple(block_size)}: " + "; ".join(problems))


def pow2_ceil(x: int) -> int:
  """The least power of two >= x (1 for x <= 1): Triton block shapes must be powers of two."""
  return 1 << max(0, (x - 1).bit_length())


def _div(x, d: int):
  # Indices here are never negative: truncating division is floor division, without jnp's sign fix-ups.
  return lax.div(x, jnp.asarray(d, jnp.int32)) if isinstance(x, jax.Array) else x // d


def split_k_steps(k: int, config: TritonGemmConfig) -> tuple[int, int]:
  """(K steps per split, splits launched) for a reduction of length k: each split runs the same number of K steps,
  and a split count that would leave a split without work is trimmed (12 K steps asked of 5 splits run as 4 splits of 3)."""
  k_tiles = pl.cdiv(k, config.block_k)
  k_steps = pl.cdiv(k_tiles, max(1, min(config.split_k, k_tiles)))
  return k_steps, pl.cdiv(k_tiles, k_steps)


def _fma(x: jax.Array, y: jax.Array, z: jax.Array, interpret: bool) -> jax.Array:
  """x * y + z of f32 arrays of one shape, as one fused multiply-add per element on the GPU: Triton (through
  Pallas, JAX 0.11.2) emits the promotion `acc + part * scale` as an FMUL and an FADD (H200 SASS), twice
  the instructions of the FFMAs ptxas makes of the same step in the Mosaic kernel. One rounding instead of two."""
  if interpret:
    return x * y + z
  (out,) = plt.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[x, y, z], constraints="=r,r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return out


def _kernel(
    a_ref, b_ref, a_s_ref, b_s_ref, *rest,
    m: int, n: int, k: int, gn: int, gk: int, a_s_column_major: bool, has_bias: bool,
    config: TritonGemmConfig, k_steps: int, fast_accumulation: bool, interpret: bool,
):
  if has_bias:
    bias_ref, o_ref = rest
  else:
    bias_ref, (o_ref,) = None, rest
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  num_groups = pl.cdiv(k, gk)
  num_n_blocks = pl.cdiv(n, gn)

  # Grouped tile order: group_m row-tiles sweep the columns together, so the weight tiles they share stay in L2.
  pid = pl.program_id(0)
  num_pid_m, num_pid_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
  group_m = min(config.group_m, num_pid_m)
  pids_per_group = group_m * num_pid_n
  first_pid_m = _div(pid, pids_per_group) * group_m
  group_rows = jnp.minimum(num_pid_m - first_pid_m, group_m)
  pid_in_group = lax.rem(pid, pids_per_group)
  pid_m = first_pid_m + lax.rem(pid_in_group, group_rows)
  pid_n = _div(pid_in_group, group_rows)

  m0 = pid_m * bm
  n0 = pid_n * bn
  rows = m0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)
  cols = n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)
  # Masks are static Nones where the dimension divides evenly: unmasked loads vectorize best.
  row_ok = rows < m if m % bm else None
  col_ok = cols < n if n % bn else None
  split = pl.program_id(1) if config.split_k > 1 else 0
  first_step = split * k_steps
  k_masked = k % bk != 0 or pl.cdiv(k, bk) != k_steps * config.split_k

  dot_k = min(bk, gk)
  dots_per_step = bk // dot_k
  # When a column tile lies inside one gn block, its b_s is one number per group.
  b_s_uniform = gn % bn == 0
  if b_s_uniform:
    b_s_row = _div(n0, gn)
    # The tile's whole row of weight scales, loaded once before the K loop; each step picks its group's scale out of
    # registers instead of issuing a scalar global load whose latency the loop waits for (H200: M=64 N=10240
    # K=5120 24.0 vs 25.3 us, M=4096 N=24576 K=7168 1937 vs 2043 us). Rows of more groups than
    # _MAX_HOISTED_GROUPS (K over 128K columns at gk=128) keep the per-step load.
    groups_padded = pow2_ceil(num_groups)
    hoist_b_s = groups_padded <= _MAX_HOISTED_GROUPS
    if hoist_b_s:
      group_ids = lax.broadcasted_iota(jnp.int32, (groups_padded,), 0)
      # Indexed by a (clamped) vector, not a pl.ds slice: JAX 0.12 refuses a slice past the ref's end even where
      # the load is masked.
      in_row = group_ids < num_groups
      b_s_tile_row = plt.load(b_s_ref.at[b_s_row, jnp.where(in_row, group_ids, 0)], mask=in_row, other=0.0)
  else:
    b_s_rows = jnp.minimum(_div(cols, gn), num_n_blocks - 1)

  def and_masks(*masks):
    masks = [x for x in masks if x is not None]
    if not masks:
      return None
    out = masks[0]
    for x in masks[1:]:
      out = out & x
    return out

  def load(ref, mask):
    if mask is None:
      return ref[...]
    # `other` in the ref's own dtype: the Triton lowering cannot cast an int constant to fp8.
    return plt.load(ref, mask=mask, other=np.zeros((), ref.dtype))

  # A vector over the tile's rows of C (or its columns), broadcast against the accumulator's orientation.
  def along_m(v):
    return v[None, :] if config.swap_ab else v[:, None]

  def along_n(v):
    return v[:, None] if config.swap_ab else v[None, :]

  def group(i, j):
    """(first K column, scale group, group-in-K mask or None) of dot j of K step i."""
    k0 = (first_step + i) * bk + j * dot_k
    g = _div(k0, gk)
    return k0, g, (g < num_groups if k_masked else None)

  def activation_scales(i):
    """The a_s vectors of K step i's dots. A group past the end of K (only in the last step when block_k > gk) loads
    as 0: its tiles are 0. The index is clamped for the prefetch one step past a split's last step (never used)."""
    scales = []
    for j in range(dots_per_step):
      _, g, g_ok = group(i, j)
      g_idx = jnp.minimum(g, num_groups - 1)
      view = a_s_ref.at[g_idx, pl.ds(m0, bm)] if a_s_column_major else a_s_ref.at[pl.ds(m0, bm), g_idx]
      scales.append(load(view, and_masks(row_ok, g_ok)))
    return tuple(scales)

  def step(i, carry):
    # The activation scales were loaded one step ahead, so that their latency overlaps a step's dots instead of
    # stalling the step that multiplies by them.
    acc, a_scales = carry
    next_a_scales = activation_scales(i + 1)
    for j in range(dots_per_step):
      k0, g, g_ok = group(i, j)
      k_ok = (k0 + lax.broadcasted_iota(jnp.int32, (dot_k,), 0)) < k if k_masked else None
      g_idx = jnp.minimum(g, num_groups - 1) if k_masked else g
      a_mask = and_masks(
          None if row_ok is None else row_ok[:, None], None if k_ok is None else k_ok[None, :])
      b_mask = and_masks(
          None if col_ok is None else col_ok[:, None], None if k_ok is None else k_ok[None, :])
      a_tile = load(a_ref.at[pl.ds(m0, bm), pl.ds(k0, dot_k)], a_mask)
      b_tile = load(b_ref.at[pl.ds(n0, bn), pl.ds(k0, dot_k)], b_mask)
      if config.swap_ab:
        part = fp8_group_dot(b_tile, a_tile, fast_accumulation=fast_accumulation)  # (bn, bm)
      else:
        part = fp8_group_dot(a_tile, b_tile, fast_accumulation=fast_accumulation)  # (bm, bn)

      a_scale = a_scales[j]
      if b_s_uniform:
        if hoist_b_s:
          b_scale = jnp.sum(jnp.where(group_ids == g_idx, b_s_tile_row, 0.0))
        else:
          b_scale = b_s_ref[b_s_row, g_idx]
        if g_ok is not None:
          b_scale = jnp.where(g_ok, b_scale, 0.0)
        acc = _fma(part, jnp.broadcast_to(along_m(a_scale * b_scale), acc.shape), acc, interpret)
      else:
        b_scale = load(b_s_ref.at[b_s_rows, g_idx], and_masks(col_ok, g_ok))
        acc = _fma(part * along_m(a_scale), jnp.broadcast_to(along_n(b_scale), acc.shape), acc, interpret)
    return acc, next_a_scales

  acc_shape = (bn, bm) if config.swap_ab else (bm, bn)
  acc, _ = lax.fori_loop(0, k_steps, step, (jnp.zeros(acc_shape, jnp.float32), activation_scales(0)))
  if config.swap_ab:
    acc = acc.T

  out_mask = and_masks(
      None if row_ok is None else row_ok[:, None], None if col_ok is None else col_ok[None, :])
  if config.split_k > 1:
    out_view = o_ref.at[split, pl.ds(m0, bm), pl.ds(n0, bn)]
  else:
    out_view = o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)]
    if bias_ref is not None:
      acc = acc + load(bias_ref.at[pl.ds(n0, bn)], col_ok)[None, :]
  out = acc.astype(o_ref.dtype)
  if out_mask is None:
    out_view[...] = out
  else:
    plt.store(out_view, out, mask=out_mask)


def block_fp8_matmul(
    a_q: jax.Array, b_q: jax.Array, a_s: jax.Array, b_s: jax.Array, bias: jax.Array | None, *,
    block_size: tuple[int, int], a_s_column_major: bool, out_dtype, config: TritonGemmConfig, interpret: bool,
    out_rows: int | None = None,
) -> jax.Array:
  """Launches the kernel on validated arrays; returns C (M, N) in out_dtype.

  a_q (M, K) e4m3fn; b_q (N, K) e4m3fn; a_s (M, G) float32, or (G, M') with M' >= M when a_s_column_major;
  b_s (ceil(N/gn), G) float32 with G = ceil(K/gk); bias None or (N,) float32; `check_config(config, block_size)`
  must pass. out_rows: compute only the first out_rows rows (M is then out_rows; the later rows of a_q and a_s are
  never read). With config.split_k > 1 the kernel writes f32 partial sums that are reduced here by XLA.
  """
  k = a_q.shape[1]
  m = out_rows or a_q.shape[0]
  n = b_q.shape[0]
  gn, gk = block_size
  k_steps, split_k = split_k_steps(k, config)
  if split_k != config.split_k:
    config = dataclasses.replace(config, split_k=split_k)
  num_tiles = pl.cdiv(m, config.block_m) * pl.cdiv(n, config.block_n)

  kernel = functools.partial(
      _kernel, m=m, n=n, k=k, gn=gn, gk=gk, a_s_column_major=a_s_column_major,
      has_bias=bias is not None and split_k == 1, config=config, k_steps=k_steps, interpret=interpret,
      # bf16/fp16 results round far above the tensor cores' FP8 accumulation error; float32 results get the precise
      # (slower) per-MMA promotion so that they stay well inside the contract's 2e-4.
      fast_accumulation=jnp.dtype(out_dtype) != jnp.float32)
  operands = [a_q, b_q, a_s, b_s]
  if bias is not None and split_k == 1:
    operands.append(bias)
  if split_k == 1:
    grid = (num_tiles,)
    out_shape = out_struct((m, n), out_dtype, *operands)
  else:
    grid = (num_tiles, split_k)
    out_shape = out_struct((split_k, m, n), jnp.float32, *operands)
  out = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=f"block_fp8_matmul_{config.block_m}x{config.block_n}x{config.block_k}",
  )(*operands)
  if split_k == 1:
    return out
  acc = out.sum(axis=0)
  if bias is not None:
    acc = acc + bias[None, :]
  return acc.astype(out_dtype)
