"""Argument checks shared by the public entry points: each error names the argument and the value."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxfp8 import _platform

# The floating dtypes activations, weights and outputs may have.
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return int(value)


def flag(name: str, value) -> bool:
  """A boolean option: a bool (or NumPy bool), never a truthy string or number that would silently switch it on."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def interpret(value) -> bool | None:
  if value is not None and not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"interpret must be None or a bool, got {value!r}")
  return None if value is None else bool(value)


def float_dtype(name: str, value) -> jnp.dtype:
  """`value` as one of FLOAT_DTYPES (bfloat16, float16, float32)."""
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name} must be a floating dtype (bfloat16, float16 or float32), got {value!r}") from None
  if dtype not in FLOAT_DTYPES:
    raise ValueError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
  return dtype


def array(name: str, x, dtypes: Sequence[jnp.dtype], ndim: int | None = 2) -> None:
  """x is an array (or ShapeDtypeStruct) of one of `dtypes` with `ndim` dimensions (None: any)."""
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if jnp.dtype(x.dtype) not in dtypes:
    names = " or ".join(str(d) for d in dtypes)
    raise TypeError(f"{name} must have dtype {names}, got {x.dtype}")
  if ndim is not None and len(x.shape) != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def one_of(name: str, value, choices: tuple, *, none: bool = True):
  """value if it is one of `choices` (or None where `none`), else a ValueError naming the option."""
  if (value is None and none) or (value is not None and value in choices):
    return value
  raise ValueError(f"{name} must be one of {choices}{' or None' if none else ''}, got {value!r}")


def device(value):
  """A planner's device: None (the device programs are built for here) or a `jaxfp8._platform.Device`."""
  if value is not None and not isinstance(value, _platform.Device):
    raise TypeError(f"device must be a jaxfp8._platform.Device or None, got {type(value).__name__}")
  return value


def block_size(value) -> tuple[int, int]:
  """A weight scale block (gn, gk) of positive Python ints (static: a traced value is refused with the reason)."""
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise TypeError(f"block_size must be a pair (gn, gk) of positive ints, got {value!r}")
  if len(value) != 2:
    raise ValueError(f"block_size must be a pair (gn, gk), got {len(value)} values: {tuple(value)!r}")
  for name, v in zip(("gn", "gk"), value):
    if hasattr(v, "aval") or type(v).__name__.endswith("Tracer"):
      raise TypeError(f"block_size must be static Python ints, got a traced {name}={v!r}: under jax.jit, pass "
                      "block_size through static_argnames or functools.partial")
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      raise TypeError(f"block_size must be a pair of ints, got {name}={v!r} in {tuple(value)!r}")
    if v <= 0:
      raise ValueError(f"block_size must be positive, got {name}={v} in {tuple(value)!r}")
  return int(value[0]), int(value[1])


# float32(1/448): a scale is amax * R (docs/CONTRACT.md §0).
R = float(np.float32(1.0 / 448.0))
# The smallest scale eps may give. Below 2**-126 a scale is subnormal, and hardware that flushes subnormals would
# make an all-zero group's scale 0 and its codes 0/0 = NaN; below 2**-116, a subnormal input x (which such hardware
# reads as 0) could quantize to a nonzero code, |x / s| >= 2**-10. From 2**-116 on, every subnormal input gets code
# 0 whether or not it is flushed, so every backend agrees with the reference.
MIN_SCALE = 2.0**-116
MIN_EPS = float(np.nextafter(np.float32(MIN_SCALE / R), np.float32(np.inf)))


def eps(value) -> float:
  """The floor of a group's absolute maximum: a positive finite number whose scale eps * R is at least MIN_SCALE."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
    raise ValueError(f"eps must be a positive finite number, got {value!r}")
  if np.float32(value) * np.float32(R) < np.float32(MIN_SCALE):
    raise ValueError(f"eps must be at least {MIN_EPS:.4g} (its scale eps / 448 must be at least 2**-116, where "
                     f"float32 subnormals, which some hardware flushes to zero, cannot change a code), got {value!r}")
  return float(value)


def valid_rows(value, rows: int):
  """The live-row count of a call of `rows` rows: None, a Python int in [0, rows], or an integer array of shape ()
  (traced or not: taken as clipped to [0, rows], since a traced value cannot be checked). Returns None or an int32
  array of shape (): a Python int or host array checked or clipped here; an int32 device or traced count as it is,
  since every consumer clips it or only compares row indices against it (a clip here would be a kernel launch of its
  own); a device or traced count of another integer dtype clipped in that dtype, then cast."""
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"valid_rows must be an int or an integer scalar array, got {value!r}")
  if isinstance(value, numbers.Integral):
    if not 0 <= value <= rows:
      raise ValueError(f"valid_rows must be in [0, {rows}] (the rows of the call), got {value}")
    return jnp.asarray(int(value), jnp.int32)
  dtype = getattr(value, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"valid_rows must be an int or an integer scalar array, got {type(value).__name__}"
                    f"{'' if dtype is None else ' of dtype ' + str(dtype)}")
  if tuple(value.shape) != ():
    raise ValueError(f"valid_rows must be a scalar (shape ()), got shape {tuple(value.shape)}")
  if isinstance(value, np.ndarray):  # a host value: clipped exactly, whatever its dtype's width
    return jnp.asarray(min(max(int(value), 0), rows), jnp.int32)
  # Clipped in the count's own dtype before the cast to int32, which would wrap a wide or unsigned count
  # (uint32 2**31 + 1 or int64 2**32 + 2) into another value.
  value = jnp.asarray(value)
  if value.dtype == jnp.int32:
    return value
  info = jnp.iinfo(value.dtype)
  if info.min < 0:
    value = jnp.maximum(value, jnp.zeros((), value.dtype))
  if info.max > rows:
    value = jnp.minimum(value, jnp.asarray(rows, value.dtype))
  return value.astype(jnp.int32)
