"""The Triton quantizer backend (any sm >= 8.9 GPU): what it runs, its config heuristic, and its launch."""

from __future__ import annotations

import importlib

from jaxfp8 import _platform

KERNEL_MODULE = "pallas_kernels.quant_triton"
CONFIG_CLASS = "QuantTritonConfig"


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


def config_class():
  return _kernel().QuantTritonConfig


def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Triton quantizer", device, interpret, hopper=False, module=KERNEL_MODULE)


def unsupported(problem) -> str | None:
  del problem  # any group size and layout
  return None


def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def default_config_for(problem, device: _platform.Device):
  """A 4-row by 512-column tile per program: many small programs in flight for the memory system (4-row tiles beat
  16- and 32-row ones at every M on the H200: git show d804edd:scripts/sweep_quant_triton.py)."""
  del device
  groups_per_block = max(1, 512 // _next_power_of_2(problem.group_size))
  groups_per_block = min(groups_per_block, _next_power_of_2(problem.groups))
  if problem.scale_layout == "col_packed":
    groups_per_block = max(4, groups_per_block)  # one int32 word holds four groups' exponents
  block_rows = min(4, _next_power_of_2(max(problem.out_rows, 1)))
  config = _kernel().QuantTritonConfig(block_rows=block_rows, groups_per_block=groups_per_block, num_warps=4)
  return config, f"{block_rows}-row tiles of {groups_per_block} groups"


def launch(x3, valid_rows, problem, config, interpret: bool):
  return _kernel().per_token_group_quant(
      x3, valid_rows, group_size=problem.group_size, eps=problem.eps, out_rows=problem.out_rows,
      scale_layout=problem.scale_layout, scale_cols=problem.scale_cols, scale_ue8m0=problem.scale_ue8m0,
      fuse_silu_and_mul=problem.fuse_silu_and_mul, config=config, interpret=interpret)
