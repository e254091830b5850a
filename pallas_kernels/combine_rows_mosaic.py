"""MoE combine for Hopper (sm_90) in Pallas Mosaic GPU: out[t] = the sum over valid slots j, in order, of
w[t, j] * y[rows[t, j]].

The MoE layer's last step. y (R, H) float32 holds the experts' result rows in expert order; rows (T, k) says which
row of y each token's slot reads, weights (T, k) its float32 weight, valid (T, k) whether it has an expert at all.
Exactly as `jaxfp8.moe.combine.combine_slots` in XLA: acc = 0 (float32); for j in 0..k-1: acc = acc + w[t, j] * y_row
(the product rounded to float32, then the sum), and a slot not valid leaves acc as it is (XLA adds w * 0 = +-0 to an
acc that is never -0: the same bits); out[t] = out_dtype(acc). An invalid slot's weight (inf, NaN) and row are never
read, and neither is a row of y no valid slot names (rows past the experts' live count may hold NaN).

Only valid slots' rows cross HBM: under expert parallelism most slots have no local expert (DeepSeek-V3 on 8 devices:
~4000 valid of 32768), where XLA's gather reads a row for every slot. Each CTA owns `block_tokens` tokens and one
chunk of `block_cols` columns. It first brings its slots' valid flags, rows and weights into shared memory (one TMA
copy each), so the scalar work that follows waits on no global memory. It then keeps a ring of `num_stages` (at
least k) row buffers filled with the chunks of the next tokens' valid slots, whole tokens at a time (one TMA copy and
one barrier per valid slot; the m-th copy goes to buffer m % stages), so up to `num_stages` rows are in flight
whatever the share of valid slots. Each token's slots are summed in registers in slot order as they arrive, and its
out_dtype row goes back by one TMA store (two output buffers: a store overlaps the next token); the buffers a token
freed take the next tokens' rows before the one after it is summed.

Edges: the last token block (column chunk) is shifted back to end at T (H) rather than sticking out: Mosaic GPU
lowers a store whose box is contiguous in memory to a linear bulk copy, clipped only at the end of the whole array.
Shifted blocks overlap their neighbour and write the same bits there. Rows go as (block_cols / 128, 128) boxes (TMA
moves at most 256 elements along each dimension), so H must be a multiple of 128.

Rounding: the product is rounded to float32 before the add, as XLA's formula reads (and as XLA computes it on the
H200; its CPU compiler contracts some such fusions into FMAs). Mosaic GPU lets LLVM contract a multiply feeding an
add into fma.rn.f32 (seen in the PTX), so the kernel writes the product as w * y + 0.0: LLVM then makes that
fma(w, y, 0) = round(w * y) and the sum a separate add.f32 (see `rounded_product`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from ._jax_compat import interpret_mode_forced

LANE = 128  # elements of a box's inner dimension
MAX_BOX = 256  # TMA's most elements along one dimension
MAX_K = 32  # slots per token: each is a step of the unrolled loop over a token's slots
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Per-block shared memory on H100/H200 (227 KiB), less room for the barriers and Mosaic's own scratch.
SMEM_BUDGET = 227 * 1024 - 2048
_OUT_BUFFERS = 2  # output rows in flight: a token's store overlaps the next token's sums
_MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y
_VEC = 4  # float32 per thread per shared-memory load (16 bytes)
_META_QUANTUM = 32  # 4-byte scalars of a TMA copy: a multiple of 128 bytes
_META_ALIGN = 4  # 4-byte scalars per 16 bytes: where a box of them may start


@dataclasses.dataclass(frozen=True)
class CombineRowsConfig:
  """Tunables (blocks are clamped to the problem: a block never exceeds T or H).

  block_tokens: tokens per CTA (their slots share one ring of row buffers).
  block_cols: columns per CTA, a multiple of 128 (the chunk of a row one TMA copy moves).
  num_stages: row buffers in the ring: valid slots' chunks in flight per CTA.
  """
  block_tokens: int = 16
  block_cols: int = 1024
  num_stages: int = 8

  def __post_init__(self):
    for name, low, high in (("block_tokens", 1, 4096), ("block_cols", LANE, LANE * MAX_BOX), ("num_stages", 1, 64)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"CombineRowsConfig.{name} must be an int in [{low}, {high}], got {value!r}")
    if self.block_cols % LANE:
      raise ValueError(f"CombineRowsConfig.block_cols must be a multiple of {LANE}, got {self.block_cols}")


def _meta_slack(k: int) -> int:
  """Slots a block's box of scalars spans past its own: its start is aligned down to 4 slots."""
  return 0 if k % _META_ALIGN == 0 else _META_ALIGN - 1


def block_tokens(t: int, k: int, config: CombineRowsConfig) -> int:
  """Tokens per CTA: block_tokens, at most T, and at most about 256 / k (the block's slots' scalars are one TMA
  box of at most 256)."""
  return max(1, min(config.block_tokens, t, (MAX_BOX - _meta_slack(k)) // k))


def ring_stages(k: int, config: CombineRowsConfig) -> int:
  """Row buffers of the ring: num_stages, and at least k (a token's slots are issued together)."""
  return max(config.num_stages, k)


def smem_bytes(h: int, k: int, out_dtype, config: CombineRowsConfig) -> int:
  """Shared memory one CTA uses for rows of H columns: the ring of float32 chunks, the output buffers, and (at most)
  the three boxes of the block's scalars."""
  cols = min(config.block_cols, h)
  return (ring_stages(k, config) * cols * 4 + _OUT_BUFFERS * cols * jnp.dtype(out_dtype).itemsize
          + 3 * MAX_BOX * 4)


def problems(t: int, k: int, h: int, *, y_dtype=jnp.float32, out_dtype=jnp.bfloat16,
             config: CombineRowsConfig = CombineRowsConfig()) -> list[str]:
  """What keeps this kernel from combining T tokens' k slots of rows of H columns (empty: nothing)."""
  found = []
  if jnp.dtype(y_dtype) != jnp.float32:
    found.append(f"y must be float32, got {jnp.dtype(y_dtype).name}")
  if not any(jnp.dtype(out_dtype) == jnp.dtype(d) for d in OUT_DTYPES):
    found.append(f"out_dtype must be one of {[jnp.dtype(d).name for d in OUT_DTYPES]}, got {jnp.dtype(out_dtype).name}")
  if h % LANE or not 0 < h:
    found.append(f"H={h} must be a positive multiple of {LANE}")
  if not 1 <= k <= MAX_K:
    found.append(f"k={k} must be in [1, {MAX_K}]")
  if t < 0:
    found.append(f"T={t} must be >= 0")
  if h > 0 and (smem := smem_bytes(h, k, out_dtype, config)) > SMEM_BUDGET:
    found.append(f"{config} needs {smem} bytes of shared memory for H={h} (at most {SMEM_BUDGET}): use fewer "
                 "block_cols or num_stages")
  return found


def _rounded_product(w, y, interpret: bool):
  """w * y rounded to float32, kept from fusing with the add that follows. LLVM (Mosaic GPU lets it) and XLA's
  CPU compiler (interpret mode) both contract a multiply feeding an add into an FMA. On the GPU, `+ 0.0` makes
  that fma(w, y, 0) = round(w * y) (a zero's sign aside, which acc + p cannot see: acc is never -0) and leaves the
  sum a separate add; XLA folds `+ 0.0` away, so interpret mode puts the product behind an optimization barrier."""
  if interpret:
    return lax.optimization_barrier(w * y)
  return w * y + 0.0


def _kernel(y_gmem, rows_gmem, w_gmem, valid_gmem, out_gmem, ybuf, obuf, barriers, *meta, t: int, k: int, h: int,
            bt: int, bc: int, stages: int, box: int, meta_in_smem: bool, strided, out_dtype, interpret: bool):
  """One CTA: its block of bt tokens, columns [c0, c0 + bc) (see the module docstring)."""
  lanes = bc // LANE
  # The last block is shifted back to end at T (H): no store sticks out (see the module docstring).
  t0 = jnp.minimum(lax.axis_index("tokens") * bt, t - bt)
  c0 = jnp.minimum(lax.axis_index("cols") * bc, h - bc) // LANE
  if meta_in_smem:
    valid_smem, rows_smem, w_smem, meta_barriers = meta
    # Shifted back to end at T * k (a multiple of 4, as is the box), aligned down to a 16-byte boundary.
    start = lax.div(jnp.minimum(t0 * k, t * k - box), _META_ALIGN) * _META_ALIGN
    for i, (src, dst) in enumerate(((valid_gmem, valid_smem), (rows_gmem, rows_smem), (w_gmem, w_smem))):
      plgpu.copy_gmem_to_smem(src.at[pl.ds(start, box)], dst, meta_barriers.at[i])
    for i in range(3):
      plgpu.barrier_wait(meta_barriers.at[i])
    base, valid_ref, rows_ref, w_ref = t0 * k - start, valid_smem, rows_smem, w_smem
  else:
    base, valid_ref, rows_ref, w_ref = t0 * k, valid_gmem, rows_gmem, w_gmem

  def slots(ref, i):
    # Token i's k scalars, loaded before any is used: k loads in flight, not k round trips one after the other.
    return [ref[base + i * k + j] for j in range(k)]

  def refill(ti, issued, taken):
    """Issues the copies of whole tokens' valid slots, from token ti of the block on, while the ring has room for
    all of the next token's (it has for any token once the ring is empty: stages >= k). Copy number m goes to
    buffer m % stages. Returns the next token to issue and the copies issued."""
    def more(carry):
      ti, _, stop = carry
      return (ti < bt) & (stop == 0)

    def step(carry):
      ti, issued, _ = carry
      ok = [v != 0 for v in slots(valid_ref, ti)]
      src = slots(rows_ref, ti)  # an invalid slot's row is loaded, never used
      count = sum(v.astype(jnp.int32) for v in ok)
      fits = issued + count <= taken + stages

      @pl.when(fits)
      def _issue():
        m = issued
        for j in range(k):
          @pl.when(ok[j])
          def _copy(j=j, m=m):
            # Mosaic puts a warpgroup barrier before the copy: every thread has read the chunk it overwrites.
            stage = lax.rem(m, stages)
            plgpu.copy_gmem_to_smem(y_gmem.at[pl.ds(src[j], 1), pl.ds(c0, lanes)], ybuf.at[pl.ds(stage, 1)],
                                    barriers.at[stage])
          m = m + ok[j].astype(jnp.int32)

      return (jnp.where(fits, ti + 1, ti), jnp.where(fits, issued + count, issued),
              jnp.where(fits, 0, 1).astype(jnp.int32))

    ti, issued, _ = lax.while_loop(more, step, (ti, issued, jnp.int32(0)))
    return ti, issued

  def token(i, carry):
    ti, issued, taken = carry
    ti, issued = refill(ti, issued, taken)  # the buffers the last token freed take the next tokens' rows
    ok = [v != 0 for v in slots(valid_ref, i)]
    w = slots(w_ref, i)  # an invalid slot's weight (inf, NaN) is loaded, never used
    acc = plgpu.layout_cast(jnp.zeros((lanes, LANE), jnp.float32), strided)
    for j in range(k):  # in slot order: the sum's rounding order is XLA's
      def add(acc, taken, j=j):
        stage = lax.rem(taken, stages)
        plgpu.barrier_wait(barriers.at[stage])
        return acc + _rounded_product(w[j], plgpu.load(ybuf.at[stage], layout=strided), interpret), taken + 1

      acc, taken = lax.cond(ok[j], add, lambda *c: c, acc, taken)
    o = lax.rem(i, _OUT_BUFFERS)
    plgpu.wait_smem_to_gmem(_OUT_BUFFERS - 1, wait_read_only=True)  # the store that read obuf[o] is done
    obuf[o, 0] = acc.astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(obuf.at[o], out_gmem.at[pl.ds(t0 + i, 1), pl.ds(c0, lanes)])
    return ti, issued, taken

  lax.fori_loop(0, bt, token, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def combine_rows(y: jax.Array, rows: jax.Array, weights: jax.Array, valid: jax.Array, *, out_dtype=jnp.bfloat16,
                 config: CombineRowsConfig = CombineRowsConfig(), interpret: bool = False) -> jax.Array:
  """(T, H) out_dtype: see the module docstring. y (R, H) float32; rows int32 (T, k), each valid one in [0, R);
  weights (T, k), taken as float32; valid (T, k) bool or int32 (nonzero: valid). A bool `valid` costs one XLA
  convert to int32 outside the kernel (the kernel reads 4-byte scalars), an int32 one nothing. The caller checks
  `problems`."""
  r, h = y.shape
  t, k = rows.shape
  if t == 0 or r == 0:  # no token, or no row any slot could read: every sum is empty
    return jnp.zeros((t, h), out_dtype)
  bt = block_tokens(t, k, config)
  bc = min(config.block_cols, h)
  stages = ring_stages(k, config)
  lanes = bc // LANE  # 128-column units of a chunk
  token_blocks, col_blocks = pl.cdiv(t, bt), pl.cdiv(h, bc)
  strided = plgpu.Layout.WG_STRIDED((lanes, LANE), vec_size=math.gcd(_VEC, lanes))  # lanes floats a thread
  # The block's slots' valid flags, rows and weights go to shared memory by one TMA copy each, a box of whole
  # 128-byte units (Mosaic GPU splits a copy's bytes over the warpgroup's 128 threads) inside the (T * k,) arrays,
  # starting on a 16-byte boundary (a 1-D box starting off one stopped an H200 with an illegal instruction), so it
  # spans up to 3 slots more than the block's. A problem of fewer slots than one box, or of T * k not a multiple
  # of 4 (the box shifted back to end at T * k would start off a boundary), reads its scalars straight from global
  # memory instead.
  box = -(-(bt * k + _meta_slack(k)) // _META_QUANTUM) * _META_QUANTUM
  meta_in_smem = t * k >= box and t * k % _META_ALIGN == 0
  forced_interpret = interpret_mode_forced()
  interpret = bool(interpret) or forced_interpret

  # Column chunks go to CUDA's x (launched fastest): neighbouring CTAs read the same tokens' slots. CUDA's y stops
  # at 65535, so very many token blocks go to x instead.
  if token_blocks <= _MAX_GRID_YZ:
    grid, grid_names = (token_blocks, col_blocks), ("tokens", "cols")
  else:
    grid, grid_names = (col_blocks, token_blocks), ("cols", "tokens")
  scratch = [plgpu.SMEM((stages, lanes, LANE), jnp.float32), plgpu.SMEM((_OUT_BUFFERS, 1, lanes, LANE), out_dtype),
             plgpu.Barrier(num_barriers=stages)]
  if meta_in_smem:
    scratch += [plgpu.SMEM((box,), jnp.int32), plgpu.SMEM((box,), jnp.int32), plgpu.SMEM((box,), jnp.float32),
                plgpu.Barrier(num_barriers=3)]
  # Under plgpu.force_gpu_interpret_mode(params) the kernel must not override the forced params.
  interpret_params: Any = plgpu.InterpretGPUParams() if interpret and not forced_interpret else None
  body = functools.partial(_kernel, t=t, k=k, h=h, bt=bt, bc=bc, stages=stages, box=box, meta_in_smem=meta_in_smem,
                           strided=strided, out_dtype=out_dtype, interpret=interpret)
  f = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((t, h // LANE, LANE), out_dtype),
      grid=grid,
      grid_names=grid_names,
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      interpret=interpret_params,
      kernel_name="combine_rows",
  )
  valid = valid.astype(jnp.int32) if valid.dtype != jnp.int32 else valid
  out = f(y.reshape(r, h // LANE, LANE), rows.astype(jnp.int32).reshape(-1),
          weights.astype(jnp.float32).reshape(-1), valid.reshape(-1))
  return out.reshape(t, h)


__all__ = ["CombineRowsConfig", "combine_rows", "problems", "smem_bytes"]
