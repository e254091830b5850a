"""Grouped block-scaled FP8 GEMM for mixture-of-experts layers (docs/CONTRACT.md §7).

    ragged_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, group_sizes, block_size, ...)  -> (M, N)
    masked_w8a8_block_fp8_matmul(a_q, b_q, a_s, b_s, masked_m, block_size, ...)     -> (E, T, N)
    plan_for(a_q, b_q, block_size, ...)                                             -> GroupedPlan

Layout as for the dense GEMM: `api` (validation, the public functions), `planner` (`plan`, `run`), and one module per
backend (`xla`, `mosaic`).
"""

from jaxfp8.grouped.api import masked_w8a8_block_fp8_matmul, plan_for, ragged_w8a8_block_fp8_matmul, transformable
from jaxfp8.grouped.planner import IMPLEMENTATIONS, LAYOUTS, GroupedPlan, GroupedProblem, plan, problem, run

__all__ = [
    "ragged_w8a8_block_fp8_matmul", "masked_w8a8_block_fp8_matmul", "plan_for", "plan", "problem", "run",
    "transformable", "GroupedPlan", "GroupedProblem", "IMPLEMENTATIONS", "LAYOUTS",
]
