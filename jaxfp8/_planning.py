"""What every op's planner does the same way: take the implementation a call asks for (or its config implies), and
check a given kernel config against the backend that will run it. The rules that choose between backends stay in
each op's planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The plan of a layer's step that XLA or one kernel runs (subclasses name the step in STEP)."""
  implementation: str
  config: Any
  interpret: bool
  reason: str
  STEP: ClassVar[str] = "step"

  def __str__(self) -> str:
    mode = " (interpreted)" if self.interpret and self.implementation != "xla" else ""
    config = f"; config {self.config}" if self.config is not None else ""
    return f"{self.implementation} {self.STEP}{mode}: {self.reason}{config}"


def requested(implementation: str | None, config, backends: Mapping[str, ModuleType], *, option: str,
              default: Callable[[], tuple[str, str]]) -> tuple[str, str]:
  """(implementation, reason): the one named by `option`, else the one whose config class `config` is, else
  `default()`'s choice."""
  if implementation is not None:
    if implementation not in backends:
      raise ValueError(f"{option} must be one of {tuple(backends)} or None, got {implementation!r}")
    return implementation, f"{option}={implementation!r} was asked for"
  if config is None:
    return default()
  for name, backend in backends.items():
    if backend.CONFIG_CLASS is not None and isinstance(config, backend.config_class()):
      return name, f"a {type(config).__name__} was given"
  names = [backend.CONFIG_CLASS for backend in backends.values() if backend.CONFIG_CLASS]
  kinds = " or a ".join(sorted(names, key=lambda name: "Mosaic" in name))  # the portable kernel's first
  raise TypeError(f"config must be a {kinds}, got {type(config).__name__}")


def given_config(backend: ModuleType, implementation: str, config, *, option: str,
                 kernels: tuple[str, ...] = ("triton", "mosaic")) -> None:
  """Refuses a config that is not `backend`'s kind (naming `option`'s value), or any config for XLA. `kernels`: the
  op's implementations that take a config."""
  if backend.CONFIG_CLASS is None:
    kinds = " and ".join(repr(name) for name in kernels)
    noun = "implementations" if len(kernels) > 1 else "implementation"
    raise ValueError(f"config applies to the {kinds} {noun}, not {implementation!r}; got config={config!r}")
  if not isinstance(config, backend.config_class()):
    raise TypeError(f"config for {option}={implementation!r} must be a {backend.CONFIG_CLASS}, "
                    f"got {type(config).__name__}")
