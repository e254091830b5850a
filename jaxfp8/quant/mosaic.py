"""The Mosaic GPU quantizer backend (Hopper): what it runs, its config heuristic, and its launch."""

from __future__ import annotations

import importlib

from jaxfp8 import _platform

KERNEL_MODULE = "pallas_kernels.quant_mosaic"
CONFIG_CLASS = "QuantMosaicConfig"
# About 16 KiB of input per CTA (16 rows x 512 bf16 at G = 128): 24 KiB of shared memory and about 64 values per
# thread, so that several CTAs share an SM and their TMA loads overlap each other's compute.
TARGET_BLOCK_BYTES = 16 * 1024


def _kernel():
  return importlib.import_module(KERNEL_MODULE)


def config_class():
  return _kernel().QuantMosaicConfig


def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Mosaic GPU quantizer", device, interpret, hopper=True,
                                      module=KERNEL_MODULE)


def unsupported(problem) -> str | None:
  found = _kernel().problems(group_size=problem.group_size, scale_layout=problem.scale_layout,
                             scale_ue8m0=problem.scale_ue8m0, dtype=problem.dtype,
                             fuse_silu_and_mul=problem.fuse_silu_and_mul,
                             gather_k=problem.k if problem.gather_divisor else None)
  return "; ".join(found) or None


def _pow2_floor(n: int) -> int:
  return 1 << (n.bit_length() - 1)


def default_config_for(problem, device: _platform.Device):
  """One 16-row block of about TARGET_BLOCK_BYTES per CTA; with few rows (decode), fewer rows per CTA while that
  leaves fewer than two CTAs per SM, so that the whole GPU pulls on the memory system."""
  itemsize = 4 if problem.dtype == "float32" else 2
  groups_per_block = _pow2_floor(max(1, TARGET_BLOCK_BYTES // (16 * problem.group_size * itemsize)))
  group_blocks = -(-problem.groups // min(groups_per_block, max(problem.groups, 1)))
  block_rows = 16
  while block_rows > 4 and problem.batch * -(-problem.scale_rows // block_rows) * group_blocks < 2 * device.num_sms:
    block_rows //= 2
  config = _kernel().QuantMosaicConfig(block_rows=block_rows, groups_per_block=groups_per_block)
  return config, f"{block_rows}-row blocks of {groups_per_block} groups (about two CTAs per SM or more)"


# The kernel clips each expert's valid row count to [0, rows] itself.
CLIPS_VALID_ROWS = True
# The kernel reads a gathering problem's rows through its source indices (one TMA load per row).
GATHERS_ROWS = True


def launch(x3, valid_rows, problem, config, interpret: bool, source=None):
  return _kernel().per_token_group_quant(
      x3, valid_rows, group_size=problem.group_size, eps=problem.eps, out_rows=problem.out_rows,
      scale_layout=problem.scale_layout, scale_cols=problem.scale_cols, scale_ue8m0=problem.scale_ue8m0,
      fuse_silu_and_mul=problem.fuse_silu_and_mul, config=config, interpret=interpret,
      pad_rows_written=problem.pad_rows_written, source=source,
      source_divisor=problem.gather_divisor or 1)
