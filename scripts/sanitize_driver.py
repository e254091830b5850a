"""Runs one GPU kernel once at one shape, for compute-sanitizer (scripts/sanitize.sh).

  python3 scripts/sanitize_driver.py KERNEL SHAPE_INDEX

KERNEL is a name of scripts/reliability_kernels.py KERNELS, SHAPE_INDEX 0 (aligned) or 1 (unaligned). No timing code
is imported (CUPTI and compute-sanitizer conflict). Exits 3 when the kernel cannot run on this device.
"""

from __future__ import annotations

import os
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
import reliability_kernels as rk  # noqa: E402


def main() -> int:
  name, index = sys.argv[1], int(sys.argv[2])
  if why := rk.available(name):
    print(f"skip {name}: {why}")
    return 3
  shape = rk.KERNELS[name][2][index]
  fn, inputs = rk.make_call(name, shape, seed=1234 + index)
  jax.block_until_ready(fn(*inputs))
  print(f"ran {name} {shape}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
