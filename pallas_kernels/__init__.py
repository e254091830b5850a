"""Pallas kernels of jaxfp8: one kernel per file, a frozen config dataclass, a thin launcher. No policy, no dispatch.

Mosaic GPU kernels (`*_mosaic.py`) target Hopper (sm_90); Triton-lowered kernels (`*_triton.py`) run on any sm >= 8.9 GPU.
Callers (the `jaxfp8` package) validate arguments and choose the kernel.
"""
