"""The FP8 mixture-of-experts layer (docs/CONTRACT.md §8).

    fp8_moe(x, topk_ids, topk_weights, w13_q, w13_s, w2_q, w2_s, block_size)   -> (..., H)
    fp8_moe_from_logits(x, router_logits, ..., router=DeepSeekV3Router() or Qwen3MoeRouter())
    explain(x, w13_q, w2_q, top_k, block_size)                                 -> MoePlan
    expert_parallel_fp8_moe(...)                                               experts split over a mesh axis

Layout: `api` (validation, the public functions), `planner` (every step's plan), `layer` (the forward as named
steps on the live rows), `permute` (the permute's backends), `sort` (the decode dispatch's backends), `routing` (the two families' routers), `parallel`
(expert parallelism through `jax.shard_map` and all-to-all).
"""

from jaxfp8.moe import layer
from jaxfp8.moe.api import explain, fp8_moe, fp8_moe_from_logits, transformable
from jaxfp8.moe.parallel import expert_parallel_fp8_moe
from jaxfp8.moe.planner import MoeOptions, MoePlan
from jaxfp8.moe.routing import DeepSeekV3Router, Qwen3MoeRouter, Router

__all__ = ["layer", "fp8_moe", "fp8_moe_from_logits", "explain", "expert_parallel_fp8_moe", "transformable",
           "MoeOptions", "MoePlan", "DeepSeekV3Router", "Qwen3MoeRouter", "Router"]
