"""MoE router top-k for Hopper (sm_90) in Pallas Mosaic GPU: router logits (T, E) -> each token's k experts and
their weights, in one kernel.

DeepSeek-V3's router (sigmoid scores, a correction bias for the choice only, the `topk_group` of `n_group` expert
groups whose two best biased scores sum highest, normalized weights times a scaling factor) and Qwen3-MoE's (softmax,
top k, renormalized) are chains of small reductions: XLA runs each as its own kernel (about ten at one token), where
this kernel takes a block of 64 tokens (one token a row, its experts along the row), stages the values it ranks and
weighs in shared memory in chunks of up to 128 columns (whole groups), and does the whole chain with row reductions
on (64, chunk) register arrays:

  - a group's score is its best two keys (the key of a float is its IEEE total order as an int32, the order
    `lax.top_k` ranks by), summed as floats; a NaN sum ranks last; the groups are ranked by comparing their scores
    pairwise (ties to the lower group), and the experts of the groups ranked past topk_group are masked to -inf;
  - each chunk's k best are taken in k rounds: the largest key of the row, the lowest expert holding it (ties to the
    lower index), its weight picked exactly from the scores, its key replaced by one below every other key; past
    128 experts the chunks run in a loop, each chunk's k best merged into a running k best in k more rounds (an
    earlier chunk wins a tie);
  - a token whose values hold a NaN gets NaN weights (its ids stay k distinct experts).

The ids are `lax.top_k`'s on the same values, bit for bit; the weights differ from XLA's by the rounding of `exp`
and of the k-term sum only. Logits come in their dtype (Qwen3's are rounded to the activations' bfloat16) and are
widened in the kernel. Tokens are rows of 64; the last block's rows past T are read as zeros by TMA and never
stored past the padded output the launcher slices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

BLOCK_TOKENS = 64  # rows of a warpgroup's (64, N) register tile
MAX_EXPERTS = 256  # the logits and up to two staged (64, E) float32 copies fit in shared memory
TAKEN = -(2 ** 31)  # the key of a taken expert: below every key a value can have (keys are clamped above it)
NEG_INF_KEY = -2139095041  # the key of -inf
CHUNK = 128  # the columns one top-k pass holds: (64, 128) int32 keys take 64 registers a thread
SCORINGS = ("sigmoid", "softmax")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TopkRouting:
  """What the kernel computes. scoring "sigmoid": DeepSeek-V3's router (a correction bias, groups); "softmax":
  Qwen3-MoE's (n_group = topk_group = 1). Weights are divided by their sum when norm_topk_prob (DeepSeek-V3's sum
  plus 1e-20), then multiplied by routed_scaling_factor (sigmoid only)."""
  scoring: str
  top_k: int
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0

  @property
  def grouped(self) -> bool:
    """Whether some group can be masked (with topk_group == n_group every expert stays a candidate)."""
    return self.topk_group < self.n_group


def problems(experts: int, dtype, routing: TopkRouting) -> list[str]:
  """What keeps this kernel from routing logits (T, experts) of dtype (empty: nothing)."""
  found = []
  if routing.scoring not in SCORINGS:
    found.append(f"scoring must be one of {SCORINGS}, got {routing.scoring!r}")
  if jnp.dtype(dtype) not in DTYPES:
    found.append(f"logits must be float32, bfloat16 or float16, got {jnp.dtype(dtype).name}")
  if experts % 8 or not 0 < experts <= MAX_EXPERTS:
    found.append(f"E={experts} experts must be a positive multiple of 8 up to {MAX_EXPERTS}")
  if not 1 <= routing.top_k <= experts:
    found.append(f"top_k={routing.top_k} must be in [1, E={experts}]")
  if routing.scoring == "softmax" and routing.n_group != 1:
    found.append(f"softmax routing has no groups, got n_group={routing.n_group}")
  if routing.grouped and (experts % routing.n_group or (experts // routing.n_group) % 8):
    found.append(f"each of the n_group={routing.n_group} groups of the {experts} experts must hold a multiple of 8 "
                 "experts (a group is a slice of whole 8-column tiles)")
  elif experts % chunk_columns(experts, routing):
    found.append(f"E={experts} experts must split into top-k passes of {chunk_columns(experts, routing)} columns "
                 f"(E up to {CHUNK}, or a multiple of {CHUNK} columns of whole groups)")
  return found


def chunk_columns(experts: int, routing: TopkRouting) -> int:
  """The columns of one top-k pass: up to CHUNK, whole groups where some group can be masked."""
  chunk = min(experts, CHUNK)
  if routing.grouped and experts % routing.n_group == 0:
    per = experts // routing.n_group
    chunk = max(chunk // per, 1) * per
  return chunk


def _key(x: jax.Array) -> jax.Array:
  """int32 keys of float32 x in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < inf < +NaN)."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _value(key: jax.Array) -> jax.Array:
  """The float32 whose `_key` is key (the map is its own inverse on the bits)."""
  return lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key), jnp.float32)


def _best(key: jax.Array, column: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """Per row: the largest key and the lowest column holding it."""
  best = jnp.max(key, axis=1)
  return best, jnp.min(jnp.where(key == best[:, None], column, width), axis=1)


def _load(ref) -> jax.Array:
  """A (64, C) shared-memory tile into registers in the WGMMA layout every row reduction here works on."""
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False)


def _iota(shape) -> jax.Array:
  return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA)


def _allowed_groups(choice_smem, chunk: int, experts: int, routing: TopkRouting) -> list[jax.Array]:
  """Per group, per row: whether the group is among the topk_group whose best two keys sum highest. choice_smem
  (chunks, 64, chunk): the biased scores, a chunk of whole groups each."""
  per = experts // routing.n_group
  column = _iota((BLOCK_TOKENS, per))
  scores = []
  for g in range(routing.n_group):
    c, c0 = divmod(g * per, chunk)
    choice = _load(choice_smem.at[c])
    key = _key(choice[:, c0:c0 + per])
    first, at = _best(key, column, per)
    second = jnp.max(jnp.where(column == at[:, None], jnp.int32(TAKEN), key), axis=1)
    s = _value(first) + _value(second)
    scores.append(_key(jnp.where(s != s, -jnp.inf, s)))  # inf + -inf ranks last, whatever the NaN's sign
  allowed = []
  for g, mine in enumerate(scores):
    beaten_by = [(theirs > mine) | (theirs == mine) if h < g else theirs > mine
                 for h, theirs in enumerate(scores) if h != g]
    rank = sum(b.astype(jnp.int32) for b in beaten_by)
    allowed.append(rank < routing.topk_group)
  return allowed


def _chunk_top_k(key: jax.Array, pick, k: int, offset: int, kp: int):
  """The k best of one chunk of columns (64, C) of keys, in order: (keys, expert ids, picked weights), each (64, kp)
  (slots past k hold the least key). `pick(hit)` is the weight of the one column `hit` marks in each row."""
  width = key.shape[1]
  column = _iota(key.shape)
  slot = _iota((BLOCK_TOKENS, kp))
  keys = plgpu.layout_cast(jnp.full((BLOCK_TOKENS, kp), TAKEN, jnp.int32), plgpu.Layout.WGMMA)
  ids = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, kp), jnp.int32), plgpu.Layout.WGMMA)
  weights = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, kp), jnp.float32), plgpu.Layout.WGMMA)
  for r in range(k):
    best, at = _best(key, column, width)
    hit = column == at[:, None]
    w = _value(best) if pick is None else pick(hit)
    key = jnp.where(hit, jnp.int32(TAKEN), key)
    keys = jnp.where(slot == r, best[:, None], keys)
    ids = jnp.where(slot == r, (at + jnp.int32(offset))[:, None], ids)
    weights = jnp.where(slot == r, w[:, None], weights)
  return keys, ids, weights


def _merge_top_k(parts, k: int, kp: int):
  """The k best of the parts' candidates, each part's (keys, ids, weights) in order, parts in expert order: among
  equal keys an earlier part, then an earlier slot, holds the lower expert, so taking the first of the equal ones
  keeps `lax.top_k`'s tie rule (the lowest index). Returns (keys, ids, weights), each (64, kp)."""
  slot = _iota((BLOCK_TOKENS, kp))
  keys = [part[0] for part in parts]
  out_keys = plgpu.layout_cast(jnp.full((BLOCK_TOKENS, kp), TAKEN, jnp.int32), plgpu.Layout.WGMMA)
  out_ids = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, kp), jnp.int32), plgpu.Layout.WGMMA)
  out_weights = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, kp), jnp.float32), plgpu.Layout.WGMMA)
  for r in range(k):
    best = functools.reduce(jnp.maximum, [jnp.max(key, axis=1) for key in keys])
    # row vectors derived from `best` (a constant has no layout): the count of parts that held this round's expert
    # (0 or 1), its id and weight
    found = best - best
    chosen_id = found
    chosen_weight = lax.bitcast_convert_type(found, jnp.float32)
    for i, (_, ids, weights) in enumerate(parts):
      at = jnp.min(jnp.where(keys[i] == best[:, None], slot, kp), axis=1)
      at = jnp.where(found > 0, jnp.int32(kp), at)  # an earlier part's expert is the lower one
      hit = slot == at[:, None]
      taken_here = at < kp
      chosen_id = jnp.where(taken_here, jnp.max(jnp.where(hit, ids, jnp.int32(-1)), axis=1), chosen_id)
      chosen_weight = jnp.where(taken_here, jnp.max(jnp.where(hit, weights, -jnp.inf), axis=1), chosen_weight)
      keys[i] = jnp.where(hit, jnp.int32(TAKEN), keys[i])
      found = found + taken_here.astype(jnp.int32)
    out_keys = jnp.where(slot == r, best[:, None], out_keys)
    out_ids = jnp.where(slot == r, chosen_id[:, None], out_ids)
    out_weights = jnp.where(slot == r, chosen_weight[:, None], out_weights)
  return out_keys, out_ids, out_weights


def _nan_rows(x: jax.Array) -> jax.Array:
  """Per row of x: 1 where it holds a NaN, else 0 (int32: no bool row vectors in the kernel's arithmetic)."""
  return jnp.max(jnp.where(x != x, 1, 0), axis=1)


def _mask_groups(ranked_smem, allowed: list[jax.Array], experts: int, n_group: int) -> jax.Array:
  """Sets the ranked values of the groups not allowed to -inf in place (its key is the one such a group's experts
  rank by: below every allowed expert's). ranked_smem (chunks, 64, chunk), a chunk of whole groups each. Returns
  `_nan_rows` of the values before masking (a token with a NaN in a masked group still gets NaN weights)."""
  chunks, _, chunk = ranked_smem.shape
  per = experts // n_group
  nan_row = None
  for c in range(chunks):
    ranked = _load(ranked_smem.at[c])
    nan_here = _nan_rows(ranked)
    nan_row = nan_here if nan_row is None else jnp.maximum(nan_row, nan_here)
    parts = [jnp.where(allowed[g][:, None], ranked[:, g * per - c * chunk:(g + 1) * per - c * chunk], -jnp.inf)
             for g in range(c * chunk // per, (c + 1) * chunk // per)]
    ranked_smem.at[c][...] = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
  return nan_row


def _stash(ref, x: jax.Array, chunk: int) -> None:
  """x (64, E) into ref (E / chunk, 64, chunk), a chunk of columns each."""
  for c in range(x.shape[1] // chunk):
    ref.at[c][...] = x[:, c * chunk:(c + 1) * chunk]


def _normalized(weights: jax.Array, nan_row: jax.Array, routing: TopkRouting) -> jax.Array:
  """The chosen weights divided by their sum (DeepSeek-V3's plus 1e-20), scaled; NaN for a row holding a NaN."""
  sigmoid = routing.scoring == "sigmoid"
  if routing.norm_topk_prob:
    total = jnp.sum(weights, axis=1)
    if sigmoid:
      total = total + jnp.float32(1e-20)
    weights = weights / total[:, None]
  if sigmoid:
    weights = weights * jnp.float32(routing.routed_scaling_factor)
  return jnp.where((nan_row > 0)[:, None], jnp.float32(jnp.nan), weights)


def _top_k_of_chunks(ranked_smem, weighed_smem, experts: int, kp: int, routing: TopkRouting):
  """(ids, weights, NaN rows) of the k best experts per row: ranked_smem (chunks, 64, chunk) holds the values ranked,
  weighed_smem the weights picked (DeepSeek-V3's unbiased scores; None: the ranked values themselves)."""
  k, chunk = routing.top_k, ranked_smem.shape[2]
  masked = routing.scoring == "sigmoid" and routing.grouped
  if masked:  # the NaN rows seen before masking, whole: the chunks below need not look again
    nan_row = _mask_groups(ranked_smem, _allowed_groups(ranked_smem, chunk, experts, routing), experts,
                           routing.n_group)
  else:
    nan_row = plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS,), jnp.int32), plgpu.Layout.WGMMA.reduce(1))

  def chunk_best(c, nan_row):
    """The k best of chunk c (traced in the loop over chunks) and the NaN rows seen so far."""
    ranked = _load(ranked_smem.at[c])
    if not masked:
      nan_row = jnp.maximum(nan_row, _nan_rows(ranked))
    key = jnp.maximum(_key(ranked), jnp.int32(TAKEN + 1))
    pick = None if weighed_smem is None else (
        lambda hit: jnp.max(jnp.where(hit, _load(weighed_smem.at[c]), -jnp.inf), axis=1))
    return _chunk_top_k(key, pick, min(k, chunk), c * chunk, kp), nan_row

  if experts == chunk:
    (_, ids, weights), nan_row = chunk_best(0, nan_row)
    return ids, weights, nan_row

  # One chunk's code in a loop, its k best merged into a running k best (earlier chunks hold the lower experts, so
  # the running set goes first): the chunks' chains cannot interleave and hold registers side by side (unrolled,
  # they spilled about 450 bytes and took 1.2x as long).
  def step(c, carry):
    running, nan_row = carry
    part, nan_row = chunk_best(c, nan_row)
    return _merge_top_k([running, part], k, kp), nan_row

  empty = (jnp.full((BLOCK_TOKENS, kp), TAKEN, jnp.int32), jnp.zeros((BLOCK_TOKENS, kp), jnp.int32),
           jnp.zeros((BLOCK_TOKENS, kp), jnp.float32))
  empty = tuple(plgpu.layout_cast(x, plgpu.Layout.WGMMA) for x in empty)
  (_, ids, weights), nan_row = lax.fori_loop(0, experts // chunk, step, (empty, nan_row))
  return ids, weights, nan_row


def route_topk(logits: jax.Array, correction_bias: jax.Array | None, *, routing: TopkRouting,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(ids int32 (T, k), weights float32 (T, k)) of logits (T, E); correction_bias float32 (E,) with scoring
  "sigmoid", None with "softmax". The caller checks `problems`."""
  t, e = logits.shape
  k = routing.top_k
  kp = pl.cdiv(k, 8) * 8
  sigmoid = routing.scoring == "sigmoid"
  chunk = chunk_columns(e, routing)
  # TMA reads the logits in (8, ...) tiles: more than 8 rows must be whole tiles
  rows = t if t <= 8 or t % 8 == 0 else pl.cdiv(t, 8) * 8
  if rows != t:
    logits = jnp.pad(logits, ((0, rows - t), (0, 0)))
  blocks = pl.cdiv(rows, BLOCK_TOKENS)

  def body(*refs):
    if sigmoid:
      l_gmem, b_gmem, ids_gmem, w_gmem, l_smem, s_smem, c_smem, ids_smem, w_smem, barrier = refs
    else:
      l_gmem, ids_gmem, w_gmem, l_smem, s_smem, ids_smem, w_smem, barrier = refs
    t0 = lax.axis_index("block") * BLOCK_TOKENS
    plgpu.copy_gmem_to_smem(l_gmem.at[pl.ds(t0, BLOCK_TOKENS)], l_smem, barrier)
    plgpu.barrier_wait(barrier)
    values = _load(l_smem).astype(jnp.float32)
    # The values ranked (DeepSeek-V3's biased scores, Qwen3's probabilities) and those weighed (the unbiased scores,
    # the probabilities) go to shared memory a chunk of columns each: each top-k pass reloads its chunk, so few
    # registers stay live.
    if sigmoid:
      scores = 1.0 / (1.0 + jnp.exp(-values))
      _stash(s_smem, scores, chunk)
      bias = plgpu.load(b_gmem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      _stash(c_smem, scores + bias[None, :], chunk)
      ranked_smem = c_smem
    else:
      m = jnp.max(values, axis=1)
      p = jnp.exp(values - m[:, None])
      _stash(s_smem, p / jnp.sum(p, axis=1)[:, None], chunk)
      ranked_smem = s_smem
    ids, weights, nan_row = _top_k_of_chunks(ranked_smem, s_smem if sigmoid else None, e, kp, routing)
    weights = _normalized(weights, nan_row, routing)
    ids_smem[...] = ids
    w_smem[...] = weights
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ids_smem, ids_gmem.at[pl.ds(t0, BLOCK_TOKENS)])
    plgpu.copy_smem_to_gmem(w_smem, w_gmem.at[pl.ds(t0, BLOCK_TOKENS)])
    plgpu.wait_smem_to_gmem(0)

  stashed = plgpu.SMEM((e // chunk, BLOCK_TOKENS, chunk), jnp.float32)
  scratch = [plgpu.SMEM((BLOCK_TOKENS, e), logits.dtype), stashed] + ([stashed] if sigmoid else [])
  scratch += [plgpu.SMEM((BLOCK_TOKENS, kp), jnp.int32), plgpu.SMEM((BLOCK_TOKENS, kp), jnp.float32),
              plgpu.Barrier()]
  out_rows = blocks * BLOCK_TOKENS
  interpret_params: Any = plgpu.InterpretGPUParams() if interpret else None
  f = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((out_rows, kp), jnp.int32), jax.ShapeDtypeStruct((out_rows, kp), jnp.float32)),
      grid=(blocks,),
      grid_names=("block",),
      scratch_types=scratch,
      interpret=interpret_params,
  )
  args = (logits, correction_bias.astype(jnp.float32)) if sigmoid else (logits,)
  ids, weights = f(*args)
  return ids[:t, :k], weights[:t, :k]


__all__ = ["TopkRouting", "problems", "route_topk"]
