"""Block-scaled FP8 GEMM (SPEC.md section 2), `w8a8_block_fp8_matmul`: validation and dispatch.

    C[m, n] = out_dtype( bias[n] + sum_g a_s[m, g] * b_s[n // gn, g] * sum_{k in group g} f32(a_q[m, k]) * f32(b_q[n, k]) )

Implementations:
  "mosaic": Pallas Mosaic GPU kernel for Hopper (pallas_kernels/gemm_mosaic.py); block (128, 128), N and K multiples
            of 128, M a multiple of 4.
  "triton": Pallas Triton-lowered kernel for any sm >= 8.9 GPU (pallas_kernels/gemm_triton.py); any M, N, K and gn,
            gk a multiple of 32 (its fp8 dots are 32 to 128 wide in K and never straddle two scale groups).
  "xla":    jnp, any platform (jaxfp8/gemm_xla.py).
"""

from __future__ import annotations

import functools
import importlib
import numbers

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _platform, gemm_configs, gemm_xla
from pallas_kernels.gemm_triton import TritonGemmConfig, check_config
from pallas_kernels import gemm_triton

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
OUT_DTYPES = _checks.FLOAT_DTYPES
FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The only scale block the Mosaic GPU kernel implements (DeepSeek-V3's).
MOSAIC_BLOCK = 128
# The Mosaic kernel's decode row tile: below it, the quantizer's buffers padded to it (with out_rows) read faster than
# unpadded ones, whose missing rows TMA fills with zeros.
MOSAIC_DECODE_ROWS = 64
_MOSAIC_MODULE = "pallas_kernels.gemm_mosaic"


def _capability() -> tuple[int, int] | None:
  """Compute capability of the GPU kernels are built for: the real device, or the abstract one of `abstract_h200()`."""
  return _platform.gpu_compute_capability() or _platform.abstract_device_capability()


def _device_kind() -> str:
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.device_kind
  return jax.devices()[0].device_kind


def triton_config(m: int, n: int, k: int, block_size: tuple[int, int]) -> TritonGemmConfig | None:
  """The Triton config a call without `config` runs: this device's tuned table entry, else the heuristic; None when
  no Triton config can serve block_size."""
  return gemm_configs.get_config(m, n, k, block_size, device_kind=_device_kind(), num_sms=_platform.num_sms())


def _resolve_interpret(interpret: bool | None) -> bool:
  # Under `abstract_h200()` (lowering for CUDA on a CPU machine) kernels are compiled, not interpreted.
  if interpret is None and _platform.abstract_device_capability() is not None:
    return False
  return _platform.resolve_interpret(interpret)


def _mosaic_import_error() -> str | None:
  """Why pallas_kernels.gemm_mosaic cannot be imported (None when it can)."""
  try:
    importlib.import_module(_MOSAIC_MODULE)
  except Exception as e:  # a broken or missing module must not break the other implementations
    return f"{type(e).__name__}: {e}"
  return None


def _mosaic_module():
  """pallas_kernels.gemm_mosaic, or None when it is not importable."""
  return None if _mosaic_import_error() else importlib.import_module(_MOSAIC_MODULE)


def mosaic_unsupported_reason(m: int, n: int, k: int, block_size: tuple[int, int]) -> str | None:
  """Why the Mosaic GPU kernel cannot take this problem (None when it can)."""
  if tuple(block_size) != (MOSAIC_BLOCK, MOSAIC_BLOCK):
    return f"it implements block_size=(128, 128) only, got {tuple(block_size)}"
  if n % MOSAIC_BLOCK or k % MOSAIC_BLOCK or n == 0 or k == 0:
    return f"it needs N and K to be positive multiples of 128, got N={n}, K={k}"
  if m % 4 or m == 0:
    return f"it needs M % 4 == 0 (TMA rows of the column-major scales), got M={m}; pad the rows to a multiple of 4"
  return None


# Decode on Hopper: up to this many live rows the tuned Triton kernel beats the Mosaic small-M kernel. H200, CUPTI,
# session 5, Mosaic reading the quantizer's 64-row decode buffers (out_rows): M=1 Triton/Mosaic 43.7/45.3 us
# (DeepSeek-V3 q_proj), 34.0/35.3 (dense_down), 15.7/15.8 (Qwen3 qkv); M=4 44.4/45.7, 34.9/35.4, 16.0/16.0; from M=8
# Mosaic is ahead on all three (M=16: 46.5 vs 47.6, 35.7 vs 39.0, 16.0 vs 17.2).
TRITON_DECODE_MAX_M = 4


def resolve_implementation(
    implementation: str | None, *, config, interpret: bool, m: int, n: int, k: int, block_size: tuple[int, int],
    live_rows: int | None = None,
) -> str:
  """The implementation a call runs: the one asked for (if it can run here), else the best available one.

  None picks: on Hopper, "triton" for decode (live_rows, default m, <= TRITON_DECODE_MAX_M) when a Triton config
  serves `block_size`, else "mosaic" when the problem (m rows) is aligned for it; else "triton" on an sm >= 8.9 GPU
  when a Triton config serves `block_size`, else "xla". A config implies its implementation ("triton" for a
  TritonGemmConfig, "mosaic" for any other config object).
  """
  capability = _capability()
  if implementation is None and config is not None:
    implementation = "triton" if isinstance(config, TritonGemmConfig) else "mosaic"
  if implementation is None:
    if interpret or capability is None:
      return "xla"
    live_rows = m if live_rows is None else live_rows
    if (capability[0] == 9 and live_rows <= TRITON_DECODE_MAX_M
        and gemm_configs.heuristic_config(live_rows, n, k, block_size) is not None):
      return "triton"
    if capability[0] == 9 and mosaic_unsupported_reason(m, n, k, block_size) is None and _mosaic_module() is not None:
      return "mosaic"
    if capability >= (8, 9) and gemm_configs.heuristic_config(m, n, k, block_size) is not None:
      return "triton"
    return "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  where = f"the default device is {_device_kind()!r}"
  if implementation == "triton" and not interpret and (capability is None or capability < (8, 9)):
    raise ValueError(
        f"implementation='triton' needs an NVIDIA GPU with sm >= 8.9, but {where}; "
        "pass interpret=True to simulate it, or implementation='xla'")
  if implementation == "mosaic":
    if not interpret and (capability is None or capability[0] != 9):
      raise ValueError(
          f"implementation='mosaic' needs a Hopper (sm_90) GPU, but {where}; "
          "pass interpret=True to simulate it, or implementation='triton' / 'xla'")
    if reason := mosaic_unsupported_reason(m, n, k, block_size):
      raise ValueError(f"implementation='mosaic' cannot run M={m}, N={n}, K={k}, block_size={block_size}: {reason}; "
                       "use implementation='triton' or 'xla'")
    if error := _mosaic_import_error():
      raise ValueError(f"implementation='mosaic' is not available: {_MOSAIC_MODULE} cannot be imported ({error})")
  return implementation


def w8a8_block_fp8_matmul(
    a_q: jax.Array,
    b_q: jax.Array,
    a_s: jax.Array,
    b_s: jax.Array,
    block_size: tuple[int, int],
    *,
    a_s_column_major: bool = False,
    out_dtype=jnp.bfloat16,
    bias: jax.Array | None = None,
    implementation: str | None = None,
    config=None,
    out_rows: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
  """C = (a_q * a_s) @ (b_q * b_s)^T with block scales, accumulated in float32 (SPEC.md section 2).

  Args:
    a_q: (M, K) float8_e4m3fn activations.
    b_q: (N, K) float8_e4m3fn weight (K contiguous, the Hugging Face `weight` layout).
    a_s: float32 activation scales, one per row and gk columns: (M, ceil(K/gk)), or with a_s_column_major=True the
      (ceil(K/gk), M') array the quantizer writes with column-major scales (M' >= M; columns past M are ignored).
    b_s: (ceil(N/gn), ceil(K/gk)) float32 weight scales (`weight_scale_inv`).
    block_size: (gn, gk), the weight's scale block; gk is also the activations' group size.
    a_s_column_major: whether a_s is the column-major (ceil(K/gk), M') array.
    out_dtype: bfloat16 (default), float16 or float32.
    bias: optional (N,) floating array, added in float32 before the cast.
    implementation: "mosaic", "triton", "xla", or None for the best one here (see `resolve_implementation`).
    config: a TritonGemmConfig for "triton" (None: the tuned table or the heuristic), the Mosaic kernel's config
      for "mosaic"; must be None for "xla".
    out_rows: compute and return only the first out_rows rows; the later rows of a_q (and a_s) are padding, e.g.
      the zero rows of the quantizer's `row_alignment`, so that padded buffers go in without a slice. The Mosaic
      kernel reads them in whole 64-row tiles, which at M < 64 is faster than having TMA fill the missing rows
      (quantize with row_alignment=64 for that; `jaxfp8.linear` does).
    interpret: run Pallas kernels in interpret mode; None means True when there is no GPU.

  Returns:
    (M, N) array of out_dtype, or (out_rows, N).

  All arguments but the arrays are static: inside `jax.jit`, bind them with functools.partial or static_argnames.
  """
  _checks.array("a_q", a_q, (FP8,))
  _checks.array("b_q", b_q, (FP8,))
  _checks.array("a_s", a_s, (jnp.dtype(jnp.float32),))
  _checks.array("b_s", b_s, (jnp.dtype(jnp.float32),))
  gn, gk = _checks.block_size(block_size)
  block_size = (gn, gk)
  a_s_column_major = _checks.flag("a_s_column_major", a_s_column_major)
  interpret = _checks.interpret(interpret)
  out_dtype = _checks.float_dtype("out_dtype", out_dtype)
  m, k = a_q.shape
  n, k_b = b_q.shape
  if k_b != k:
    raise ValueError(f"a_q (M, K) and b_q (N, K) must share K: a_q has shape {tuple(a_q.shape)}, "
                     f"b_q has shape {tuple(b_q.shape)}")
  groups = -(-k // gk)
  n_blocks = -(-n // gn)
  if a_s_column_major:
    if a_s.shape[0] != groups or a_s.shape[1] < m:
      raise ValueError(
          f"column-major a_s must have shape (ceil(K/gk), M') = ({groups}, >= {m}) for K={k}, gk={gk}, M={m}; "
          f"got {tuple(a_s.shape)}")
  elif tuple(a_s.shape) != (m, groups):
    hint = " (pass a_s_column_major=True for the (ceil(K/gk), M') layout)" if a_s.shape[0] == groups else ""
    raise ValueError(
        f"a_s must have shape (M, ceil(K/gk)) = ({m}, {groups}) for K={k}, gk={gk}; got {tuple(a_s.shape)}{hint}")
  if tuple(b_s.shape) != (n_blocks, groups):
    raise ValueError(
        f"b_s must have shape (ceil(N/gn), ceil(K/gk)) = ({n_blocks}, {groups}) for N={n}, K={k}, "
        f"block_size={block_size}; got {tuple(b_s.shape)}")
  if bias is not None:
    _checks.array("bias", bias, OUT_DTYPES, ndim=None)
    if tuple(bias.shape) != (n,):
      raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
  if out_rows is not None and (isinstance(out_rows, bool) or not isinstance(out_rows, numbers.Integral)
                               or not 0 < out_rows <= m):
    raise ValueError(f"out_rows must be an int in [1, M={m}] (the rows of a_q to compute), got {out_rows!r}")
  out_rows = None if out_rows is None or out_rows == m else int(out_rows)

  interpret = _resolve_interpret(interpret)
  implementation = resolve_implementation(
      implementation, config=config, interpret=interpret, m=m, n=n, k=k, block_size=block_size,
      live_rows=out_rows or m)
  if implementation == "xla" and config is not None:
    raise ValueError(f"config applies to the 'triton' and 'mosaic' implementations, not 'xla'; got config={config!r}")
  if implementation == "triton":
    if config is None:
      config = triton_config(out_rows or m, n, k, block_size)
      if config is None:
        raise ValueError(
            f"no Triton config can serve block_size={block_size}: gk={gk} is not a multiple of "
            f"{gemm_triton.MIN_DOT_K} (the narrowest fp8 dot); use implementation='xla'")
    elif not isinstance(config, TritonGemmConfig):
      raise TypeError(f"config for implementation='triton' must be a TritonGemmConfig, got {type(config).__name__}")
    check_config(config, block_size)
  if implementation == "mosaic" and config is not None:
    expected = importlib.import_module(_MOSAIC_MODULE).MosaicGemmConfig
    if not isinstance(config, expected):
      raise TypeError(f"config for implementation='mosaic' must be a MosaicGemmConfig, got {type(config).__name__}")

  return _matmul(
      a_q, b_q, a_s, b_s, bias, block_size=block_size, a_s_column_major=a_s_column_major, out_dtype=out_dtype,
      implementation=implementation, config=config, interpret=interpret, out_rows=out_rows)


@functools.partial(jax.jit, static_argnames=(
    "block_size", "a_s_column_major", "out_dtype", "implementation", "config", "interpret", "out_rows"))
def _matmul(a_q, b_q, a_s, b_s, bias, *, block_size, a_s_column_major, out_dtype, implementation, config, interpret,
            out_rows):
  if out_rows is not None and implementation == "xla":
    # XLA slices the operands (the Pallas kernels below just leave the padding rows unread).
    a_q = a_q[:out_rows]
    a_s = a_s[:out_rows] if not a_s_column_major else a_s
    out_rows = None
  k = a_q.shape[1]
  m = out_rows or a_q.shape[0]
  n = b_q.shape[0]
  if bias is not None:
    bias = bias.astype(jnp.float32)
  if m == 0 or n == 0 or k == 0:
    # Nothing to multiply: an empty sum is 0 (plus the bias).
    out = jnp.zeros((m, n), jnp.float32)
    if bias is not None:
      out = out + bias[None, :]
    return out.astype(out_dtype)

  if implementation == "xla":
    return gemm_xla.block_fp8_matmul_xla(
        a_q, b_q, a_s, b_s, bias, block_size=block_size, a_s_column_major=a_s_column_major, out_dtype=out_dtype)

  if implementation == "triton":
    return gemm_triton.block_fp8_matmul(
        a_q, b_q, a_s, b_s, bias, block_size=block_size, a_s_column_major=a_s_column_major, out_dtype=out_dtype,
        config=config, interpret=interpret, out_rows=out_rows)

  # ---- implementation == "mosaic": the Hopper kernel of pallas_kernels/gemm_mosaic.py --------------------------------
  # It reads the column-major (K/128, M') scales with TMA, so M' must be a multiple of 4 (a_q's row count % 4 == 0
  # was checked).
  if a_s_column_major:
    a_s_col = a_s if a_s.shape[1] % 4 == 0 else a_s[:, :a_q.shape[0]]
  else:
    a_s_col = a_s.T
  mosaic = importlib.import_module(_MOSAIC_MODULE)
  interpret_kwargs = {"interpret": True} if interpret else {}
  return mosaic.block_fp8_matmul(
      a_q, b_q, a_s_col, b_s, out_dtype=out_dtype, bias=bias, config=config, out_rows=out_rows, **interpret_kwargs)


__all__ = ["IMPLEMENTATIONS", "OUT_DTYPES", "TritonGemmConfig", "w8a8_block_fp8_matmul", "resolve_implementation",
           "mosaic_unsupported_reason"]
