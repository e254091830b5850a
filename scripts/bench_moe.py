"""The MoE layer (docs/CONTRACT.md §8) op by op, beside the same layer on bf16 weights; CUPTI kernel times on a GPU
(wall clock on CPU, where the numbers only check the script), every contender in one process.

Layers (one device's share):
  deepseek_v3_ep8  DeepSeek-V3 under EP8: 32 local experts of 256, H=7168, I=2048, top-8 of 256 (its router on
                   256-expert logits; the ids of the 224 other experts fall outside [0, 32) and are skipped)
  qwen3_30b_a3b    Qwen3-30B-A3B: 128 experts, H=2048, I=768, top-8
  tiny             8 experts, H=256, I=128, top-2 (a CPU check of this script)
Rows, per layer and token count T:
  fp8.<op>   the layer's ops, each jitted alone on the previous op's output: route (the gate's logits and the
             router), sort (the routed slots in expert order), quantize (the tokens, once), permute (the gathered
             rows' codes and scales), gate_up, silu_quant (fused SiLU-and-mul quantizer), down, combine (the weighted
             sum back in token order)
  fp8.layer  route + `jaxfp8.moe.fp8_moe` in one jit: what a model runs
  bf16.<impl>.layer  route + the same layer with bf16 weights (dequantized once, outside the timing): sort, gather,
             gate_up, SiLU-and-mul, down, combine, on `jax.lax.ragged_dot` (ragged_dot) or, on a Hopper GPU, JAX's
             Pallas Mosaic GPU ragged dot (pallas; its fastest of a few block configs)
The fp8 layer's output is checked against `jaxfp8.reference.fp8_moe` on sampled tokens first (§8's bound).

  PYTHONPATH=. python3 scripts/bench_moe.py OUT.json [--layers deepseek_v3_ep8,qwen3_30b_a3b] [--tokens 1,64,4096]
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxfp8 import _platform, grouped, moe, quant
from jaxfp8 import reference as ref
from jaxfp8.moe import layer as moe_layer
from jaxfp8.moe import planner as moe_planner
from jaxfp8.tools import bench, results, timing

BLOCK = (128, 128)
F8 = jnp.float8_e4m3fn
# name: (local experts E, all experts, H, I, top_k, family)
LAYERS = {
    "deepseek_v3_ep8": (32, 256, 7168, 2048, 8, "deepseek_v3"),
    "qwen3_30b_a3b": (128, 128, 2048, 768, 8, "qwen3"),
    "tiny": (8, 8, 256, 128, 2, "qwen3"),
}
PALLAS_CONFIGS = ((64, 128, 64, 4, 1), (128, 128, 64, 4, 1), (128, 256, 64, 4, 8))
GEMM_OPS = ("gate_up", "down")
FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["deepseek_v3_ep8", "qwen3_30b_a3b"], f"some of {', '.join(LAYERS)}")
flags.DEFINE_list("tokens", ["1", "64", "4096"], "token counts T")
flags.DEFINE_integer("iterations", 20, "calls per median")
flags.DEFINE_integer("seed", 0, "random weights, tokens and router logits")


def _weights(key, e, n, k):
  """Random block-FP8 expert weights made on the device: codes across e4m3's range, scales near a trained layer's."""
  kq, ks = jax.random.split(key)
  q = jnp.clip(jax.random.normal(kq, (e, n, k)) * 64, -448, 448).astype(F8)
  s = jax.random.uniform(ks, (e, n // BLOCK[0], k // BLOCK[1]), minval=2e-5, maxval=2e-4)
  return q, s


def _dequantized(q, s):
  """(E, N, K) block-FP8 -> (E, K, N) bf16, the layout `ragged_dot` multiplies by."""
  w = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, BLOCK[0], axis=1), BLOCK[1], axis=2)
  return jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)


def _router(family, top_k):
  if family == "deepseek_v3":
    return moe.DeepSeekV3Router(top_k=top_k)
  return moe.Qwen3MoeRouter(top_k=top_k)


def _route_fn(router):
  """The gate's logits and the router. Ids of experts this device does not hold (>= its E) are skipped by the layer."""
  def route(x, gate_weight, bias):
    return router(router.logits(x, gate_weight), bias if router.uses_correction_bias else None)
  return route


def _fp8_ops(plan: moe_planner.MoePlan):
  """The layer's steps (jaxfp8/moe/layer.py) as separate jitted functions, in its order."""
  def sort(ids):
    return moe_layer.dispatch(ids, plan.experts)

  def permute(x_q, x_s, d, k):
    return moe_layer.permute(x_q, x_s, jnp.arange(d.order.shape[0], dtype=jnp.int32) // k, d, plan)

  def combine(y, d, ids, weights):
    return moe_layer.combine(y, d, weights, (ids >= 0) & (ids < plan.experts), jnp.bfloat16)

  return dict(sort=jax.jit(sort), quantize=jax.jit(lambda x: moe_layer.quantize(x, plan)),
              permute=jax.jit(permute, static_argnums=3),
              gate_up=jax.jit(lambda a_q, a_s, d, w, s: moe_layer.gate_up(a_q, a_s, d, w, s, plan)),
              silu_quant=jax.jit(lambda h, d: moe_layer.silu_quant(h, d, plan)),
              down=jax.jit(lambda h_q, h_s, d, w, s: moe_layer.down(h_q, h_s, d, w, s, plan)),
              combine=jax.jit(combine))


def _bf16_layer(dot):
  """The same layer on bf16 weights (E, K, N): sort, gather, gate_up, SiLU-and-mul, down, combine."""
  def layer(x, ids, weights, w13, w2):
    t, k = ids.shape
    experts = w13.shape[0]
    d = moe_layer.dispatch(ids, experts)
    order, sizes = d.order, d.group_sizes
    a = x[(jnp.arange(t * k, dtype=jnp.int32) // k)[order]]
    h = dot(a, w13, sizes)
    i = h.shape[1] // 2
    act = (jax.nn.silu(h[:, :i].astype(jnp.float32)) * h[:, i:].astype(jnp.float32)).astype(jnp.bfloat16)
    y = dot(act, w2, sizes).astype(jnp.float32)
    owned = jnp.arange(t * k) < sizes.sum()
    y = jnp.where(owned[:, None], y, 0.0)  # rows past the groups: ragged_dot leaves them zero; a kernel may not
    return moe_layer.combine(y, d, weights, (ids >= 0) & (ids < experts), jnp.bfloat16)
  return layer


def _ragged_dot(a, w, sizes):
  return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _pallas_dot(config):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  bm, bn, bk, steps, gbn = config

  def dot(a, w, sizes):
    return ragged_dot_mgpu.ragged_dot(a, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk,
                                      max_concurrent_steps=steps, grid_block_n=gbn)
  return dot


def _timer(on_gpu):
  return timing.median_kernel_us if on_gpu else bench.median_wall_us


def _check(out, x, ids, weights, w13_q, w13_s, w2_q, w2_s, rng) -> float:
  """Relative error of sampled tokens' outputs against the float64 reference."""
  pick = rng.choice(x.shape[0], min(4, x.shape[0]), replace=False)
  expect = ref.fp8_moe(np.asarray(x[pick]), np.asarray(ids[pick]), np.asarray(weights[pick]), np.asarray(w13_q),
                       np.asarray(w13_s), np.asarray(w2_q), np.asarray(w2_s), BLOCK)
  got = np.asarray(out[pick], np.float32)
  return ref.relative_error(got, ref.cast_output(expect, jnp.bfloat16).astype(np.float32))


def run_layer(name, tokens, *, iterations, seed, on_gpu, log=print) -> list[dict]:
  local, total, h, i, top_k, family = LAYERS[name]
  key = jax.random.key(seed)
  k13, k2, kx, kg, kb = jax.random.split(key, 5)
  w13_q, w13_s = _weights(k13, local, 2 * i, h)
  w2_q, w2_s = _weights(k2, local, h, i)
  gate_weight = jax.random.normal(kg, (total, h), jnp.float32) * 0.02
  bias = jax.random.uniform(kb, (total,), minval=-0.05, maxval=0.05)
  router = _router(family, top_k)
  route = jax.jit(_route_fn(router))
  time_us = functools.partial(_timer(on_gpu), iterations=iterations)
  rng = np.random.default_rng(seed)
  rows = []
  for t in tokens:
    x = jax.random.normal(jax.random.fold_in(kx, t), (t, h), jnp.float32).astype(jnp.bfloat16)
    ids, weights = route(x, gate_weight, bias)
    plan = moe_planner.plan(t, top_k, local, h, i, BLOCK, jnp.bfloat16)  # what fp8_moe plans by default
    layer = jax.jit(lambda x, gw, b, *w: moe.fp8_moe(x, *route(x, gw, b), *w))
    experts = (w13_q, w13_s, w2_q, w2_s)
    out = layer(x, gate_weight, bias, *experts)
    err = _check(out, x, ids, weights, *experts, rng)
    base = dict(layer=name, tokens=t, routed_rows=t * top_k, local_rows=int(((np.asarray(ids) >= 0) & (np.asarray(ids) < local)).sum()),
                experts=local, hidden=h, intermediate=i, top_k=top_k, plan=str(plan))

    def record(contender, us, **extra):
      rows.append(dict(base, contender=contender, us=us, **extra))
      log(f"  {name:<16} T={t:<5} {contender:<22} {us:10.1f} us" +
          "".join(f"  {key}={value:.3g}" if isinstance(value, float) else f"  {key}={value}"
                  for key, value in extra.items()))

    record("fp8.layer", time_us(layer, [(x, gate_weight, bias, *experts)]), rel_err=err,
           within_bound=bool(err <= 1e-2))
    ops = _fp8_ops(plan)
    record("fp8.route", time_us(route, [(x, gate_weight, bias)]))
    d = ops["sort"](ids)
    record("fp8.sort", time_us(ops["sort"], [(ids,)]))
    x_q, x_s = ops["quantize"](x)
    record("fp8.quantize", time_us(ops["quantize"], [(x,)]))
    a_q, a_s = ops["permute"](x_q, x_s, d, top_k)
    record("fp8.permute", time_us(lambda *a: ops["permute"](*a, top_k), [(x_q, x_s, d)]))
    hid = ops["gate_up"](a_q, a_s, d, w13_q, w13_s)
    record("fp8.gate_up", time_us(ops["gate_up"], [(a_q, a_s, d, w13_q, w13_s)]))
    h_q, h_s = ops["silu_quant"](hid, d)
    record("fp8.silu_quant", time_us(ops["silu_quant"], [(hid, d)]))
    y = ops["down"](h_q, h_s, d, w2_q, w2_s)
    record("fp8.down", time_us(ops["down"], [(h_q, h_s, d, w2_q, w2_s)]))
    record("fp8.combine", time_us(ops["combine"], [(y, d, ids, weights)]))
    by_op = {r["contender"]: r["us"] for r in rows if r["tokens"] == t and r["layer"] == name}
    op_sum = sum(us for c, us in by_op.items() if c.startswith("fp8.") and c != "fp8.layer")
    gemm = sum(by_op[f"fp8.{op}"] for op in GEMM_OPS)
    record("fp8.ops_summed", op_sum, non_gemm_share=(op_sum - gemm) / op_sum)

    w13_bf16, w2_bf16 = _dequantized(w13_q, w13_s), _dequantized(w2_q, w2_s)
    dots = {"ragged_dot": _ragged_dot}
    if on_gpu and _platform.gpu_compute_capability() == (9, 0):
      dots.update({f"pallas{config}": _pallas_dot(config) for config in PALLAS_CONFIGS})
    best_pallas = None
    for dot_name, dot in dots.items():
      bf16 = jax.jit(lambda x, gw, b, w13, w2, dot=dot: _bf16_layer(dot)(x, *route(x, gw, b), w13, w2))
      try:
        us = time_us(bf16, [(x, gate_weight, bias, w13_bf16, w2_bf16)])
      except Exception as e:  # a Pallas config that does not build for this shape: reported, not fatal
        log(f"  {name} T={t} bf16.{dot_name}: {type(e).__name__}: {str(e)[:200]}")
        continue
      if dot_name == "ragged_dot":
        record("bf16.ragged_dot.layer", us)
      elif best_pallas is None or us < best_pallas[0]:
        best_pallas = (us, dot_name)
    if best_pallas:
      record("bf16.pallas.layer", best_pallas[0], config=best_pallas[1])
    del w13_bf16, w2_bf16
  return rows


def markdown(result: dict) -> str:
  lines = ["| layer | T | contender | us | note |", "|---|---|---|---|---|"]
  for r in result["rows"]:
    note = []
    if "rel_err" in r:
      note.append(f"rel err {r['rel_err']:.2e}")
    if "non_gemm_share" in r:
      note.append(f"non-GEMM {r['non_gemm_share']:.0%}")
    if "config" in r:
      note.append(r["config"])
    lines.append(f"| {r['layer']} | {r['tokens']} | {r['contender']} | {r['us']:.1f} | {'; '.join(note)} |")
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: bench_moe.py OUT.json [flags]")
  unknown = [name for name in FLAGS.layers if name not in LAYERS]
  if unknown:
    raise app.UsageError(f"--layers: unknown {unknown}; known: {list(LAYERS)}")
  on_gpu = _platform.gpu_compute_capability() is not None
  tokens = [int(t) for t in FLAGS.tokens]
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, timing="CUPTI kernel time, median"
                if on_gpu else "wall clock on CPU (checks the script only)", command=" ".join(sys.argv), rows=[])
  for name in FLAGS.layers:
    print(f"{name}: T {tokens}")
    result["rows"] += run_layer(name, tokens, iterations=FLAGS.iterations, seed=FLAGS.seed, on_gpu=on_gpu)
    results.write_results(result, argv[1], markdown)
  print(markdown(result))


if __name__ == "__main__":
  app.run(main)
