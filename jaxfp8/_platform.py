"""The device kernels are built for, and whether a backend can run here.

Everything that asks "what GPU is this" or "can this backend be used" asks this module, so the answers are the same
in every planner: `device()` (the real default device, or the abstract H200 that `abstract_h200()` installs for
lowering GPU kernels on a CPU machine), `resolve_interpret` and `import_error`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import jax

# An H200 (and H100 SXM) has 132 SMs; lowering on CPU needs a number to size persistent grids.
H200_NUM_SMS = 132
# Device kinds of sm_90 (Hopper) parts, as JAX names them.
_HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


@dataclasses.dataclass(frozen=True)
class Device:
  """What the planners need to know of the device a program is built for."""
  kind: str                              # JAX's device_kind, e.g. "NVIDIA H200" or "cpu"
  capability: tuple[int, int] | None     # CUDA compute capability; None: not an NVIDIA GPU
  num_sms: int                           # SMs to size persistent grids for
  abstract: bool = False                 # lowering for an abstract device on a machine without it

  @property
  def is_hopper(self) -> bool:
    """An sm_90 GPU: the Mosaic GPU kernels run on it."""
    return self.capability is not None and self.capability[0] == 9

  @property
  def has_fp8(self) -> bool:
    """An NVIDIA GPU with FP8 conversions (sm >= 8.9): the Triton-lowered kernels run on it."""
    return self.capability is not None and self.capability >= (8, 9)

  def describe(self) -> str:
    if self.capability is None:
      return f"{self.kind!r} (no NVIDIA GPU)"
    abstract = ", abstract" if self.abstract else ""
    return f"{self.kind!r} (sm_{self.capability[0]}{self.capability[1]}{abstract})"


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


def _abstract_device():
  return jax.sharding.get_abstract_mesh().abstract_device


def abstract_device_capability() -> tuple[int, int] | None:
  """(9, 0) when the abstract mesh's device is a Hopper GPU (as set by `abstract_h200()`), else None."""
  abstract = _abstract_device()
  if abstract is not None and abstract.platform == "gpu" and any(k in abstract.device_kind for k in _HOPPER_KINDS):
    return (9, 0)
  return None


def device() -> Device:
  """The device programs traced now are built for (not cached: `abstract_h200()` changes it within a process)."""
  capability = gpu_compute_capability()
  if capability is not None:
    real = jax.devices()[0]
    return Device(real.device_kind, capability, getattr(real, "core_count", None) or H200_NUM_SMS)
  abstract = _abstract_device()
  if abstract_device_capability() is not None:
    return Device(abstract.device_kind, (9, 0), abstract.num_cores or H200_NUM_SMS, abstract=True)
  return Device(jax.devices()[0].device_kind, None, H200_NUM_SMS)


def has_fp8_gpu() -> bool:
  return device().has_fp8


def is_hopper() -> bool:
  return device().is_hopper


def num_sms() -> int:
  return device().num_sms


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret=None` means: interpret Pallas kernels when there is no GPU to run them on (never while lowering for
  the abstract H200, whose point is the compiled kernel)."""
  if interpret is not None:
    return bool(interpret)
  return device().capability is None


@functools.cache
def import_error(module: str) -> str | None:
  """Why `module` cannot be imported (None when it can): a backend whose kernel module is broken or missing (an
  older JAX without Mosaic GPU, say) must not take the other backends down with it."""
  try:
    importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 - any failure means: this backend is unavailable, and why
    return f"{type(e).__name__}: {e}"
  return None


@contextlib.contextmanager
def abstract_h200():
  """Trace as if for an H200, so `jax.export(..., platforms=["cuda"])` can lower Mosaic GPU kernels on CPU."""
  abstract = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=H200_NUM_SMS, platform="gpu")
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=abstract)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def unavailable_reason(name: str, device: Device, interpret: bool, *, hopper: bool, module: str) -> str | None:
  """Why backend `name` (a Mosaic GPU kernel when `hopper`, else a Triton-lowered one, living in `module`) cannot run
  here, as a phrase that follows "implementation='...'"; None when it can. Interpreted kernels run on any device."""
  if not interpret:
    if hopper and not device.is_hopper:
      return f"needs a Hopper (sm_90) GPU for {name}, but the device is {device.describe()}; pass interpret=True to simulate it"
    if not hopper and not device.has_fp8:
      return (f"needs an NVIDIA GPU with sm >= 8.9 for {name}, but the device is {device.describe()}; "
              "pass interpret=True to simulate it")
  if error := import_error(module):
    return f"is not available: {module} cannot be imported ({error})"
  return None
