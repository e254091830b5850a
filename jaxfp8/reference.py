"""The float64 / ml_dtypes NumPy oracle for everything in docs/CONTRACT.md.

Every test compares against these functions. They import no kernel and no JAX: they are the contract
written as plain NumPy, slow and obvious. Inputs may be NumPy or JAX arrays (anything `np.asarray` takes).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_MAX = 448.0
# float32(1/448): scales are amax * R, a multiply that every backend rounds the same way.
R = np.float32(1.0 / 448.0)
assert R.view(np.uint32) == 0x3B124925


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def ceil_div(x: int, y: int) -> int:
  return -(-x // y)


def ue8m0_round(s: np.ndarray) -> np.ndarray:
  """Smallest power of two >= s, by exponent bits (float32 in, float32 out). NaN and inf stay as they are."""
  s = np.asarray(s, np.float32)
  bits = s.view(np.uint32)
  mantissa = bits & np.uint32(0x007FFFFF)
  exponent_bits = bits & np.uint32(0x7F800000)
  rounded = np.where(mantissa != 0, exponent_bits + np.uint32(0x00800000), exponent_bits)
  out = rounded.astype(np.uint32).view(np.float32)
  return np.where(np.isfinite(s), out, s).astype(np.float32)


def cast_to_fp8(v: np.ndarray) -> np.ndarray:
  """e4m3fn(clip(v, -448, 448)) with round-to-nearest-even; NaN stays NaN."""
  v = np.asarray(v, np.float32)
  return np.clip(v, -FP8_MAX, FP8_MAX).astype(FP8)


def silu_and_mul(x: np.ndarray) -> np.ndarray:
  """docs/CONTRACT.md §1: v = cast_x(cast_x(silu(f32(gate))) * f32(up)) on the last axis halves, in float32 like the kernels."""
  x = np.asarray(x)
  h = x.shape[-1] // 2
  gate = x[..., :h].astype(np.float32)
  up = x[..., h:].astype(np.float32)
  with np.errstate(over="ignore", invalid="ignore"):
    silu = gate / (np.float32(1) + np.exp(-gate))
    return (silu.astype(x.dtype).astype(np.float32) * up).astype(x.dtype)


def pack_ue8m0_words(scales_col_major: np.ndarray) -> np.ndarray:
  """Pack (..., G, M') power-of-two float32 scales into (..., ceil(G/4), M') int32 words (byte j = group 4i+j)."""
  s = np.asarray(scales_col_major, np.float32)
  *lead, groups, cols = s.shape
  words = ceil_div(groups, 4)
  exponent = ((s.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.uint32)
  padded = np.zeros((*lead, words * 4, cols), np.uint32)
  padded[..., :groups, :] = exponent
  padded = padded.reshape(*lead, words, 4, cols)
  packed = np.zeros((*lead, words, cols), np.uint32)
  for j in range(4):
    packed |= padded[..., :, j, :] << np.uint32(8 * j)
  return packed.view(np.int32)


def per_token_group_quant_fp8(
    x,
    group_size: int,
    *,
    eps: float = 1e-10,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
    pack_ue8m0: bool = False,
    row_alignment: int = 1,
    fuse_silu_and_mul: bool = False,
    masked_m=None,
):
  """docs/CONTRACT.md §1 on NumPy. Returns (q, s) with exactly the shapes and layouts of `jaxfp8.per_token_group_quant_fp8`.

  Without masked_m: x (..., K) is flattened to (M, K); q is (M_pad, K) and s is (M_pad, K/G) row-major,
  (K/G, M_pad') column-major, or (ceil(K/G/4), M_pad') int32 packed.
  With masked_m: x is (E, T, K); q is (E, T_pad, K) and s carries the leading E axis in the same layouts.
  """
  x = np.asarray(x)
  if pack_ue8m0 and not scale_ue8m0:
    raise ValueError("pack_ue8m0 requires scale_ue8m0")
  if masked_m is None:
    x3 = x.reshape(1, -1, x.shape[-1])
    valid = np.array([x3.shape[1]])
  else:
    x3 = x
    valid = np.clip(np.asarray(masked_m).astype(np.int64), 0, x3.shape[1])
  if fuse_silu_and_mul:
    x3 = silu_and_mul(x3)
  experts, rows, k = x3.shape
  if k % group_size:
    raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
  groups = k // group_size
  rows_pad = round_up(rows, row_alignment)
  cols = round_up(rows_pad, 4) if (scale_tma_aligned and (column_major_scales or pack_ue8m0)) else rows_pad

  xf = x3.astype(np.float32).reshape(experts, rows, groups, group_size)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.max(np.abs(xf), axis=-1)  # NaN propagates
    amax = np.where(np.isnan(amax), amax, np.maximum(amax, np.float32(eps))).astype(np.float32)
    s = (amax * R).astype(np.float32)
    if scale_ue8m0:
      s = ue8m0_round(s)
    q = cast_to_fp8(xf / s[..., None]).reshape(experts, rows, k)

  live = np.arange(rows)[None, :] < valid[:, None]  # (E, rows)
  q_out = np.zeros((experts, rows_pad, k), FP8)
  q_out[:, :rows] = np.where(live[..., None], q, np.zeros((), FP8))
  s_rows = np.ones((experts, cols, groups), np.float32)  # pad rows (and TMA pad columns) hold 1.0
  s_rows[:, :rows] = np.where(live[..., None], s, np.float32(1.0))

  if pack_ue8m0:
    s_out = pack_ue8m0_words(np.swapaxes(s_rows, -1, -2))
  elif column_major_scales:
    s_out = np.ascontiguousarray(np.swapaxes(s_rows, -1, -2))
  else:
    s_out = s_rows[:, :rows_pad]
  if masked_m is None:
    return q_out[0], s_out[0]
  return q_out, s_out


def block_fp8_matmul(a_q, b_q, a_s, b_s, block_size, *, a_s_column_major: bool = False, bias=None) -> np.ndarray:
  """docs/CONTRACT.md §2 in float64: C[m, n] = bias[n] + sum_g a_s[m, g] * b_s[n // gn, g] * (A_g @ B_g^T)[m, n].

  Returns the float64 result before the output cast; `cast_output` applies it.
  """
  a = np.asarray(a_q).astype(np.float64)
  b = np.asarray(b_q).astype(np.float64)
  m, k = a.shape
  n, k2 = b.shape
  assert k == k2, (a.shape, b.shape)
  gn, gk = block_size
  groups = ceil_div(k, gk)
  a_s = np.asarray(a_s, np.float64)
  a_s = a_s[:, :m].T if a_s_column_major else a_s[:m]
  b_s = np.asarray(b_s, np.float64)
  assert a_s.shape == (m, groups), (a_s.shape, (m, groups))
  assert b_s.shape == (ceil_div(n, gn), groups), (b_s.shape, (ceil_div(n, gn), groups))
  b_s_cols = np.repeat(b_s, gn, axis=0)[:n]  # (N, groups)
  out = np.zeros((m, n), np.float64)
  with np.errstate(invalid="ignore", over="ignore"):
    for g in range(groups):
      sl = slice(g * gk, min(k, (g + 1) * gk))
      out += (a[:, sl] @ b[:, sl].T) * a_s[:, g : g + 1] * b_s_cols[None, :, g]
    if bias is not None:
      out += np.asarray(bias, np.float32).astype(np.float64)[None, :]
  return out


def ragged_group_bounds(group_sizes, m: int) -> np.ndarray:
  """(E, 2) row ranges [start, end) of the ragged layout's groups (docs/CONTRACT.md §7): negative sizes count as 0,
  and the groups are cut at M."""
  sizes = np.clip(np.asarray(group_sizes).astype(np.int64), 0, None)
  ends = np.minimum(np.cumsum(sizes), m)
  starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
  return np.stack([starts, ends], axis=1)


def ragged_block_fp8_matmul(a_q, b_q, a_s, b_s, group_sizes, block_size, *,
                            a_s_column_major: bool = False) -> np.ndarray:
  """docs/CONTRACT.md §7, ragged layout, in float64: a_q (M, K) rows sorted by group, b_q (E, N, K), b_s (E, ...).
  Each group's rows take §2 with that group's weight; rows no group owns are 0. Returns (M, N) float64."""
  a_q = np.asarray(a_q)
  m = a_q.shape[0]
  n = np.asarray(b_q).shape[1]
  a_s = np.asarray(a_s, np.float32)
  a_s = a_s[:, :m].T if a_s_column_major else a_s[:m]
  out = np.zeros((m, n), np.float64)
  for e, (start, end) in enumerate(ragged_group_bounds(group_sizes, m)):
    if end > start:
      out[start:end] = block_fp8_matmul(a_q[start:end], b_q[e], a_s[start:end], b_s[e], block_size)
  return out


def masked_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, block_size, *,
                            a_s_column_major: bool = False) -> np.ndarray:
  """docs/CONTRACT.md §7, masked layout, in float64: a_q (E, T, K), a_s (E, T, G) or column-major (E, G, T'),
  b_q (E, N, K); rows t >= masked_m[e] are 0. Returns (E, T, N) float64."""
  a_q = np.asarray(a_q)
  num_groups, rows = a_q.shape[:2]
  n = np.asarray(b_q).shape[1]
  out = np.zeros((num_groups, rows, n), np.float64)
  for e in range(num_groups):
    live = int(np.clip(np.asarray(masked_m)[e], 0, rows))
    if live:
      scales = np.asarray(a_s[e], np.float32)
      scales = scales[:, :live].T if a_s_column_major else scales[:live]
      out[e, :live] = block_fp8_matmul(a_q[e, :live], b_q[e], scales, b_s[e], block_size)
  return out


def _nan_tokens_get_nan(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """docs/CONTRACT.md §8's NaN rule: a token whose routing values (the row its experts are ranked by) hold a NaN
  gets NaN for every weight."""
  return np.where(np.isnan(values).any(-1, keepdims=True), np.nan, weights)


def deepseek_v3_route(logits, correction_bias, *, top_k: int, n_group: int, topk_group: int,
                      routed_scaling_factor: float, norm_topk_prob: bool = True):
  """docs/CONTRACT.md §8, DeepSeek-V3's router in float64: sigmoid scores; experts chosen by score + correction bias
  among the topk_group groups whose two best biased scores sum highest (a NaN sum ranks last); weights are the
  unbiased scores, normalized to sum 1 (norm_topk_prob), times routed_scaling_factor. Ties go to the lower index; a
  token whose biased scores hold a NaN gets NaN weights (its ids are then unspecified). logits (..., E). Returns
  (ids int32 (..., top_k), weights float64 (..., top_k))."""
  logits = np.asarray(logits, np.float32).astype(np.float64)
  lead, e = logits.shape[:-1], logits.shape[-1]
  logits = logits.reshape(-1, e)
  t = logits.shape[0]
  with np.errstate(over="ignore", invalid="ignore"):
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + np.asarray(correction_bias, np.float32).astype(np.float64)[None, :]
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)
  group_scores = np.where(np.isnan(group_scores), -np.inf, group_scores)
  best_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
  allowed = np.zeros((t, n_group), bool)
  allowed[np.arange(t)[:, None], best_groups] = True
  masked = np.where(np.repeat(allowed, e // n_group, axis=1), choice, -np.inf)
  ids = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(scores, ids, axis=1)
  if norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  weights = _nan_tokens_get_nan(choice, weights * routed_scaling_factor)
  return ids.astype(np.int32).reshape(*lead, top_k), weights.reshape(*lead, top_k)


def qwen3_moe_route(logits, *, top_k: int, norm_topk_prob: bool = True):
  """docs/CONTRACT.md §8, Qwen3-MoE's router in float64: softmax over the experts, the top_k, renormalized to sum 1
  with norm_topk_prob. Ties go to the lower index; a token whose probabilities hold a NaN (a NaN logit, or +inf: the
  softmax divides inf by inf) gets NaN weights (its ids are then unspecified). logits (..., E). Returns (ids int32
  (..., top_k), weights float64 (..., top_k))."""
  logits = np.asarray(logits, np.float32).astype(np.float64)
  lead, e = logits.shape[:-1], logits.shape[-1]
  logits = logits.reshape(-1, e)
  with np.errstate(invalid="ignore"):
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
  ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(probs, ids, axis=1)
  if norm_topk_prob:
    weights = weights / weights.sum(-1, keepdims=True)
  weights = _nan_tokens_get_nan(probs, weights)
  return ids.astype(np.int32).reshape(*lead, top_k), weights.reshape(*lead, top_k)


def fp8_moe(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size, *, eps: float = 1e-10) -> np.ndarray:
  """docs/CONTRACT.md §8, the routed experts of an MoE layer: for each token t and slot j whose expert
  e = topk_ids[t, j] is in [0, E), with x quantized per token group (§1, G = gk):

      h = x.dtype(§2(x_q[t], w13_q[e]))                  (2I,), [gate | up]
      a = §1 of silu(gate) * up (fuse_silu_and_mul)      (I,)
      y = float32(§2(a, w2_q[e]))                        (H,)
      out[t] += topk_weights[t, j] * y

  Returns the float64 (T, H) result before the cast to x.dtype."""
  x = np.asarray(x)
  ids = np.asarray(topk_ids)
  weights = np.asarray(topk_weights, np.float32).astype(np.float64)
  gk = block_size[1]
  q, s = per_token_group_quant_fp8(x, gk, eps=eps)
  out = np.zeros((x.shape[0], np.asarray(w2_q).shape[1]), np.float64)
  for e in range(np.asarray(w13_q).shape[0]):
    tokens, slots = np.nonzero(ids == e)
    if not len(tokens):
      continue
    h = cast_output(block_fp8_matmul(q[tokens], w13_q[e], s[tokens], w13_s[e], block_size), x.dtype)
    a_q, a_s = per_token_group_quant_fp8(h, gk, eps=eps, fuse_silu_and_mul=True)
    y = cast_output(block_fp8_matmul(a_q, w2_q[e], a_s, w2_s[e], block_size), np.float32).astype(np.float64)
    np.add.at(out, tokens, weights[tokens, slots, None] * y)
  return out


def cast_output(c: np.ndarray, out_dtype) -> np.ndarray:
  """The final cast of docs/CONTRACT.md §2: float64 -> float32 -> out_dtype (what an f32 accumulator then a cast gives)."""
  return np.asarray(c, np.float64).astype(np.float32).astype(np.dtype(out_dtype))


def quantize_weight_blockwise(w, block_size=(128, 128), *, eps: float = 1e-10):
  """docs/CONTRACT.md §4: per (gn, gk) block, s = max(amax, eps) * R, q = e4m3fn(clip(w / s)). Partial edge blocks use their valid elements."""
  w = np.asarray(w).astype(np.float32)
  n, k = w.shape
  gn, gk = block_size
  nb, kb = ceil_div(n, gn), ceil_div(k, gk)
  padded = np.zeros((nb * gn, kb * gk), np.float32)  # zeros never raise amax above the valid elements'
  padded[:n, :k] = np.abs(w)
  with np.errstate(invalid="ignore"):
    amax = padded.reshape(nb, gn, kb, gk).max(axis=(1, 3))
    amax = np.where(np.isnan(amax), amax, np.maximum(amax, np.float32(eps))).astype(np.float32)
    s = (amax * R).astype(np.float32)
    s_full = np.repeat(np.repeat(s, gn, axis=0), gk, axis=1)[:n, :k]
    q = cast_to_fp8(w / s_full)
  return q, s


def dequantize_weight_blockwise(w_q, w_s, block_size=(128, 128)) -> np.ndarray:
  """float64 w_q * w_s broadcast over blocks."""
  q = np.asarray(w_q).astype(np.float64)
  n, k = q.shape
  gn, gk = block_size
  s = np.repeat(np.repeat(np.asarray(w_s, np.float64), gn, axis=0), gk, axis=1)[:n, :k]
  return q * s


def w8a8_block_fp8_linear(x, w_q, w_s, block_size, bias=None, *, eps: float = 1e-10) -> np.ndarray:
  """docs/CONTRACT.md §3: quantize x per token group (G = gk), block GEMM, float64 result of shape (..., N) before the cast to x.dtype."""
  x = np.asarray(x)
  lead = x.shape[:-1]
  k = x.shape[-1]
  gk = block_size[1]
  x2 = x.reshape(-1, k)
  if k % gk:
    raise ValueError(f"K={k} is not a multiple of block_size[1]={gk}")
  q, s = per_token_group_quant_fp8(x2, gk, eps=eps)
  c = block_fp8_matmul(q, w_q, s, w_s, block_size, bias=bias)
  return c.reshape(*lead, np.asarray(w_q).shape[0])  # explicit N: with zero rows, -1 cannot be inferred


def relative_error(out, ref) -> float:
  """||out - ref||_F / ||ref||_F in float64 (NaN if either holds NaN)."""
  out = np.asarray(out).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  denom = np.linalg.norm(ref)
  if denom == 0:
    return float(np.linalg.norm(out))
  return float(np.linalg.norm(out - ref) / denom)


def fp8_code_distance(a, b) -> np.ndarray:
  """Steps between two e4m3fn arrays along the ordered code line (0 where equal; NaN pairs count as equal, NaN vs number as 1000)."""
  a = np.asarray(a).astype(FP8)
  b = np.asarray(b).astype(FP8)

  def ordinal(v):
    bits = v.view(np.uint8).astype(np.int32)
    magnitude = bits & 0x7F
    return np.where(bits & 0x80, -magnitude, magnitude)

  fa, fb = a.astype(np.float32), b.astype(np.float32)
  nan_a, nan_b = np.isnan(fa), np.isnan(fb)
  dist = np.abs(ordinal(a) - ordinal(b))
  # +0 and -0 are the same value; a code of 0 next to -0 is no step.
  dist = np.where((fa == 0) & (fb == 0), 0, dist)
  return np.where(nan_a & nan_b, 0, np.where(nan_a | nan_b, 1000, dist))


__all__ = [
    "FP8", "BF16", "FP8_MAX", "R", "round_up", "ceil_div", "ue8m0_round", "cast_to_fp8", "silu_and_mul", "pack_ue8m0_words",
    "per_token_group_quant_fp8", "block_fp8_matmul", "cast_output", "quantize_weight_blockwise",
    "dequantize_weight_blockwise", "w8a8_block_fp8_linear", "relative_error", "fp8_code_distance",
]
