"""The top-k choices the routers make (docs/CONTRACT.md §8), over the last axis and bit for bit `lax.top_k`'s (the k
largest in IEEE total order, ties to the lower index), in the forms XLA runs them as: compare-and-count (`top_k`:
each entry's rank counted, then every pick in one variadic reduction: two fused reductions), rounds of one argmax
each (`top_k_rounds`), and the merged form (`best_lists`: each row's best entries as one reduction whose state is a
sorted list)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The most comparisons a compare-and-count choice (`top_k` here, the layer's dispatch) makes in one call: the largest
# measured to compile and run on the H200 (the DeepSeek-V3 router at 64 tokens: 64 x 256 x 256). XLA's GPU compiler
# did not finish the DeepSeek-V3 router's at 4096 tokens in 45 s.
PAIRWISE_MAX_COMPARES = 1 << 22
# Past PAIRWISE_MAX_COMPARES, a top-k with k up to this many runs as k rounds of one fused argmax each; a larger k
# runs `lax.top_k` (a sort on the GPU).
ROUNDS_MAX_K = 8
# A rank over a row of at most this many entries (DeepSeek-V3's 8 groups) is a sum of n elementwise compares of
# (..., n), which fuses into whatever reads it, not a reduction kernel of its own.
UNROLLED_MAX = 16


def order_keys(values: jax.Array) -> jax.Array:
  """int32 keys of float32 values in IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < inf < +NaN), the order
  `lax.top_k` ranks floats by."""
  bits = lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def top_k(values: jax.Array, k: int, *also: jax.Array, apart: bool = False) -> tuple[jax.Array, ...]:
  """`lax.top_k(values, k)` over the last axis (the k largest, in order, ties to the lower index, NaN by its sign),
  as (ids, then the chosen entries of each 32-bit array of `also`, same shape as values, bit for bit), in one of
  three forms. Up to PAIRWISE_MAX_COMPARES, each entry's rank is the count of entries that beat it, and the picks
  are one variadic reduction (`pick`): at decode two small kernels (one for a short row) where a sort-based top-k
  launches many. Past it, with k up to ROUNDS_MAX_K, k rounds of one argmax each over the entries not yet taken (a
  reduction of (free, key, index) triples: one kernel a round, where XLA's GPU top-k sorts every row), then gathers;
  else `lax.top_k` itself. apart: see `_ranks`. No derivative: the routers take theirs from a gather of the ids
  (routing._route)."""
  if not _pairwise(values):
    ids = _top_k_ids(values, k)
    return (ids, *(jnp.take_along_axis(a, ids, axis=-1) for a in also))
  n = values.shape[-1]
  return pick(_chosen(values, k, apart), (jnp.arange(n, dtype=jnp.int32), *also))


def top_k_weighed(values: jax.Array, k: int, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(ids of `lax.top_k(values, k)`, weights at those ids) as two sibling reductions (a masked sum of a single term:
  the weight exactly, for weights that are never -0.0, as probabilities are not); past PAIRWISE_MAX_COMPARES, ids
  as `top_k` takes them and a gather. Where the values are a softmax (Qwen3-MoE's router), XLA's GPU compiler fuses
  these two with it: 3 kernels, 4.6 us at one token on an H100, where `top_k`'s one variadic pick (with the NaN
  flag's OR in it) took 5 kernels, 6.6 us (benchmarks/README.md, the routers' A/B)."""
  if not _pairwise(values):
    return top_k(values, k, weights)
  n = values.shape[-1]
  chosen = _chosen(values, k)
  ids = jnp.sum(jnp.where(chosen, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
  return ids, jnp.sum(jnp.where(chosen, weights[..., None, :], jnp.zeros((), weights.dtype)), axis=-1)


def _chosen(values: jax.Array, k: int, apart: bool = False) -> jax.Array:
  """(..., k, n) bool: row j marks the entry of rank j (one True per row)."""
  return _ranks(values, apart)[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]


def pick(chosen: jax.Array, arrays: tuple) -> tuple[jax.Array, ...]:
  """Each array's entries that `chosen` (..., k, n) marks, one per row, (..., k) each, all in one variadic reduction
  over n. A pick is the masked sum of a single term, exact: every array (32-bit, (..., n) or (n,)) is summed as its
  bits, so floats come back as they were (-0.0 and a NaN's sign included), in one kernel where a reduction per
  array would take one each (as layer._sums)."""
  operands = tuple(jnp.where(chosen, lax.bitcast_convert_type(a, jnp.int32)[..., None, :], 0) for a in arrays)
  out = lax.reduce(operands, (np.int32(0),) * len(arrays), lambda a, b: tuple(x + y for x, y in zip(a, b)),
                   (chosen.ndim - 1,))
  return tuple(lax.bitcast_convert_type(o, a.dtype) for o, a in zip(out, arrays))


def _pairwise(values: jax.Array) -> bool:
  """Whether a choice over the last axis of values is made by compare-and-count (within PAIRWISE_MAX_COMPARES)."""
  return values.size * values.shape[-1] <= PAIRWISE_MAX_COMPARES


def _ranks(values: jax.Array, apart: bool = False) -> jax.Array:
  """(..., n) int32: each entry's place in `lax.top_k`'s order of the last axis (0 for the largest; ties to the
  lower index, NaN by its sign): the count of entries that beat it. Over a short row (n up to UNROLLED_MAX) a sum
  of n elementwise compares, no reduction of its own (it fuses into whatever reads it); else one fused reduction
  over (..., n, n). apart: the keys computed by a kernel of their own (an optimization barrier): where they come
  from a costly chain, XLA's GPU compiler would otherwise materialize the (..., n, n) compares in a kernel of their
  own and reduce them in another."""
  n = values.shape[-1]
  key = order_keys(values)
  if n <= UNROLLED_MAX:
    j = lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
    beats = [(key[..., h:h + 1] > key) | ((key[..., h:h + 1] == key) & (j > h)) for h in range(n)]
    return functools.reduce(jnp.add, [b.astype(jnp.int32) for b in beats])
  if apart:
    key = lax.optimization_barrier(key)
  index = lax.broadcasted_iota(jnp.int32, (n, n), 1) < lax.broadcasted_iota(jnp.int32, (n, n), 0)
  beats = (key[..., None, :] > key[..., :, None]) | ((key[..., None, :] == key[..., :, None]) & index)
  return jnp.sum(beats, axis=-1, dtype=jnp.int32)


def _top_k_ids(values: jax.Array, k: int) -> jax.Array:
  """`lax.top_k(values, k)`'s ids past PAIRWISE_MAX_COMPARES: k rounds of one argmax, or lax.top_k for a large k."""
  return _top_k_rounds(values, k) if k <= ROUNDS_MAX_K else lax.top_k(values, k)[1]


def in_top_k(values: jax.Array, k: int) -> jax.Array:
  """(..., n) bool: whether each entry is among `lax.top_k(values, k)`'s (at decode its rank below k: no pick; over
  a short row, as DeepSeek-V3's groups, elementwise)."""
  if _pairwise(values):
    return _ranks(values) < k
  ids = _top_k_ids(values, k)
  return jnp.any(ids[..., :, None] == jnp.arange(values.shape[-1], dtype=jnp.int32), axis=-2)


def any_along(flags: jax.Array) -> jax.Array:
  """(...): the OR of bool flags (..., n) over the last axis; over a short row elementwise (no kernel of its own)."""
  n = flags.shape[-1]
  if n <= UNROLLED_MAX:
    return functools.reduce(jnp.logical_or, [flags[..., h] for h in range(n)])
  return jnp.any(flags, axis=-1)


def _better(a, b):
  """The lexicographic max of two (free, key, index) triples: a free entry, then the larger key, then the lower
  index (lax.top_k's tie rule). Associative and commutative, so XLA may reduce in any order."""
  a_free, a_key, a_index = a
  b_free, b_key, b_index = b
  a_wins = (a_free > b_free) | ((a_free == b_free) & ((a_key > b_key) | ((a_key == b_key) & (a_index < b_index))))
  return tuple(jnp.where(a_wins, x, y) for x, y in zip(a, b))


def _top_k_rounds(values: jax.Array, k: int) -> jax.Array:
  """The ids of `lax.top_k(values, k)`: round j takes the best entry not yet taken. The taken flag is part of the
  reduced triple (not a sentinel key), so every key, the least included, ranks as in lax.top_k."""
  n = values.shape[-1]
  key = order_keys(values)
  index = lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
  taken = jnp.zeros(values.shape, bool)
  ids = []
  for _ in range(k):
    free = jnp.where(taken, 0, 1).astype(jnp.int32)
    best = lax.reduce((free, key, index), (jnp.int32(-1), jnp.int32(jnp.iinfo(jnp.int32).min), jnp.int32(n)),
                      _better, (values.ndim - 1,))[2]
    ids.append(best)
    taken = taken | (index == best[..., None])
  return jnp.stack(ids, axis=-1)


# ---- the merged form: each row's p best entries as one reduction whose state is a sorted list ----------------------

# The entry that ranks after every real one: the least key, and an index past any (a real entry of the least key,
# -NaN of all ones, still wins on its index).
NO_ENTRY = (np.int32(np.iinfo(np.int32).min), np.int32(np.iinfo(np.int32).max))


def _wins(a: tuple, b: tuple) -> jax.Array:
  """Whether entry a = (key, index, ...) ranks before entry b in `lax.top_k`'s order: the larger key, then the lower
  index. Real entries have distinct indices, so this is a strict total order on them."""
  return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))


def either(take_a: jax.Array, a: tuple, b: tuple) -> tuple:
  return tuple(jnp.where(take_a, x, y) for x, y in zip(a, b))


def merged(a: list, b: list) -> list:
  """The best len(a) entries of lists a and b (each sorted best first, of one power-of-two length), sorted best first.
  Against b reversed, the better of a[i] and b[-1 - i] at each i is the best half of the union (a sequence that falls,
  then rises: bitonic), which a bitonic sorter's half-cleaners put in order. Associative and commutative, so XLA may
  reduce in any order."""
  p = len(a)
  c = [either(_wins(x, y), x, y) for x, y in zip(a, reversed(b))]
  half = p // 2
  while half:
    for i in range(p):
      if i % (2 * half) < half:
        first = _wins(c[i], c[i + half])
        c[i], c[i + half] = either(first, c[i], c[i + half]), either(first, c[i + half], c[i])
    half //= 2
  return c


def list_length(k: int) -> int:
  return 1 << max(k - 1, 0).bit_length()


def best_lists(keys: jax.Array, p: int, index: jax.Array | None = None, payloads: tuple = (),
                flag: jax.Array | None = None) -> tuple[list, jax.Array | None]:
  """Each row of the last axis' p best entries (p a power of two), best first, in one `lax.reduce`: a list of p
  (key, index, *payloads) tuples of shape keys.shape[:-1] (past a row's length, entries of `NO_ENTRY`), and the
  row's OR of `flag`. keys: int32 order keys; index: each entry's index (default its place in the row); payloads:
  int32 arrays carried with their entries. One kernel where compare-and-count takes two or more and rounds of argmax
  one a round."""
  axis = keys.ndim - 1
  index = lax.broadcasted_iota(jnp.int32, keys.shape, axis) if index is None else index
  none = (*NO_ENTRY, *(np.int32(0),) * len(payloads))
  # each entry alone is a sorted list: itself, then p - 1 entries that rank after every real one
  singles = [(keys, index, *payloads)] + [tuple(jnp.full(keys.shape, v, jnp.int32) for v in none)] * (p - 1)
  return merged_along(singles, axis, flag)


def merged_along(lists: list, axis: int, flag: jax.Array | None = None) -> tuple[list, jax.Array | None]:
  """The p best entries of the sorted lists `lists` holds along `axis` (a list of p (key, index, *payloads) tuples
  of arrays, each a sorted list at every place of that axis), merged by one `lax.reduce` over it, and the OR of
  `flag` along it (None without one)."""
  p, width = len(lists), len(lists[0])
  none = (*NO_ENTRY, *(np.int32(0),) * (width - 2))
  operands, inits = [v for entry in lists for v in entry], list(none) * p
  if flag is not None:
    operands.append(flag.astype(jnp.int32))
    inits.append(np.int32(0))

  def combine(a, b):
    out = [v for entry in merged(*[[tuple(x[i * width:(i + 1) * width]) for i in range(p)] for x in (a, b)])
           for v in entry]
    return (*out, *((jnp.maximum(a[-1], b[-1]),) if flag is not None else ()))

  out = lax.reduce(tuple(operands), tuple(inits), combine, (axis,))
  return [tuple(out[i * width:(i + 1) * width]) for i in range(p)], (out[-1] > 0 if flag is not None else None)


def bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def as_float(bits: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(bits, jnp.float32)


def key_value(key: jax.Array) -> jax.Array:
  """The float32 whose `order_keys` key is `key` (the map is its own inverse on the bits)."""
  return as_float(jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key))


def ids_and_weights(best: list, k: int) -> tuple[jax.Array, jax.Array]:
  """(ids (..., k), the first payload as float32 weights (..., k)) of a `best_lists` list."""
  return (jnp.stack([e[1] for e in best[:k]], axis=-1), jnp.stack([as_float(e[2]) for e in best[:k]], axis=-1))


def two_best_summed(grouped: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(each group's two best values summed (..., G), whether the group holds a NaN (..., G)) of grouped (..., G, n),
  as one variadic reduction over n whose state is the two best so far and the NaN flag's OR: each entry is read
  once, so XLA fuses whatever computes it (the sigmoid scores) into the reduction. A NaN entry counts as -inf, and a
  NaN sum (inf + -inf: bias entries of both signs) ranks last on every platform (-inf), not by the sign of the NaN
  it makes: that is the largest sum over pairs of distinct entries with the pairs that make NaN left out, bit for
  bit (float addition is monotone in each operand; a token holding a NaN gets NaN weights whatever its group
  scores, §8)."""
  nan = jnp.isnan(grouped)
  values = jnp.where(nan, -jnp.inf, grouped)
  least = np.array(-np.inf, grouped.dtype)

  def better_two(a, b):
    # the two best of both pairs (each pair in order): the larger firsts, then the larger of the smaller first and
    # the larger second
    return (jnp.maximum(a[0], b[0]), jnp.maximum(jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])), a[2] | b[2])

  best, second, flag = lax.reduce((values, jnp.full_like(values, least), nan), (least, least, np.bool_(False)),
                                  better_two, (grouped.ndim - 1,))
  s = best + second
  return jnp.where(jnp.isnan(s), -jnp.inf, s), flag
