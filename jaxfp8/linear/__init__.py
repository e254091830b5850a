"""The block-FP8 linear (docs/CONTRACT.md §3): quantize the activations, block-scaled GEMM, one call.

    w8a8_block_fp8_linear(x, w_q, w_s, block_size, bias=None, ...)   -> y (..., N)
    explain(x, w_q, block_size, ...)                                  -> LinearPlan: both kernels, configs, reasons
    column_parallel_linear / row_parallel_linear                      -> the same, tensor-parallel (shard_map)

Layout: `api` (validation, the public functions), `planner` (the linear's plan: the GEMM's and the quantizer's plans,
and `apply`), `buckets` (row buckets of eager calls, `pad_to_bucket`), `eager` (the executable cache of eager calls),
`parallel` (tensor parallelism), `backward` (the gradient).
"""

from jaxfp8.linear import backward
from jaxfp8.linear.api import IMPLEMENTATIONS, explain, w8a8_block_fp8_linear
from jaxfp8.linear.buckets import RowBuckets, get_row_buckets, pad_to_bucket, row_buckets, set_row_buckets
from jaxfp8.linear.eager import CacheInfo, cache_clear, cache_info
from jaxfp8.linear.parallel import (PARALLEL_MODES, column_parallel_linear, row_parallel_linear, shard_linear_weights,
                                    weight_sharding, weight_spec)
from jaxfp8.linear.planner import LinearOptions, LinearPlan

__all__ = [
    "w8a8_block_fp8_linear", "explain", "LinearPlan", "LinearOptions", "RowBuckets", "get_row_buckets",
    "set_row_buckets", "row_buckets", "pad_to_bucket", "cache_info", "cache_clear", "CacheInfo",
    "column_parallel_linear", "row_parallel_linear", "weight_spec", "weight_sharding", "shard_linear_weights",
    "IMPLEMENTATIONS", "PARALLEL_MODES", "backward",
]
