"""Per-token-group FP8 quantization of activations (SPEC.md section 1): validation and dispatch.

Three implementations share one contract (x as (E, T, K_in), a vector of live rows per batch entry, the final padded
buffers written directly): "mosaic" (Pallas Mosaic GPU kernel, Hopper), "triton" (Pallas Triton-lowered kernel,
sm >= 8.9) and "xla" (jnp, any platform).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from jaxfp8 import _checks, _platform

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
INPUT_DTYPES = _checks.FLOAT_DTYPES

# Where each implementation's launcher lives; imported on first use so that CPU users never load GPU-only modules.
_LAUNCHERS = {
    "mosaic": ("pallas_kernels.quant_mosaic", "per_token_group_quant"),
    "triton": ("pallas_kernels.quant_triton", "per_token_group_quant"),
    "xla": ("jaxfp8.quant_xla", "per_token_group_quant"),
}


def _launcher(implementation: str):
  module, name = _LAUNCHERS[implementation]
  return getattr(importlib.import_module(module), name)


# On the H200 the Triton kernel is up to 0.16 us faster than the Mosaic one below about half a million values (a
# launch-bound regime), and the Mosaic kernel is faster above (up to 1.4x at 16384 x 18432); benchmarks/quant_h200.md.
MOSAIC_MIN_ELEMENTS = 1 << 19


def resolve_implementation(implementation: str | None, interpret: bool, num_elements: int | None = None) -> str:
  """The implementation a call runs: the one asked for if it can run here, else the best available.

  With implementation=None: on Hopper the Mosaic kernel for inputs of at least MOSAIC_MIN_ELEMENTS values (or when
  the size is not given) and the Triton kernel below; on other sm >= 8.9 GPUs the Triton kernel; elsewhere XLA.
  """
  if implementation is None:
    if _platform.is_hopper():
      if num_elements is not None and num_elements < MOSAIC_MIN_ELEMENTS:
        return "triton"
      return "mosaic"
    if _platform.has_fp8_gpu():
      return "triton"
    return "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  if interpret or implementation == "xla":
    return implementation
  if implementation == "mosaic" and not _platform.is_hopper():
    raise ValueError(
        f"implementation='mosaic' needs a Hopper (sm_90) GPU, but the default device is "
        f"{jax.devices()[0].device_kind!r}; pass interpret=True to simulate it, or implementation='xla'")
  if implementation == "triton" and not _platform.has_fp8_gpu():
    raise ValueError(
        f"implementation='triton' needs an NVIDIA GPU with sm >= 8.9, but the default device is "
        f"{jax.devices()[0].device_kind!r}; pass interpret=True to simulate it, or implementation='xla'")
  return implementation


_CONFIG_CLASSES = {
    "mosaic": ("pallas_kernels.quant_mosaic", "QuantMosaicConfig"),
    "triton": ("pallas_kernels.quant_triton", "QuantTritonConfig"),
}


def _check_config(implementation: str, config) -> None:
  if config is None:
    return
  if implementation == "xla":
    raise ValueError(f"config applies to the 'triton' and 'mosaic' quantizers, not 'xla'; got config={config!r}")
  module, name = _CONFIG_CLASSES[implementation]
  expected = getattr(importlib.import_module(module), name)
  if not isinstance(config, expected):
    raise TypeError(f"config for implementation={implementation!r} must be a {name}, got {type(config).__name__}")


def _validate_x(x) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"x must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in INPUT_DTYPES:
    raise TypeError(f"x must be bfloat16, float16 or float32, got dtype {x.dtype}")
  if x.ndim < 2:
    raise ValueError(f"x must have at least 2 dimensions (..., K), got shape {tuple(x.shape)}")
  return x


def per_token_group_quant_fp8(
    x: jax.Array,
    group_size: int,
    *,
    eps: float = 1e-10,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
    pack_ue8m0: bool = False,
    row_alignment: int = 1,
    fuse_silu_and_mul: bool = False,
    masked_m: jax.Array | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    config=None,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes activations to float8_e4m3fn with one float32 scale per `group_size` consecutive values of a row.

  Args:
    x: (..., K) bf16, fp16 or fp32; leading dims are flattened into M rows. With `masked_m`: (E, T, K).
    group_size: values per scale; K % group_size == 0 (K after SiLU-and-mul halves it).
    eps: floor of each group's absolute maximum.
    column_major_scales: return scales as (K/G, M_pad) ("M-major"), the layout block GEMMs read, instead of (M_pad, K/G).
    scale_tma_aligned: pad the column-major scale rows to a multiple of 4 floats (16 bytes), as TMA copies need.
    scale_ue8m0: round each scale up to a power of two.
    pack_ue8m0: return the scales as int32 words of four exponent bytes, column-major (needs scale_ue8m0).
    row_alignment: pad the rows of the outputs to a multiple of this; pad rows hold q = 0 and scale = 1.0.
    fuse_silu_and_mul: quantize silu(x[..., :H]) * x[..., H:] (K = H).
    masked_m: int32 (E,): rows t >= masked_m[e] of expert e are pad rows.
    implementation: "mosaic", "triton", "xla", or None for the best one on this device.
    interpret: run Pallas kernels in interpret mode; None means True when there is no GPU.
    config: a kernel config dataclass of the chosen implementation (None: its heuristic).

  Returns:
    (q, s): q (M_pad, K) e4m3fn ((E, T_pad, K) with masked_m) and the scales in the asked layout (SPEC.md section 1).
  """
  x = _validate_x(x)
  column_major_scales, scale_tma_aligned, scale_ue8m0, pack_ue8m0, fuse_silu_and_mul = (
      _checks.flag(name, value) for name, value in (
          ("column_major_scales", column_major_scales), ("scale_tma_aligned", scale_tma_aligned),
          ("scale_ue8m0", scale_ue8m0), ("pack_ue8m0", pack_ue8m0), ("fuse_silu_and_mul", fuse_silu_and_mul)))
  interpret = _checks.interpret(interpret)
  group_size = _checks.positive_int("group_size", group_size)
  row_alignment = _checks.positive_int("row_alignment", row_alignment)
  eps = _checks.eps(eps)
  if pack_ue8m0 and not scale_ue8m0:
    raise ValueError("pack_ue8m0=True requires scale_ue8m0=True (only power-of-two scales pack into exponent bytes)")
  if scale_tma_aligned and not (column_major_scales or pack_ue8m0):
    raise ValueError("scale_tma_aligned=True applies to column-major scales: pass column_major_scales=True")
  k_in = x.shape[-1]
  if fuse_silu_and_mul and k_in % 2:
    raise ValueError(f"fuse_silu_and_mul=True needs an even last dimension (gate and up halves), got {k_in}")
  k = k_in // 2 if fuse_silu_and_mul else k_in
  if k % group_size:
    raise ValueError(f"the quantized width K={k} must be a multiple of group_size={group_size}")

  if masked_m is None:
    x3 = x.reshape(1, -1, k_in)
  else:
    if x.ndim != 3:
      raise ValueError(f"with masked_m, x must be (E, T, K), got shape {tuple(x.shape)}")
    if not hasattr(masked_m, "dtype") or jnp.dtype(masked_m.dtype) != jnp.int32:
      raise TypeError(f"masked_m must be an int32 array, got {getattr(masked_m, 'dtype', type(masked_m).__name__)}")
    if tuple(masked_m.shape) != (x.shape[0],):
      raise ValueError(f"masked_m must have shape (E,) = ({x.shape[0]},), got {tuple(masked_m.shape)}")
    x3 = x

  interpret = _platform.resolve_interpret(interpret)
  if implementation is None and config is not None:
    # A kernel config names its kernel: honour it rather than a size-based default it does not fit.
    implementation = next((name for name, (module, cls) in _CONFIG_CLASSES.items()
                           if type(config).__name__ == cls and type(config).__module__ == module), None)
  implementation = resolve_implementation(implementation, interpret, num_elements=x3.shape[0] * x3.shape[1] * k)
  _check_config(implementation, config)
  scale_layout = "col_packed" if pack_ue8m0 else ("col" if column_major_scales else "row")
  q, s = _quantize(
      x3, masked_m, group_size=group_size, eps=float(eps), row_alignment=row_alignment, scale_layout=scale_layout,
      scale_tma_aligned=scale_tma_aligned, scale_ue8m0=bool(scale_ue8m0), fuse_silu_and_mul=bool(fuse_silu_and_mul),
      implementation=implementation, interpret=interpret, config=config)
  return q, s


@functools.partial(jax.jit, static_argnames=(
    "group_size", "eps", "row_alignment", "scale_layout", "scale_tma_aligned", "scale_ue8m0", "fuse_silu_and_mul",
    "implementation", "interpret", "config"))
def _quantize(x3, masked_m, **kwargs):
  q, s = _quantize_batched(x3, masked_m, **kwargs)
  if masked_m is None:  # inside the jit, dropping the unit batch axis is a free bitcast, not a copy kernel
    return q[0], s[0]
  return q, s


def _quantize_batched(x3, masked_m, *, group_size, eps, row_alignment, scale_layout, scale_tma_aligned, scale_ue8m0,
                      fuse_silu_and_mul, implementation, interpret, config):
  batch, rows, k_in = x3.shape
  k = k_in // 2 if fuse_silu_and_mul else k_in
  groups = k // group_size
  out_rows = _checks.round_up(rows, row_alignment)
  scale_cols = _checks.round_up(out_rows, 4) if scale_tma_aligned else out_rows
  if masked_m is None:
    valid_rows = jnp.full((batch,), rows, jnp.int32)
  else:
    valid_rows = jnp.clip(masked_m, 0, rows)
  if batch * out_rows == 0 or k == 0:
    # Nothing to launch: empty live rows, pad columns of the scales only.
    q = jnp.zeros((batch, out_rows, k), jnp.float8_e4m3fn)
    if scale_layout == "row":
      return q, jnp.ones((batch, out_rows, groups), jnp.float32)
    if scale_layout == "col":
      return q, jnp.ones((batch, groups, scale_cols), jnp.float32)
    return q, jnp.zeros((batch, -(-groups // 4), scale_cols), jnp.int32)
  return _launcher(implementation)(
      x3, valid_rows, group_size=group_size, eps=eps, out_rows=out_rows, scale_layout=scale_layout,
      scale_cols=scale_cols, scale_ue8m0=scale_ue8m0, fuse_silu_and_mul=fuse_silu_and_mul, config=config,
      interpret=interpret)


def per_token_group_quant_fp8_row_padded(
    x: jax.Array,
    group_size: int,
    *,
    eps: float = 1e-10,
    row_alignment: int = 4,
    implementation: str | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes into buffers a block GEMM takes as they are: rows padded to `row_alignment` (4: TMA and cuBLAS need
  M % 4 == 0), column-major scales (K/G, round_up(M_pad, 4)). Pad rows hold q = 0 and scale = 1.0.
  """
  return per_token_group_quant_fp8(
      x, group_size, eps=eps, column_major_scales=True, scale_tma_aligned=True, row_alignment=row_alignment,
      implementation=implementation, interpret=interpret)
