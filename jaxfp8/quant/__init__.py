"""Per-token-group FP8 quantization of activations (docs/CONTRACT.md §1).

    per_token_group_quant_fp8(x, group_size, ...)          -> (q, scales)
    per_token_group_quant_fp8_row_padded(x, group_size)     -> buffers a block GEMM reads as they are
    plan(problem(...), implementation=None, ...)            -> QuantPlan: what a call runs, and why

Layout: `api` (validation, the public functions), `planner` (`plan`, the one place a call is decided, and `run`), and one
module per backend (`xla`, `triton`, `mosaic`) that says what it can run and owns its config heuristic.
"""

from jaxfp8.quant.api import (INPUT_DTYPES, per_token_group_quant_fp8, per_token_group_quant_fp8_row_padded,
                              transformable)
from jaxfp8.quant.planner import (IMPLEMENTATIONS, MOSAIC_MIN_ELEMENTS, SCALE_LAYOUTS, QuantPlan, QuantProblem, plan,
                               problem, run)

__all__ = [
    "per_token_group_quant_fp8", "per_token_group_quant_fp8_row_padded", "plan", "problem", "run", "transformable",
    "QuantPlan",
    "QuantProblem", "IMPLEMENTATIONS", "INPUT_DTYPES", "MOSAIC_MIN_ELEMENTS", "SCALE_LAYOUTS",
]
