"""Block-scaled FP8 GEMM (docs/CONTRACT.md §2).

    w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, block_size, ...)  -> C
    plan_for(a_q, b_q, block_size, ...)                         -> GemmPlan: what a call runs, and why

Layout: `api` (validation, the public function), `planner` (`plan`, the one place a call is decided, and `run`),
and one module per backend (`xla`, `triton`, `mosaic`) that says what it can run and owns its heuristics and tables
(the Triton backend's tuned table lives in `configs/`).
"""

from jaxfp8.gemm.api import FP8, OUT_DTYPES, plan_for, transformable, w8a8_block_fp8_matmul
from jaxfp8.gemm.planner import (IMPLEMENTATIONS, TRITON_DECODE_MAX_M, GemmPlan, GemmProblem, plan, problem,
                                 row_alignment, run)
from pallas_kernels.gemm_triton import TritonGemmConfig

__all__ = [
    "w8a8_block_fp8_matmul", "plan_for", "plan", "problem", "run", "transformable", "row_alignment", "GemmPlan",
    "GemmProblem",
    "TritonGemmConfig", "IMPLEMENTATIONS", "OUT_DTYPES", "FP8", "TRITON_DECODE_MAX_M",
]
