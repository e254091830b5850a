"""What the kernels need of JAX that changes between releases, in one place (the kernels import nothing else of the
library). Each function says which JAX behaviour it answers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """The output type of a Pallas-Triton call on `operands`, varying over the manual mesh axes they vary over.

  Inside `jax.shard_map` with check_vma=True, JAX 0.11 refuses a Pallas-Triton output whose ShapeDtypeStruct has no
  manual axis type, even an empty one (the Mosaic GPU kernels derive theirs); outside shard_map it is empty.
  """
  mats = [m for m in (getattr(jax.typeof(o), "mat", None) for o in operands if o is not None) if m is not None]
  if not mats:  # a JAX without manual axis types on its avals
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))


def interpret_mode_forced() -> bool:
  """Whether `plgpu.force_gpu_interpret_mode()` / `set_gpu_interpret_mode()` makes every kernel interpret (a kernel
  then must not pass interpret params of its own)."""
  try:
    from jax._src import config as jax_config
    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None
  except AttributeError:  # a JAX without that switch has no forced interpret mode
    return False


def store_unoptimized(ref, value) -> None:
  """ref[...] = value in a Mosaic GPU kernel, whatever the transfer's coalescing or bank conflicts.

  JAX 0.12 checks that a register store to GMEM covers whole 32-byte sectors, and that one to SMEM avoids bank
  conflicts, unless the store is asked for unoptimized (`plgpu.store(..., optimized=False)`, new in 0.12); it refuses
  the strided store of column-major scales and some fp8 stores of a block's codes to SMEM. (`ref[...] = value` in
  0.12 is an optimized store that also loads the old value, the same way.) JAX 0.11 has neither the check nor that
  function, and stores every array as 0.12 does unoptimized.
  """
  store = getattr(plgpu, "store", None)
  if store is None:
    ref[...] = value
  else:
    store(ref, value, optimized=False)


def store_to_gmem(ref, value) -> None:
  """store_unoptimized(ref, value) from registers to GMEM, also for a single element, which Mosaic GPU 0.11.2 can only
  store to GMEM as a scalar: its one-element array store takes a shared-memory-only path."""
  if math.prod(value.shape) == 1:
    for _ in range(value.ndim):
      value = jnp.max(value, axis=0)  # the single element, as a scalar (NaN stays NaN)
    ref[(0,) * len(ref.shape)] = value
  else:
    store_unoptimized(ref, value)


def register_split_kept() -> bool:
  """Whether Mosaic GPU kernels keep `setmaxnreg`, the register split a warp-specialized pipeline makes between its
  producer and consumer warpgroups.

  JAX 0.11 compiles a kernel's PTX with the ptxas executable. JAX 0.12 compiles it through libnvJitLink whenever that
  library loads (it always does beside the CUDA 13 plugin: cuSPARSE needs it), as relocatable code, where ptxas ignores
  `setmaxnreg` (C7504): every warpgroup keeps the launch's share, 168 registers a thread with two consumers and 128
  with three, and consumers holding more spill. Seen on the H200: jaxlib's Mosaic GPU hard-wires that choice to
  "auto", so XLA's --xla_gpu_libnvjitlink_mode does not reach it; 0.12.1's plugin has no libnvptxcompiler to take
  instead (benchmarks/README.md, JAX 0.12).
  """
  major, minor = (int(part) for part in jax.__version__.split(".")[:2])
  return (major, minor) < (0, 12)
