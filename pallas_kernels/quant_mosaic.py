"""Per-token-group FP8 quantization (docs/CONTRACT.md §1) as a Mosaic GPU kernel for Hopper.

One CTA (one warpgroup, 128 threads) owns `block_rows` rows of one batch entry and walks over `blocks_per_cta` blocks
of `groups_per_block` groups along K. Each block is read by TMA from the input viewed as (E, T, K_in/G, G) into shared
memory (a `num_stages`-deep ring of buffers when a CTA walks over several blocks), then loaded into registers in a
layout where each group sits in up to 8 adjacent lanes of one warp, 16 bytes per vector, so that the group's absolute
maximum is a max within each thread and then a few warp shuffles. The fp8 codes go back to shared memory and out by
TMA into the (E, T_pad, K/G, G) view of q; the scales are stored straight from registers into their final layout
(row-major, column-major, or UE8M0 bytes packed four groups to an int32 word: then the block is processed four groups
at a time, and a word is a sum over an axis of 4). Written with Lane lowering semantics: every register layout is
explicit.

Edges: TMA loads zero-fill reads past the end of the input (per dimension), so rows >= T and groups past K/G cost
nothing on the way in. Stores get no such guard: Mosaic GPU lowers a store whose box is contiguous in memory (whole
rows of q, or a single row) to a linear bulk copy that is clipped only at the end of the whole array, so a box
sticking out past the last row of an expert (or the last group of a row) would overwrite the next expert's (row's)
first codes. Scales are stored from registers, with no guard at all. So no block sticks out of what it writes: row
blocks [0, num_q_row_blocks) tile q's rows, the last one shifted back to end at out_rows; further blocks tile the
scale-only rows [out_rows, scale_rows) (scale_cols > out_rows), the last one shifted back to end at scale_rows, and
store no q. The last group block is shifted back to end at K/G ("col_packed": at 4 * words, past K/G; a one-row
block's q store then leaves out the groups past K/G, a taller block's box is not contiguous and goes out by a tiled
TMA store, which clips it per dimension). Shifted blocks overlap their neighbour; overlapping CTAs write bit-identical
values, so the overlap is harmless. Pad rows (t >= valid_rows[e], and t >= T) are zeroed on the way in, and get q = 0
and scale 1.0.

Gathered rows (`source`, the MoE layer's quantize-and-permute): output row r is input row source[r] // divisor, so a
permute after the quantizer is not needed. Each row of a block is then its own TMA load (all on the block's one
barrier), a row of a block must be whole 128-byte TMA units, and valid_rows counts output rows: rows from the count on
read input row 0 and are pad rows as above.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu
from . import exact_division
from ._jax_compat import interpret_mode_forced, store_to_gmem, store_unoptimized

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
# float32(1/448) (0x3B124925): scales are amax * R, a multiply that rounds the same way everywhere.
R = np.float32(1.0 / 448.0)
SCALE_LAYOUTS = ("row", "col", "col_packed")
_WARPS = 4
_WARP_SIZE = 32
_TMA_MAX_BOX = 256  # a TMA box has at most 256 elements along every dimension
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
_MAX_GROUP_LANES = 8
# On the GPU, f32 -> e4m3 is `cvt.rn.satfinite.e4m3x2.f32`, which already maps |v| > 448 and +-inf to +-448 and
# NaN to NaN: exactly e4m3(clip(v, -448, 448)). The explicit clip (two instructions per element) is then only
# needed in interpret mode, where the cast is XLA's, which turns values above 464 into NaN.
_SATFINITE_CAST = True
_TARGET_BLOCK_BYTES = 16 * 1024
# Shared memory a CTA may use on sm_90 (227 KiB), less room for barriers and Mosaic's own scratch.
_SMEM_BUDGET = 227 * 1024 - 2048
_SMEM_ALIGNMENT = 1024
_TMA_LOAD_QUANTUM = 128  # bytes: Mosaic GPU (Lane semantics) splits a load's expect-tx over the 128 threads


@dataclasses.dataclass(frozen=True)
class QuantMosaicConfig:
  """Tunables. Blocks are clamped to the problem (a block never exceeds the scale array).

  block_rows: rows per CTA (<= 256).
  groups_per_block: groups per TMA block (<= 256; a multiple of 4 is used for "col_packed").
  blocks_per_cta: group blocks one CTA processes in sequence (1 = one block per CTA, latency hidden
    by several CTAs per SM; more = a software pipeline inside the CTA, fewer and longer CTAs).
  num_stages: depth of the TMA input ring when blocks_per_cta > 1.
  """

  block_rows: int = 16
  groups_per_block: int = 4
  blocks_per_cta: int = 1
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_rows", "groups_per_block", "blocks_per_cta", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"QuantMosaicConfig.{name} must be a positive int, got {value!r}")
    if self.block_rows > _TMA_MAX_BOX or self.groups_per_block > _TMA_MAX_BOX:
      raise ValueError(f"block_rows and groups_per_block must be <= {_TMA_MAX_BOX}, got {self}")


def _pow2_floor(n: int) -> int:
  return 1 << (n.bit_length() - 1)


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _thread_layout(outer: tuple[int, ...], group_size: int, vec: int, warp_ok: tuple[bool, ...]):
  """A TiledLayout for an array (*outer, G) where each group sits in adjacent lanes of one warp.

  A group's G values are split into vectors of `vec` elements (16 bytes), spread over the largest
  power of two of lanes that divides their count, at most 8: 8 lanes read 128 contiguous bytes
  (all 32 banks, no conflict), and a thread holding 2+ vectors of a group starts its max with
  packed bf16x2/f16x2 instructions instead of shuffles. A thread holds the rest of the group as
  registers (3 vectors for G = 48 or 96). The other lanes go to the outer dims from minor to
  major, the 4 warps from major to minor (only to dims with warp_ok); what cannot be split evenly
  is replicated.
  """
  vectors = group_size // vec
  group_lanes = math.gcd(vectors, _MAX_GROUP_LANES)
  lanes_left = _WARP_SIZE // group_lanes
  n = len(outer)
  lanes = [1] * n
  warps = [1] * n
  for i in reversed(range(n)):
    lanes[i] = math.gcd(lanes_left, outer[i])
    lanes_left //= lanes[i]
  warps_left = _WARPS
  for i in range(n):
    if warp_ok[i]:
      warps[i] = math.gcd(warps_left, outer[i] // lanes[i])
      warps_left //= warps[i]
  tile = tuple(w * l for w, l in zip(warps, lanes))
  tiling = mgpu_fa.Tiling((tile + (group_size,), tuple(lanes) + (group_lanes * vec,), (vec,)))
  # Shape suffix after tiling: (warps_0..warps_{n-1}, G/(group_lanes*vec), lanes_0..lanes_{n-1}, group_lanes, vec).
  suffix = 2 * n + 3
  warp_dims = [i - suffix for i in range(n) if warps[i] > 1]
  lane_dims = [(n + 1 + i) - suffix for i in range(n) if lanes[i] > 1] + [-2]
  if warps_left > 1:
    warp_dims = [mgpu_fa.Replicated(warps_left)] + warp_dims
  if lanes_left > 1:
    lane_dims = [mgpu_fa.Replicated(lanes_left)] + lane_dims
  layout = mgpu_fa.TiledLayout(
      tiling, tuple(warp_dims), tuple(lane_dims), vector_dim=-1, _check_canonical=False
  )
  return layout.canonicalize()


def _as_plgpu(layout: mgpu_fa.TiledLayout):
  return plgpu.Layout.TILED(
      layout.tiling, warp_dims=layout.warp_dims, lane_dims=layout.lane_dims, vector_dim=layout.vector_dim
  )


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static shape decisions for one call."""

  experts: int
  rows_in: int  # T
  rows_out: int  # T_pad
  scale_rows: int  # extent of the scale array along rows: T_pad ("row") or scale_cols
  groups: int  # K / G
  group_size: int
  block_rows: int
  groups_per_block: int
  group_extent: int  # groups covered by group blocks: K/G, or 4 * words for "col_packed"
  num_q_row_blocks: int  # row blocks over q's rows; the rest cover scale-only rows and store no q
  num_row_blocks: int
  num_group_blocks: int
  blocks_per_cta: int
  num_splits: int
  load_rows: int  # rows of an input TMA load: block_rows, more for blocks under 128 bytes
  gather: bool  # each row its own load from the row `source` names
  live_limit: int  # valid_rows is clipped to [0, live_limit]: T, or out_rows when gathering
  num_stages: int
  num_q_buffers: int
  vec: int


def _make_plan(x_shape, dtype, *, group_size, out_rows, scale_layout, scale_cols, fuse, config,
               gather: bool = False) -> _Plan:
  experts, rows_in, k_in = x_shape
  k = k_in // 2 if fuse else k_in
  groups = k // group_size
  scale_rows = out_rows if scale_layout == "row" else scale_cols
  if scale_layout == "col_packed":
    group_extent = 4 * _ceil_div(groups, 4)
    gpb = max(4, _pow2_floor(min(config.groups_per_block, group_extent)) // 4 * 4)
  else:
    group_extent = groups
    gpb = _pow2_floor(min(config.groups_per_block, group_extent))
  # A q store must not stick out of q (see the module docstring): blocks are no taller than q.
  block_rows = _pow2_floor(min(config.block_rows, out_rows if out_rows > 0 else scale_rows))
  num_q_row_blocks = _ceil_div(out_rows, block_rows)
  num_group_blocks = _ceil_div(group_extent, gpb)
  blocks_per_cta = min(config.blocks_per_cta, num_group_blocks)
  itemsize = jnp.dtype(dtype).itemsize
  vec = 16 // itemsize  # 16-byte vectors
  # Mosaic GPU's TMA loads must move a multiple of 128 bytes (one expect-tx share per thread of the warpgroup).
  # A smaller block (a few rows of a few small groups) loads extra rows it does not use (zeros past the input).
  block_bytes = block_rows * gpb * group_size * itemsize
  load_rows = block_rows * (_TMA_LOAD_QUANTUM // math.gcd(_TMA_LOAD_QUANTUM, block_bytes))
  if gather:  # one load per row: a row's groups must be whole TMA load quanta
    gpb = max(gpb, _ceil_div(_TMA_LOAD_QUANTUM, group_size * itemsize))
    if gpb > group_extent or (gpb * group_size * itemsize) % _TMA_LOAD_QUANTUM:
      raise ValueError(f"gathered rows of {groups} groups of {group_size} x {jnp.dtype(dtype).name} cannot be loaded "
                       f"in whole {_TMA_LOAD_QUANTUM}-byte units (see `problems`)")
    num_group_blocks = _ceil_div(group_extent, gpb)
    blocks_per_cta = min(config.blocks_per_cta, num_group_blocks)
    load_rows = block_rows
  # TMA needs 128-byte aligned shared memory: a ring of smaller q buffers would misalign every other one.
  num_q_buffers = min(2, blocks_per_cta) if block_rows * gpb * group_size % 128 == 0 else 1
  return _Plan(
      experts=experts,
      rows_in=rows_in,
      rows_out=out_rows,
      scale_rows=scale_rows,
      groups=groups,
      group_size=group_size,
      block_rows=block_rows,
      groups_per_block=gpb,
      group_extent=group_extent,
      num_q_row_blocks=num_q_row_blocks,
      num_row_blocks=num_q_row_blocks + _ceil_div(scale_rows - out_rows, block_rows),
      num_group_blocks=num_group_blocks,
      blocks_per_cta=blocks_per_cta,
      num_splits=_ceil_div(num_group_blocks, blocks_per_cta),
      load_rows=load_rows,
      gather=gather,
      live_limit=out_rows if gather else rows_in,
      num_stages=min(config.num_stages, blocks_per_cta),
      num_q_buffers=num_q_buffers,
      vec=vec,
  )


def _row_block_start(plan: _Plan, row_block):
  """First row of a row block (traced or a Python int): blocks [0, num_q_row_blocks) cover q's rows
  [0, out_rows) and end at out_rows at the latest; the others cover [out_rows, scale_rows) and end at
  scale_rows at the latest (they may reach back into q's rows, whose scales they then recompute)."""
  bm, nq = plan.block_rows, plan.num_q_row_blocks
  q_start = jnp.minimum(row_block * bm, plan.rows_out - bm)
  scale_start = jnp.minimum(plan.rows_out + (row_block - nq) * bm, plan.scale_rows - bm)
  if nq == 0:
    return scale_start
  if nq == plan.num_row_blocks:
    return q_start
  return jnp.where(row_block < nq, q_start, scale_start)


def _group_block_start(plan: _Plan, split, step):
  """First group of the `step`-th group block of a split (traced or Python ints); a split past the
  last block repeats it, and the last block is shifted back to end at group_extent."""
  block_idx = jnp.minimum(split * plan.blocks_per_cta + step, plan.num_group_blocks - 1)
  return jnp.minimum(block_idx * plan.groups_per_block, plan.group_extent - plan.groups_per_block)


def _q_store_groups(plan: _Plan) -> int:
  """Groups a q store of a block that sticks out past K/G (only "col_packed", K/G % 4 != 0) writes.

  The store of such a block leaves out its groups past K/G: only a box inside q is stored. That needs
  a contiguous SMEM source, i.e. one row per block. Taller blocks store the whole box: that box is not
  contiguous in GMEM (its groups do not span a row of q), and Mosaic GPU stores it with a tiled TMA
  store, which clips it at K/G in hardware.
  """
  overhang = plan.group_extent - plan.groups
  if overhang == 0 or plan.block_rows > 1:
    return plan.groups_per_block
  return plan.groups_per_block - overhang


def _ue8m0_round_up(s):
  """Smallest power of two >= s through the exponent bits; inf and NaN stay as they are."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  exponent = bits & jnp.int32(0x7F800000)
  mantissa = bits & jnp.int32(0x007FFFFF)
  rounded = jnp.where(mantissa != 0, exponent + jnp.int32(0x00800000), exponent)
  finite = exponent != jnp.int32(0x7F800000)
  return jnp.where(finite, lax.bitcast_convert_type(rounded, jnp.float32), s)


def _silu_and_mul(gate, up):
  """docs/CONTRACT.md §1: cast_x(cast_x(silu(f32(gate))) * f32(up)), silu(z) = z / (1 + exp(-z))."""
  dtype = gate.dtype
  g = gate.astype(jnp.float32)
  silu = g / (jnp.float32(1.0) + jnp.exp(-g))
  return (silu.astype(dtype).astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)


def problems(*, group_size: int, scale_layout: str, scale_ue8m0: bool, gather_k: int | None = None,
             dtype=None, fuse_silu_and_mul: bool = False) -> list[str]:
  """What this kernel cannot do for a quantization problem (empty: nothing). gather_k: the row length K of a
  gathered-rows call (`source`), whose rows of dtype are loaded one at a time."""
  found = []
  if gather_k is not None:
    if fuse_silu_and_mul:
      found.append("gathered rows (source) do not take fuse_silu_and_mul")
    least = _ceil_div(_TMA_LOAD_QUANTUM, group_size * jnp.dtype(dtype).itemsize)
    if least * group_size > gather_k or (least * group_size * jnp.dtype(dtype).itemsize) % _TMA_LOAD_QUANTUM:
      found.append(f"gathered rows need {_TMA_LOAD_QUANTUM}-byte loads of whole groups: a row of K={gather_k} "
                   f"{jnp.dtype(dtype).name} values in groups of {group_size} has none")
  if scale_layout not in SCALE_LAYOUTS:
    found.append(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
  if scale_layout == "col_packed" and not scale_ue8m0:
    found.append("scale_layout='col_packed' requires scale_ue8m0=True")
  # A group's fp8 codes must be whole 16-byte TMA units, and a group must fit in one TMA box.
  if group_size % 16 or not 16 <= group_size <= _TMA_MAX_BOX:
    found.append(f"group_size must be a multiple of 16 in [16, {_TMA_MAX_BOX}], got {group_size}")
  return found


def _check_smem(plan: _Plan, config: QuantMosaicConfig, dtype, group_size: int, fuse: bool) -> None:
  itemsize = jnp.dtype(dtype).itemsize
  block_elems = plan.block_rows * plan.groups_per_block * group_size
  load_elems = plan.load_rows * plan.groups_per_block * group_size
  buffers = [plan.num_stages * load_elems * itemsize] * (2 if fuse else 1) + [plan.num_q_buffers * block_elems]
  smem_bytes = sum(_ceil_div(b, _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT for b in buffers)  # Mosaic aligns each buffer
  if smem_bytes > _SMEM_BUDGET:
    raise ValueError(
        f"{config} needs {smem_bytes} bytes of shared memory for x.dtype={dtype}, group_size={group_size}, "
        f"fuse_silu_and_mul={fuse} (at most {_SMEM_BUDGET}): use fewer block_rows, groups_per_block or num_stages")


def _scratch(plan: _Plan, dtype, group_size: int, fuse: bool) -> tuple:
  """The input ring (two with the fused SiLU's up half), the codes' buffers, and the ring's barriers."""
  block = (plan.block_rows, plan.groups_per_block, group_size)
  load_block = (plan.load_rows, plan.groups_per_block, group_size)
  scratch = [plgpu.SMEM((plan.num_stages, *load_block), dtype)]
  if fuse:
    scratch.append(plgpu.SMEM((plan.num_stages, *load_block), dtype))
  scratch.append(plgpu.SMEM((plan.num_q_buffers, *block), FP8))
  # a gathered block's rows are loads of their own, each arriving on the block's barrier
  scratch.append(plgpu.Barrier(num_arrivals=plan.block_rows if plan.gather else 1, num_barriers=plan.num_stages))
  if fuse:
    scratch.append(plgpu.Barrier(num_barriers=plan.num_stages))
  return tuple(scratch)


def _grid(plan: _Plan, experts: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
  # The last grid axis is CUDA's x, launched fastest: neighbouring CTAs then read neighbouring columns of the same
  # rows. CUDA's y and z stop at 65535, so very many row blocks go to x instead.
  if plan.num_row_blocks <= _MAX_GRID_YZ and plan.num_splits <= _MAX_GRID_YZ:
    grid, grid_names = (experts, plan.num_row_blocks, plan.num_splits), ("expert", "row_block", "split")
  else:
    grid, grid_names = (experts, plan.num_splits, plan.num_row_blocks), ("expert", "split", "row_block")
  if experts > _MAX_GRID_YZ or min(plan.num_row_blocks, plan.num_splits) > _MAX_GRID_YZ:
    raise ValueError(f"grid {grid} too large for CUDA: use more block_rows or groups_per_block")
  return grid, grid_names


def _output_shapes(x_shape, group_size, out_rows, scale_layout, scale_cols, fuse):
  """q's shape, and the scales' shape and dtype in `scale_layout`."""
  experts, _, k_in = x_shape
  k = k_in // 2 if fuse else k_in
  groups = k // group_size
  scales = {"row": ((experts, out_rows, groups), jnp.float32), "col": ((experts, groups, scale_cols), jnp.float32),
            "col_packed": ((experts, _ceil_div(groups, 4), scale_cols), jnp.int32)}
  return (experts, out_rows, k), scales[scale_layout]


def per_token_group_quant(
    x: jax.Array, valid_rows: jax.Array, *, group_size: int, eps: float, out_rows: int, scale_layout: str,
    scale_cols: int, scale_ue8m0: bool, fuse_silu_and_mul: bool, config: QuantMosaicConfig, interpret: bool = False,
    pad_rows_written: bool = True, source: jax.Array | None = None, source_divisor: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """q (E, out_rows, K) float8_e4m3fn and scales in `scale_layout`; see the module docstring. pad_rows_written=False:
  CTAs of pad rows only write nothing (those rows' codes and scales are left unspecified). source: int32 (out_rows,),
  with E = 1: row r of q is row source[r] // source_divisor of x (each in [0, T) for r below valid_rows).

  The caller validates the arguments (`problems` says what this kernel cannot do) and chooses the config.
  """
  # Invariants of the buffers, not user input: a violation would leave outputs unwritten.
  gather = source is not None
  if gather and (x.shape[0] != 1 or source.shape != (out_rows,) or fuse_silu_and_mul):
    raise ValueError(f"gathered rows take x (1, T, K) and source ({out_rows},) without the fused SiLU, got x "
                     f"{x.shape}, source {source.shape}, fuse_silu_and_mul={fuse_silu_and_mul}")
  if not gather and out_rows < x.shape[1]:
    raise ValueError(f"out_rows={out_rows} must be >= T={x.shape[1]}")
  if scale_layout != "row" and scale_cols < out_rows:
    raise ValueError(f"scale_cols={scale_cols} must be >= out_rows={out_rows}")
  # Under plgpu.force_gpu_interpret_mode(params) the kernel must not override the forced params.
  forced_interpret = interpret_mode_forced()
  interpret_params = plgpu.InterpretGPUParams() if interpret and not forced_interpret else None
  interpret = bool(interpret) or forced_interpret
  fuse = fuse_silu_and_mul
  experts, rows_in, k_in = x.shape
  q_shape, (s_shape, s_dtype) = _output_shapes(x.shape, group_size, out_rows, scale_layout, scale_cols, fuse)
  scale_rows = out_rows if scale_layout == "row" else scale_cols
  if experts == 0 or scale_rows == 0:  # nothing to compute: every output is empty
    return jnp.zeros(q_shape, FP8), jnp.zeros(s_shape, s_dtype)

  plan = _make_plan(
      x.shape, x.dtype, group_size=group_size, out_rows=out_rows, scale_layout=scale_layout,
      scale_cols=scale_cols, fuse=fuse, config=config, gather=gather,
  )
  _check_smem(plan, config, x.dtype, group_size, fuse)
  x4 = x.reshape(experts, rows_in, k_in // group_size, group_size)  # free: splits the last dim
  has_q = out_rows > 0
  out_type = [jax.ShapeDtypeStruct(s_shape, s_dtype)]
  if has_q:
    out_type.insert(0, jax.ShapeDtypeStruct((*q_shape[:2], q_shape[2] // group_size, group_size), FP8))
  scratch = _scratch(plan, x.dtype, group_size, fuse)

  body = functools.partial(
      _kernel_body, plan=plan, eps=float(eps), scale_layout=scale_layout, ue8m0=bool(scale_ue8m0),
      fuse=fuse, has_q=has_q, interpret=interpret, pad_rows_written=pad_rows_written,
      source_divisor=int(source_divisor),
  )
  grid, grid_names = _grid(plan, experts)
  kernel = plgpu.kernel(
      body,
      out_type=tuple(out_type),
      grid=grid,
      grid_names=grid_names,
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=interpret_params,
      kernel_name="per_token_group_quant_fp8",
  )
  outs = kernel(x4, valid_rows, source.astype(jnp.int32)) if gather else kernel(x4, valid_rows)
  if has_q:
    q4, s = outs
    q = q4.reshape(q_shape)  # free: merges the last two dims
  else:
    (s,) = outs
    q = jnp.zeros(q_shape, FP8)
  return q, s


def _kernel_body(
    x_gmem, valid_gmem, *refs, plan: _Plan, eps, scale_layout, ue8m0, fuse, has_q, interpret, pad_rows_written,
    source_divisor
):
  refs = list(refs)
  source_gmem = refs.pop(0) if plan.gather else None
  q_gmem = refs.pop(0) if has_q else None
  s_gmem = refs.pop(0)
  x_smem = refs.pop(0)
  up_smem = refs.pop(0) if fuse else None
  q_smem = refs.pop(0)
  x_barrier = refs.pop(0)
  up_barrier = refs.pop(0) if fuse else None
  assert not refs

  bm, gpb, g = plan.block_rows, plan.groups_per_block, plan.group_size
  packed = scale_layout == "col_packed"
  # Registers hold a sub-block (rows, groups, G): the whole block, or for "col_packed" the 4 groups
  # of one scale word, so that packing a word is a reduction over an axis of 4.
  sub_groups = 4 if packed else gpb
  num_sub_blocks = gpb // sub_groups
  outer = (bm, sub_groups)
  # No warps across the 4 groups of a word: that reduction then stays within a warp.
  layout = _thread_layout(outer, g, plan.vec, warp_ok=(True, not packed))
  reduced = layout.reduce([2])
  layout_pl, reduced_pl = _as_plgpu(layout), _as_plgpu(reduced)

  split = lax.axis_index("split")
  row_block = lax.axis_index("row_block")
  expert = lax.axis_index("expert")
  row0 = _row_block_start(plan, row_block)
  rows = pl.ds(row0, bm)
  # clipped here: a clip before the launch would be a kernel launch of its own
  num_valid = jnp.minimum(jnp.maximum(valid_gmem[expert], 0), plan.live_limit)
  # With no live row there is nothing to read: the block is all pad rows.
  any_live = row0 < num_valid

  def _kernel():  # the CTA's work: every CTA's, or with pad_rows_written=False only those holding a live row
    def group_start(step):
      return _group_block_start(plan, split, step)

    def source_row(i):
      """The input row of output row row0 + i: row 0 for a pad row (its index may be anything)."""
      r = row0 + i
      src = source_gmem[jnp.minimum(r, plan.rows_out - 1)]
      if source_divisor != 1:
        src = lax.div(src, jnp.int32(source_divisor))
      return jnp.where(r < num_valid, src, 0)

    def issue_loads(step, slot):
      g0 = group_start(step)
      if plan.gather:
        for i in range(plan.block_rows):
          plgpu.copy_gmem_to_smem(x_gmem.at[expert, pl.ds(source_row(i), 1), pl.ds(g0, gpb)],
                                  x_smem.at[slot, pl.ds(i, 1)], x_barrier.at[slot])
        return
      load_rows = pl.ds(row0, plan.load_rows)
      plgpu.copy_gmem_to_smem(x_gmem.at[expert, load_rows, pl.ds(g0, gpb)], x_smem.at[slot], x_barrier.at[slot])
      if fuse:
        plgpu.copy_gmem_to_smem(
            x_gmem.at[expert, load_rows, pl.ds(plan.groups + g0, gpb)], up_smem.at[slot], up_barrier.at[slot]
        )

    if plan.rows_in > 0:
      @pl.when(any_live)
      def _prologue():
        for stage in range(plan.num_stages):
          issue_loads(stage, stage)

    # Row liveness is the same for every group block of this CTA.
    live = plgpu.broadcasted_iota(jnp.int32, outer, 0, layout=reduced_pl) + row0 < num_valid
    live_full = plgpu.layout_cast(lax.broadcast_in_dim(live, outer + (g,), (0, 1)), layout_pl)
    if packed:
      byte_ids = plgpu.broadcasted_iota(jnp.int32, outer, 1, layout=reduced_pl)

    def quantize(x_ref, up_ref, q_ref):
      """Quantizes one sub-block from SMEM into q_ref (SMEM); returns its scales (pad rows: 1.0)."""
      x = plgpu.load(x_ref, layout=layout_pl)
      if fuse:
        x = _silu_and_mul(x, plgpu.load(up_ref, layout=layout_pl))
      # Zero pad rows first: their (possibly stale or non-finite) data must not reach q.
      x = jnp.where(live_full, x, jnp.zeros((), x.dtype))
      # |x| and max are exact in the input dtype, and f32(max|x|) == max|f32(x)|.
      amax = jnp.max(jnp.abs(x), axis=-1).astype(jnp.float32)
      amax = jnp.maximum(amax, jnp.float32(eps))  # NaN-propagating max
      scale = amax * R
      if ue8m0:
        scale = _ue8m0_round_up(scale)
      scale_full = plgpu.layout_cast(lax.broadcast_in_dim(scale, outer + (g,), (0, 1)), layout_pl)
      if interpret:  # XLA executes the body: its `/` by a broadcast becomes a reciprocal multiply
        v = exact_division.divide_correctly_rounded(x.astype(jnp.float32), scale_full)
      else:
        v = x.astype(jnp.float32) / scale_full  # IEEE division (div.rn.f32), not a reciprocal multiply
      if interpret or not _SATFINITE_CAST:
        v = jnp.clip(v, -FP8_MAX, FP8_MAX)
      codes = v.astype(FP8)
      # Unoptimized, as JAX 0.11 stores every such array: some layouts have no bank-conflict-free plan, which JAX 0.12
      # refuses to lower (4-byte inputs; 2-byte inputs with G = 16 or 48 in the 4-group sub-blocks of "col_packed").
      store_unoptimized(q_ref, codes)
      return jnp.where(live, scale, jnp.float32(1.0))

    def step_body(step, carry):
      slot = lax.rem(step, plan.num_stages)
      q_slot = lax.rem(step, plan.num_q_buffers)
      g0 = group_start(step)
      if plan.rows_in > 0:
        @pl.when(any_live)
        def _wait():
          plgpu.barrier_wait(x_barrier.at[slot])
          if fuse:
            plgpu.barrier_wait(up_barrier.at[slot])

      # The TMA store that last read this q buffer must be done reading it. (Mosaic GPU follows the
      # issuing thread's wait with a warpgroup barrier, so no thread writes the buffer before.)
      plgpu.wait_smem_to_gmem(plan.num_q_buffers - 1, wait_read_only=True)
      for sub in range(num_sub_blocks):
        groups = pl.ds(sub * sub_groups, sub_groups)
        block_rows = pl.ds(0, bm)
        scale = quantize(
            x_smem.at[slot, block_rows, groups], up_smem.at[slot, block_rows, groups] if fuse else None,
            q_smem.at[q_slot, :, groups],
        )
        if scale_layout == "row":
          store_to_gmem(s_gmem.at[expert, rows, pl.ds(g0, gpb)], scale)
        elif scale_layout == "col":
          store_to_gmem(s_gmem.at[expert, pl.ds(g0, gpb), rows].T, scale)
        else:
          exponent = (lax.bitcast_convert_type(scale, jnp.int32) >> 23) & jnp.int32(0xFF)
          # Bytes of groups past K/G (only in the last word) are 0.
          exponent = jnp.where(byte_ids + g0 + sub * 4 < plan.groups, exponent, jnp.int32(0))
          word = jnp.sum(lax.shift_left(exponent, byte_ids * 8), axis=1)
          store_to_gmem(s_gmem.at[expert, lax.div(g0, 4) + sub, rows], word)

      if has_q:
        plgpu.commit_smem()
        # At most one store (one bulk async group) per step, of a box inside q (see _q_store_groups).
        has_q_rows = row_block < plan.num_q_row_blocks  # blocks of scale-only pad columns have no q rows
        q_groups = _q_store_groups(plan)
        whole_block = has_q_rows if q_groups == gpb else has_q_rows & (g0 + gpb <= plan.groups)

        @pl.when(whole_block)
        def _store_q():
          plgpu.copy_smem_to_gmem(q_smem.at[q_slot], q_gmem.at[expert, rows, pl.ds(g0, gpb)])

        if q_groups != gpb:
          @pl.when(has_q_rows & (g0 + gpb > plan.groups))
          def _store_q_real_groups():
            plgpu.copy_smem_to_gmem(
                q_smem.at[q_slot, :, pl.ds(0, q_groups)], q_gmem.at[expert, rows, pl.ds(g0, q_groups)])

      if plan.rows_in > 0:
        # Every thread has read this input slot: commit_smem and the stores above synchronize the
        # warpgroup after the last SMEM load.
        @pl.when(any_live & (step + plan.num_stages < plan.blocks_per_cta))
        def _refill():
          issue_loads(step + plan.num_stages, slot)
      return carry

    if plan.blocks_per_cta == 1:
      step_body(0, None)
    else:
      lax.fori_loop(0, plan.blocks_per_cta, step_body, None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  if pad_rows_written:
    _kernel()
  else:  # a block of pad rows only stores nothing
    pl.when(any_live)(_kernel)
