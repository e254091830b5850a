"""What the current JAX backend can run, and the abstract H200 used to lower GPU kernels on CPU."""

from __future__ import annotations

import contextlib
import functools

import jax

# An H200 (and H100 SXM) has 132 SMs; lowering on CPU needs a number to size persistent grids.
H200_NUM_SMS = 132


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the default device if it is an NVIDIA GPU, else None."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return None
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return None
  major, minor = str(capability).split(".")[:2]
  return int(major), int(minor)


# Device kinds of sm_90 (Hopper) parts, as JAX names them.
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def abstract_device_capability() -> tuple[int, int] | None:
  """(9, 0) when the abstract mesh's device is a Hopper GPU (as set by `abstract_h200()`), else None."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  if device is not None and device.platform == "gpu" and any(k in device.device_kind for k in _HOPPER_KINDS):
    return (9, 0)
  return None


def has_fp8_gpu() -> bool:
  """An NVIDIA GPU with FP8 conversions (sm >= 8.9): the Triton-lowered kernels run on it."""
  cc = gpu_compute_capability()
  return cc is not None and cc >= (8, 9)


def is_hopper() -> bool:
  """An sm_90 GPU (H100, H200): the Mosaic GPU kernels run on it."""
  cc = gpu_compute_capability()
  return cc is not None and cc[0] == 9


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret=None` means: interpret the Pallas kernels when there is no GPU to run them on."""
  if interpret is None:
    return gpu_compute_capability() is None
  return bool(interpret)


def num_sms() -> int:
  """SMs of the device kernels are built for (the abstract one when lowering on CPU)."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None and abstract.num_cores:
    return abstract.num_cores
  # Inside shard_map on a CPU mesh the abstract device has no core count: size grids for an H200.
  device = jax.devices()[0]
  return getattr(device, "core_count", None) or H200_NUM_SMS


@contextlib.contextmanager
def abstract_h200():
  """Trace as if for an H200, so `jax.export(..., platforms=["cuda"])` can lower Mosaic GPU kernels on CPU."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=H200_NUM_SMS, platform="gpu")
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield
