"""Block-FP8 weights (docs/CONTRACT.md §4): blockwise quantization and its inverse.

A weight of a linear layer is stored the way DeepSeek-V3 and Qwen3-FP8 checkpoints store it (the Hugging Face FP8
convention): `w_q` (N, K) float8_e4m3fn, K contiguous (`<prefix>.weight`), and one float32 scale per (gn, gk) block,
`w_s` (ceil(N/gn), ceil(K/gk)) (`<prefix>.weight_scale_inv`: despite the name, the factor that multiplies the codes
back: w ~= w_q * w_s). `Fp8LinearWeight` bundles the two with the optional bias and the block size.

Reading and writing Hugging Face checkpoints lives in `jaxfp8.checkpoints`; its public functions are importable
from here too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import _checks
from jaxfp8 import _transforms as transforms
from jaxfp8.gemm.xla import fp8_values
from pallas_kernels import exact_division as _exact_division

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
# float32(1/448) (0x3B124925): a scale is amax * R, a multiply every backend rounds the same way (docs/CONTRACT.md §0).
R = np.float32(1.0 / 448.0)
DEFAULT_BLOCK_SIZE = (128, 128)
WEIGHT_DTYPES = _checks.FLOAT_DTYPES


# ---- the weight of one linear layer --------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=["w_q", "w_s", "bias", "w_q_t"],
                   meta_fields=["block_size"])
@dataclasses.dataclass(frozen=True)
class Fp8LinearWeight:
  """The block-FP8 weight of one linear layer (a pytree: the arrays are leaves, block_size is static).

  w_q: (N, K) float8_e4m3fn codes; w_s: (ceil(N/gn), ceil(K/gk)) float32 block scales; bias: optional (N,);
  block_size: (gn, gk); w_q_t: optional (K, round_up(N, gn)) transposed codes, which the linear's FP8 backward
  multiplies by (`with_transpose` builds them once, instead of a transpose in every backward pass).
  """
  w_q: Any
  w_s: Any
  bias: Any = None
  block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
  w_q_t: Any = None

  def with_transpose(self) -> "Fp8LinearWeight":
    """This weight with `w_q_t` built (for training through the linear with backward="fp8")."""
    from jaxfp8.linear.backward import transposed_codes
    return dataclasses.replace(self, w_q_t=transposed_codes(jnp.asarray(self.w_q), self.block_size))

  @property
  def shape(self) -> tuple[int, int]:
    """(N, K): output and input features."""
    return tuple(self.w_q.shape)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The (N, K) weight w_q * w_s in `dtype`."""
    return dequantize_weight_blockwise(self.w_q, self.w_s, self.block_size, dtype=dtype)


# ---- quantization (docs/CONTRACT.md §4) -----------------------------------------------------------------------------

def _check_weight(w) -> None:
  if not hasattr(w, "dtype") or not hasattr(w, "shape"):
    raise TypeError(f"w must be an array, got {type(w).__name__}")
  if jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
    raise TypeError(f"w must be bfloat16, float16 or float32, got dtype {w.dtype}")
  if len(w.shape) != 2:
    raise ValueError(f"w must be 2-D (N, K), got shape {tuple(w.shape)}")


def quantize_weight_blockwise(w, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE, *, eps: float = 1e-10
                              ) -> tuple[jax.Array, jax.Array]:
  """Quantizes a (N, K) weight to float8_e4m3fn with one float32 scale per (gn, gk) block (docs/CONTRACT.md §4).

  Per block: s = max(amax over the block's valid elements, eps) * float32(1/448), q = e4m3fn(clip(w / s, -448, 448)).
  Partial edge blocks (N % gn, K % gk) use only their valid elements. A NaN makes its block's scale and codes NaN.

  Returns (w_q (N, K) float8_e4m3fn, w_s (ceil(N/gn), ceil(K/gk)) float32), the `weight` / `weight_scale_inv` pair of
  Hugging Face FP8 checkpoints. Scales match `jaxfp8.reference.quantize_weight_blockwise` bit for bit; a code may
  differ by one fp8 step where XLA turns the division into a reciprocal multiply (rare).
  """
  _check_weight(w)
  gn, gk = _checks.block_size(block_size)
  eps = _checks.eps(eps)
  quantize = transforms.not_differentiable(
      lambda w: _quantize_weight(w, block_size=(gn, gk), eps=eps), "jaxfp8.quantize_weight_blockwise",
      "its outputs are fp8 codes and their block scales (the FP8 weights are frozen, docs/CONTRACT.md §6)")
  return quantize(jnp.asarray(w))


@functools.partial(jax.jit, static_argnames=("block_size", "eps"))
def _quantize_weight(w, *, block_size, eps):
  n, k = w.shape
  gn, gk = block_size
  nb, kb = -(-n // gn), -(-k // gk)
  if n == 0 or k == 0:
    return jnp.zeros((n, k), FP8), jnp.full((nb, kb), np.float32(eps) * R, jnp.float32)
  wf = w.astype(jnp.float32)
  # Zeros past the edges never raise a block's maximum above that of its valid elements.
  padded = jnp.pad(wf, ((0, nb * gn - n), (0, kb * gk - k))).reshape(nb, gn, kb, gk)
  amax = jnp.max(jnp.abs(padded), axis=(1, 3))
  has_nan = jnp.any(jnp.isnan(padded), axis=(1, 3))
  amax = jnp.where(has_nan, jnp.nan, jnp.maximum(amax, np.float32(eps)))
  scale = amax * R
  # Correctly rounded (XLA turns a division by a broadcast into a reciprocal multiply: on the H200 3 codes in
  # 12480 came out one step off).
  quotient = _exact_division.divide_correctly_rounded(padded, scale[:, None, :, None])
  q = jnp.where(jnp.isnan(quotient), quotient, jnp.clip(quotient, -FP8_MAX, FP8_MAX)).astype(FP8)
  return q.reshape(nb * gn, kb * gk)[:n, :k], scale


def dequantize_weight_blockwise(w_q, w_s, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE, *, dtype=jnp.float32
                                ) -> jax.Array:
  """The inverse of `quantize_weight_blockwise`: w_q * w_s (each scale over its block), computed in float32 and
  returned in `dtype`."""
  _checks.array("w_q", w_q, (FP8,))
  _checks.array("w_s", w_s, (jnp.dtype(jnp.float32),))
  gn, gk = _checks.block_size(block_size)
  _check_scale_shape(tuple(w_q.shape), tuple(w_s.shape), (gn, gk), "w_s")
  out_dtype = _checks.float_dtype("dtype", dtype)
  return _dequantize_weight(jnp.asarray(w_q), jnp.asarray(w_s), block_size=(gn, gk), dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "dtype"))
def _dequantize_weight(w_q, w_s, *, block_size, dtype):
  n, k = w_q.shape
  gn, gk = block_size
  nb, kb = w_s.shape
  s_full = jnp.broadcast_to(w_s[:, None, :, None], (nb, gn, kb, gk)).reshape(nb * gn, kb * gk)[:n, :k]
  return (fp8_values(w_q) * s_full).astype(dtype)  # codes kept as codes (see fp8_values)


def _check_scale_shape(w_shape, s_shape, block_size, what: str) -> None:
  n, k = w_shape
  gn, gk = block_size
  expected = (-(-n // gn), -(-k // gk))
  if tuple(s_shape) != expected:
    raise ValueError(f"{what} must have shape (ceil(N/gn), ceil(K/gk)) = {expected} for a ({n}, {k}) weight and "
                     f"block_size={tuple(block_size)}, got {tuple(s_shape)}")


def fp8_linear_weight(w, bias=None, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE) -> Fp8LinearWeight:
  """Quantizes a float (N, K) weight (and keeps its bias) into an `Fp8LinearWeight`."""
  w_q, w_s = quantize_weight_blockwise(w, block_size)
  return Fp8LinearWeight(w_q, w_s, None if bias is None else jnp.asarray(bias), tuple(block_size))


# The checkpoint functions live in jaxfp8.checkpoints, which imports this module: they are resolved on first use, so
# that `from jaxfp8.weights import load_hf_fp8_linears` works without an import cycle.
_CHECKPOINT_NAMES = ("checkpoint_files", "read_block_size", "load_hf_fp8_linears", "save_hf_fp8_linears",
                     "WEIGHT_SUFFIX", "SCALE_SUFFIX", "BIAS_SUFFIX")


def __getattr__(name: str):
  if name in _CHECKPOINT_NAMES:
    from jaxfp8 import checkpoints
    return getattr(checkpoints, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Fp8LinearWeight", "quantize_weight_blockwise", "dequantize_weight_blockwise", "fp8_linear_weight"]
