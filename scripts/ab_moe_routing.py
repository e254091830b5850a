"""A/B on the GPU of the MoE layer's route and dispatch: the compare-and-count versions (jaxfp8/moe) against the
sort-based ones they replaced (lax.top_k, argsort), compile time and CUPTI kernel time, one case per process:
`python3 scripts/ab_moe_routing.py CASE T [any]` with CASE in route_ds_new, route_ds_old, route_qw_new, route_qw_old,
dispatch_{new,old,cumsum} (E=32 of 256-expert ids), dispatch128_{new,old,cumsum} (E=128). A third argument "any"
lifts topk.PAIRWISE_MAX_COMPARES: the compare-and-count ops at every size (past it the library's top-k runs as
rounds of argmax, its dispatch as a running count per expert); "lax" sets topk.ROUNDS_MAX_K = 0 (lax.top_k past
the compare-and-count)."""
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from jaxfp8 import moe
from jaxfp8.moe import layer, topk
from jaxfp8.tools import timing


def ds_old(logits, bias, r=moe.DeepSeekV3Router()):
  scores = jax.nn.sigmoid(logits)
  t, e = scores.shape
  choice = scores + bias[None]
  group_scores = lax.top_k(choice.reshape(t, r.n_group, e // r.n_group), 2)[0].sum(-1)
  best_groups = lax.top_k(group_scores, r.topk_group)[1]
  allowed = jnp.zeros((t, r.n_group), bool).at[jnp.arange(t)[:, None], best_groups].set(True)
  ids = lax.top_k(jnp.where(jnp.repeat(allowed, e // r.n_group, axis=1), choice, -jnp.inf), r.top_k)[1]
  w = jnp.take_along_axis(scores, ids, axis=1)
  return ids, w / w.sum(-1, keepdims=True) * 2.5


def qw_old(logits):
  w, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), 8)
  return ids, w / w.sum(-1, keepdims=True)


def dispatch_old(ids, experts):
  key = jnp.where((ids >= 0) & (ids < experts), ids, experts).reshape(-1)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  sizes = jnp.bincount(key, length=experts + 1)[:experts]
  return order, rank, sizes, sizes.sum()


def dispatch_cumsum(ids, experts):
  """The counting sort on one scan per expert (XLA's GPU cumsum is a scan kernel)."""
  key = jnp.where((ids >= 0) & (ids < experts), ids, experts).reshape(-1)
  n = key.shape[0]
  buckets = jnp.arange(experts + 1, dtype=jnp.int32)
  counts = jnp.cumsum((key[None, :] == buckets[:, None]).astype(jnp.int32), axis=1)  # (E + 1, n) inclusive
  sizes = counts[:, -1]
  square = (experts + 1,) * 2
  lower = lax.broadcasted_iota(jnp.int32, square, 1) < lax.broadcasted_iota(jnp.int32, square, 0)
  offsets = jnp.sum(jnp.where(lower, sizes[None, :], 0), axis=1)
  rank = offsets[key] + counts[key, jnp.arange(n)] - 1
  order = jnp.zeros_like(rank).at[rank].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)
  return order, rank, sizes[:experts], offsets[experts]


def main(case, t):
  key = jax.random.key(t)
  if case.startswith("route"):
    e = 256 if "ds" in case else 128
    args = (jax.random.normal(key, (t, e)),) + ((jax.random.normal(key, (e,)) * 0.05,) if "ds" in case else ())
    fn = {"route_ds_new": moe.DeepSeekV3Router(), "route_ds_old": ds_old, "route_qw_new": moe.Qwen3MoeRouter(),
          "route_qw_old": qw_old}[case]
  else:
    experts, total = (128, 128) if "128" in case else (32, 256)
    args = (jax.random.randint(key, (t, 8), 0, total, jnp.int32),)
    impl = {"new": layer.dispatch, "old": dispatch_old, "cumsum": dispatch_cumsum}[case.rsplit("_", 1)[1]]
    fn = lambda ids: tuple(impl(ids, experts))
  fn = jax.jit(fn)
  start = time.time()
  compiled = fn.lower(*args).compile()
  print(f"{case} T={t}: compile {time.time() - start:.1f} s", flush=True)
  us, kernels = timing.median_kernel_us_and_kernels(compiled, [args], iterations=30)
  print(f"{case} T={t}: {us:.2f} us, {sum(k['launches_per_call'] for k in kernels):g} kernels: " +
        ", ".join(f"{k['name'][:40]} {k['us_per_call']:.1f}" for k in kernels[:6]), flush=True)


if __name__ == "__main__":
  if sys.argv[3:] == ["any"]:
    topk.PAIRWISE_MAX_COMPARES = 1 << 62
  if sys.argv[3:] == ["lax"]:
    topk.ROUNDS_MAX_K = 0
  main(sys.argv[1], int(sys.argv[2]))
