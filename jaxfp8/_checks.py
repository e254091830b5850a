"""Argument checks shared by the public entry points: each error names the argument and the value."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

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
