"""Benchmark of the FP8 MoE layer (docs/CONTRACT.md §8) step by step, beside the same layer on bf16 weights:
`python -m jaxfp8 bench --ops=moe`.

Layers (one device's share; --moe_layers):
  deepseek_v3_ep8  DeepSeek-V3 under EP8: 32 local experts of 256, H=7168, I=2048, top-8 of 256 (its router on
                   256-expert logits; the ids of the 224 other experts fall outside [0, 32) and are skipped)
  qwen3_30b_a3b    Qwen3-30B-A3B: 128 experts, H=2048, I=768, top-8
  tiny             8 experts, H=256, I=128, top-2 (the CPU default: it checks the command)
  tiny_ep4         4 local of 16 experts, H=256, I=128, top-2 of 16 by DeepSeek-V3's router (a tiny expert-parallel
                   share: the CPU check of ids outside the local experts)
Rows, per layer and token count T (--tokens):
  the steps (role "part", `layer_steps`: the one list of the layer's steps and how each is built), each jitted alone
        on the previous steps' outputs: route (the gate's logits and the router), dispatch (the routed slots in expert
        order), quantize (the tokens, once), permute (the gathered rows' codes and scales), gate_up, silu_quant (the
        SiLU-and-mul quantizer), down, combine (the weighted sum back in token order); where the plan fuses a pair, one
        step stands for it and the pair is timed after it on its inputs (not summed): quantize_permute (the quantizer
        reading the rows in expert order; quantize_unfused, permute_unfused), gate_up_silu_quant (the quantizer in
        gate_up's epilogue; gate_up_unfused, silu_quant_unfused)
  "steps_summed" (summary) their sum, with non_gemm_share = (sum - gate_up - down) / sum
  "layer" (ours)   route + `jaxfp8.moe.fp8_moe` in one jit: what a model runs; "layer_unfused" (ours) the same with
        silu_quant_in_gate_up=False, where the plan puts the quantizer in gate_up's epilogue
  "ragged_dot_bf16", "pallas_ragged_bf16" (baselines)   route + the same layer on bf16 weights (dequantized once,
        outside the timing): sort, gather, gate_up, SiLU-and-mul, down, combine, on `jax.lax.ragged_dot` or, on a
        Hopper GPU, JAX's Pallas Mosaic GPU ragged dot (its fastest of PALLAS_CONFIGS)
Checks before timing, on four sampled tokens (among those with a local expert, where four have one): the layer's
output and the steps' final output against `jaxfp8.reference.fp8_moe` (§8's bound); each bf16 layer against the
float64 layer on the same dequantized weights (the same bound). Every row carries weight_stream_us, the time to read
the weights of the experts that received rows at 4.3 TB/s (the decode floor; x_weight_stream = time / that on the
layer-level rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import _platform, moe
from jaxfp8 import reference as ref
from jaxfp8.moe import combine as moe_combine
from jaxfp8.moe import layer as moe_layer
from jaxfp8.moe import planner as moe_planner
from jaxfp8.tools import bench_gemm, bench_report, timing

BLOCK = (128, 128)
F8 = jnp.float8_e4m3fn
MOE_BOUND = 1e-2  # docs/CONTRACT.md §8: relative Frobenius error of the layer's bf16 output


@dataclasses.dataclass(frozen=True)
class Layer:
  """One device's share of an MoE layer: `experts` of `total_experts` (the router's), hidden H, intermediate I."""
  experts: int
  total_experts: int
  hidden: int
  intermediate: int
  top_k: int
  family: str  # "deepseek_v3" or "qwen3": the router


LAYERS = {
    "deepseek_v3_ep8": Layer(32, 256, 7168, 2048, 8, "deepseek_v3"),
    "qwen3_30b_a3b": Layer(128, 128, 2048, 768, 8, "qwen3"),
    "tiny": Layer(8, 8, 256, 128, 2, "qwen3"),
    "tiny_ep4": Layer(4, 16, 256, 128, 2, "deepseek_v3"),
}
GPU_LAYERS = ("deepseek_v3_ep8", "qwen3_30b_a3b")
CPU_LAYERS = ("tiny",)
DEFAULT_TOKENS = (1, 64, 4096)
CPU_TOKENS = (1, 16)
ROLES = {"layer": "ours", "steps": "part", "ragged_dot_bf16": "baseline", "pallas_ragged_bf16": "baseline"}
XLA_COMBINE = moe_combine.CombinePlan("xla", None, False, "the bf16 layers combine as XLA does")
PALLAS_CONFIGS = ((64, 128, 64, 4, 1), (128, 128, 64, 4, 1), (128, 256, 64, 4, 8))


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of the layer: `fn` (jitted) maps the named `inputs` of the run's values to its named `outputs`."""
  name: str
  fn: Callable
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  gemm: bool = False


def layer_steps(plan: moe_planner.MoePlan, route: Callable) -> tuple[Step, ...]:
  """The FP8 layer's steps in order: route, then jaxfp8/moe/layer.py's named steps (`layer.steps(plan)`), each jitted on
  `plan`. The values start as x, gate_weight, bias and the expert weights (w13_q, w13_s, w2_q, w2_s); "out" is the
  layer's output."""
  def combine(y, d, ids, weights):
    return moe_layer.combine(y, d, weights, (ids >= 0) & (ids < plan.experts), jnp.bfloat16, plan)

  steps = (
      Step("route", jax.jit(route), ("x", "gate_weight", "bias"), ("ids", "weights")),
      Step("dispatch", jax.jit(lambda ids: moe_layer.dispatch(ids, plan.experts, plan)), ("ids",), ("d",)),
      *(_row_steps(plan) if not plan.permute_in_quantize else (
          Step("quantize_permute", jax.jit(lambda x, d: moe_layer.quantize_permute(x, d, plan)), ("x", "d"),
               ("a_q", "a_s")),)),
      *(_gate_up_steps(plan) if not plan.fused_silu_quant else (
          Step("gate_up_silu_quant",
               jax.jit(lambda a_q, a_s, d, w, s: moe_layer.gate_up_silu_quant(a_q, a_s, d, w, s, plan)),
               ("a_q", "a_s", "d", "w13_q", "w13_s"), ("h_q", "h_s"), gemm=True),)),
      Step("down", jax.jit(lambda h_q, h_s, d, w, s: moe_layer.down(h_q, h_s, d, w, s, plan)),
           ("h_q", "h_s", "d", "w2_q", "w2_s"), ("y",), gemm=True),
      Step("combine", jax.jit(combine), ("y", "d", "ids", "weights"), ("out",)),
  )
  assert tuple(step.name for step in steps[1:]) == moe_layer.steps(plan)
  return steps


def _row_steps(plan, suffix: str = "") -> tuple[Step, Step]:
  """quantize, then permute, as two steps (outputs named with `suffix`)."""
  return (Step("quantize" + suffix, jax.jit(lambda x: moe_layer.quantize(x, plan)), ("x",),
               ("x_q" + suffix, "x_s" + suffix)),
          Step("permute" + suffix, jax.jit(lambda x_q, x_s, d: moe_layer.permute(x_q, x_s, plan.top_k, d, plan)),
               ("x_q" + suffix, "x_s" + suffix, "d"), ("a_q" + suffix, "a_s" + suffix)))


def _gate_up_steps(plan, suffix: str = "") -> tuple[Step, Step]:
  """gate_up, then the SiLU-and-mul quantizer, as two steps (outputs named with `suffix`)."""
  return (Step("gate_up" + suffix, jax.jit(lambda a_q, a_s, d, w, s: moe_layer.gate_up(a_q, a_s, d, w, s, plan)),
               ("a_q", "a_s", "d", "w13_q", "w13_s"), ("h" + suffix,), gemm=True),
          Step("silu_quant" + suffix, jax.jit(lambda h, d: moe_layer.silu_quant(h, d, plan)), ("h" + suffix, "d"),
               ("h_q" + suffix, "h_s" + suffix)))


def run_steps(steps: Sequence[Step], values: dict, time_us: Callable) -> list[tuple[Step, object]]:
  """Runs the steps in order on `values` (which gains every step's outputs), timing each on its own inputs (each
  entry: the step and what `time_us` returned)."""
  timed = []
  for step in steps:
    args = tuple(values[name] for name in step.inputs)
    out = step.fn(*args)
    values.update(zip(step.outputs, out if len(step.outputs) > 1 else (out,)))
    timed.append((step, time_us(step.fn, [args])))
  return timed


# ---- the layer's weights, router and bf16 twin -----------------------------------------------------------------------

def _weights(key, e, n, k):
  """Random block-FP8 expert weights made on the device: codes across e4m3's range, scales near a trained layer's."""
  kq, ks = jax.random.split(key)
  return (jnp.clip(jax.random.normal(kq, (e, n, k)) * 64, -448, 448).astype(F8),
          jax.random.uniform(ks, (e, n // BLOCK[0], k // BLOCK[1]), minval=2e-5, maxval=2e-4))


def _dequantized(q, s):
  """(E, N, K) block-FP8 -> (E, K, N) bf16, the layout `ragged_dot` multiplies by."""
  w = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, BLOCK[0], axis=1), BLOCK[1], axis=2)
  return jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16)


def _router(layer: Layer):
  return (moe.DeepSeekV3Router(top_k=layer.top_k) if layer.family == "deepseek_v3" else
          moe.Qwen3MoeRouter(top_k=layer.top_k))


def _route_fn(layer: Layer, implementation: str | None = None):
  """The gate's logits and the router (its plan's implementation, or the one named). Ids of experts this device does
  not hold (>= its E) are skipped by the layer."""
  router = _router(layer)

  def route(x, gate_weight, bias):
    return router(router.logits(x, gate_weight), bias if router.uses_correction_bias else None,
                  implementation=implementation)
  return route


def _bf16_layer(dot, route):
  """Route, then the layer on bf16 weights (E, K, N): sort, gather, gate_up, SiLU-and-mul, down, combine."""
  def layer(x, gate_weight, bias, w13, w2):
    ids, weights = route(x, gate_weight, bias)
    (t, k), experts = ids.shape, w13.shape[0]
    d = moe_layer.dispatch(ids, experts)
    order, sizes = d.order, d.group_sizes
    h = dot(x[(jnp.arange(t * k, dtype=jnp.int32) // k)[order]], w13, sizes)
    i = h.shape[1] // 2
    act = (jax.nn.silu(h[:, :i].astype(jnp.float32)) * h[:, i:].astype(jnp.float32)).astype(jnp.bfloat16)
    y = dot(act, w2, sizes).astype(jnp.float32)
    valid = (ids >= 0) & (ids < experts)
    return moe_combine.combine(y, d.rank.reshape(t, k), weights, valid, jnp.bfloat16, XLA_COMBINE)
  return jax.jit(layer)


def _ragged_dot(a, w, sizes):
  return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _pallas_dot(config):
  def dot(a, w, sizes):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    bm, bn, bk, steps, gbn = config
    return ragged_dot_mgpu.ragged_dot(a, w, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk,
                                      max_concurrent_steps=steps, grid_block_n=gbn)
  return dot


# ---- checks ----------------------------------------------------------------------------------------------------------

def _fp8_reference(values: dict, pick: np.ndarray) -> np.ndarray:
  """§8's float64 chain on the picked tokens, cast as the layer casts (bf16)."""
  host = {name: np.asarray(values[name]) for name in ("x", "ids", "weights", "w13_q", "w13_s", "w2_q", "w2_s")}
  want = ref.fp8_moe(host["x"][pick], host["ids"][pick], host["weights"][pick], host["w13_q"], host["w13_s"],
                     host["w2_q"], host["w2_s"], BLOCK)
  return ref.cast_output(want, jnp.bfloat16).astype(np.float32)


@jax.jit
def _expert_f32(q, s):
  """One expert's (N, K) weight dequantized on the device (float32: within 2^-24 of the float64 product)."""
  return q.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, BLOCK[0], axis=0), BLOCK[1], axis=1)


def _bf16_reference(values: dict, pick: np.ndarray) -> np.ndarray:
  """The bf16 layer's float64 twin on the picked tokens: x @ W13^T, SiLU-and-mul, @ W2^T, weighted sum, with the
  dequantized weights (what the bf16 layer rounds to bf16)."""
  x = np.asarray(values["x"]).astype(np.float64)[pick]
  ids, weights = np.asarray(values["ids"])[pick], np.asarray(values["weights"], np.float64)[pick]
  out = np.zeros_like(x)
  for e in np.unique(ids[(ids >= 0) & (ids < values["w13_q"].shape[0])]):
    w13 = np.asarray(_expert_f32(values["w13_q"][e], values["w13_s"][e]), np.float64)
    w2 = np.asarray(_expert_f32(values["w2_q"][e], values["w2_s"][e]), np.float64)
    tokens, slots = np.nonzero(ids == e)
    h = x[tokens] @ w13.T
    i = h.shape[1] // 2
    act = h[:, :i] / (1 + np.exp(-h[:, :i])) * h[:, i:]
    np.add.at(out, tokens, weights[tokens, slots, None] * (act @ w2.T))
  return out


def _check(out, want: np.ndarray, pick: np.ndarray) -> dict:
  err = ref.relative_error(np.asarray(out, np.float32)[pick], want)
  return dict(rel_err=err, bound=MOE_BOUND, within_bound=bool(err <= MOE_BOUND))


# ---- the run ---------------------------------------------------------------------------------------------------------

def _layer_values(layer: Layer, key) -> dict:
  """The layer's weights and router parameters, made on the device."""
  k13, k2, kg, kb = jax.random.split(key, 4)
  w13_q, w13_s = _weights(k13, layer.experts, 2 * layer.intermediate, layer.hidden)
  w2_q, w2_s = _weights(k2, layer.experts, layer.hidden, layer.intermediate)
  return dict(w13_q=w13_q, w13_s=w13_s, w2_q=w2_q, w2_s=w2_s,
              # bfloat16, as the checkpoints store the gate
              gate_weight=(jax.random.normal(kg, (layer.total_experts, layer.hidden)) * 0.02).astype(jnp.bfloat16),
              bias=jax.random.uniform(kb, (layer.total_experts,), minval=-0.05, maxval=0.05))


def _counts(layer: Layer, t: int, ids: np.ndarray) -> dict:
  """The problem's sizes: local rows, the experts they touch, the bytes of those experts' weights and the time to
  read them at 4.3 TB/s, and the FLOPs and fewest bytes of the layer and of its two GEMMs."""
  h, i = layer.hidden, layer.intermediate
  local = (ids >= 0) & (ids < layer.experts)
  touched, rows = len(np.unique(ids[local])), int(local.sum())
  scale_bytes = lambda n, k: -(-n // BLOCK[0]) * -(-k // BLOCK[1]) * 4
  w13, w2 = 2 * i * h + scale_bytes(2 * i, h), h * i + scale_bytes(h, i)
  weights = touched * (w13 + w2)
  return dict(local_rows=rows, active_experts=touched, weight_stream_us=weights / bench_gemm.HBM_BYTES_PER_S * 1e6,
              flops=2 * rows * 3 * i * h, bytes=weights + 4 * t * h + layer.total_experts * h * 4,
              bf16_bytes=touched * 3 * i * h * 2 + 4 * t * h + layer.total_experts * h * 4,
              gate_up=dict(flops=2 * rows * 2 * i * h, bytes=touched * w13 + rows * (h + 2 * 2 * i)),
              down=dict(flops=2 * rows * h * i, bytes=touched * w2 + rows * (i + 4 * h)))


def _plan(layer: Layer, t: int, **options) -> moe_planner.MoePlan:
  local = layer.total_experts == layer.experts  # the router's experts are the layer's: a model on one device
  return moe_planner.plan(t, layer.top_k, layer.experts, layer.hidden, layer.intermediate, BLOCK, jnp.bfloat16,
                          moe_planner.MoeOptions(**{"every_id_local": local, **options}))


def run(name: str, tokens: Sequence[int], implementations: Sequence[str], *, iterations: int = 30, seed: int = 0,
        timer: Callable[..., float] | None = None, log=print) -> list[dict]:
  """Raw rows of the layer `name` (of LAYERS) at every token count: the steps, their sum, the layer, the bf16
  baselines (pallas_ragged_bf16 on a Hopper GPU only), each checked before it is timed."""
  layer = LAYERS[name]
  key = jax.random.key(seed)
  weights = _layer_values(layer, jax.random.fold_in(key, 0))
  route = _route_fn(layer)
  def time_us(fn, arg_sets):  # (us, the kernels on the GPU, else None)
    return timing.timed(fn, arg_sets, iterations=iterations, timer=timer)
  rng = np.random.default_rng(seed)
  bf16_weights: list = []
  rows: list[dict] = []
  for t in tokens:
    x = jax.random.normal(jax.random.fold_in(key, t), (t, layer.hidden), jnp.float32).astype(jnp.bfloat16)
    values = dict(weights, x=x)
    values["ids"], values["weights"] = jax.jit(route)(x, values["gate_weight"], values["bias"])
    counts = _counts(layer, t, np.asarray(values["ids"]))
    base = dict(shape=name, m=t, n=layer.intermediate, k=layer.hidden, tokens=t, groups=layer.experts,
                top_k=layer.top_k, family=layer.family, **{k: v for k, v in counts.items() if k not in (
                    "flops", "bytes", "bf16_bytes", "gate_up", "down")})
    # The checked tokens: among those with a local expert where there are enough (under expert parallelism a third
    # of the tokens have none, and four of those check nothing but zeros).
    ids = np.asarray(values["ids"])
    local = np.flatnonzero(((ids >= 0) & (ids < layer.experts)).any(axis=-1))
    pick = rng.choice(local if local.size >= min(4, t) else t, min(4, t), replace=False)
    plan = _plan(layer, t)

    def record(contender, role, **fields):
      row = dict(base, contender=contender, role=role, **fields)
      if "us" in row and role in ("ours", "baseline", "summary") and row["weight_stream_us"]:
        row["x_weight_stream"] = row["us"] / row["weight_stream_us"]  # none when no token chose a local expert
      rows.append(row)
      log(format_row(row))

    fp8_want = _fp8_reference(values, pick)
    if "layer" in implementations:
      _time_layer(plan, route, values, (fp8_want, pick), time_us, counts, record)
      if plan.fused_silu_quant:
        _time_layer(_plan(layer, t, silu_quant_in_gate_up=False), route, values, (fp8_want, pick), time_us, counts,
                    record, "layer_unfused")
    if "steps" in implementations:
      _time_steps(layer_steps(plan, route), values, (fp8_want, pick), time_us, counts, record)
      if plan.fused_silu_quant and "h_q" in values:
        _time_unfused(plan, values, time_us, record)
      if plan.permute_in_quantize and "a_q" in values:
        _time_quantize_then_permute(layer, t, values, time_us, record)
      if _platform.is_hopper() and "out" in values:
        _time_other_combine(layer, plan, t, values, time_us, record)
        _time_other_route(layer, values, time_us, record)
    baselines = [b for b in ("ragged_dot_bf16", "pallas_ragged_bf16") if b in implementations]
    if baselines:
      bf16_weights = bf16_weights or [_dequantized(weights["w13_q"], weights["w13_s"]),
                                      _dequantized(weights["w2_q"], weights["w2_s"])]
      bf16_want = _bf16_reference(values, pick)
      for baseline in baselines:
        _time_bf16(baseline, route, values, bf16_weights, (bf16_want, pick), time_us, counts, record)
  return rows


def _time_layer(plan, route, values, check, time_us, counts, record, contender: str = "layer") -> None:
  """The layer in one jit as `fp8_moe` runs `plan` (whose fused_silu_quant it asks for)."""
  fuse = plan.fused_silu_quant  # False where the plan could not fuse anyway: the same plan
  options = dict(silu_quant_in_gate_up=fuse, every_id_local=plan.every_id_local)
  fn = jax.jit(lambda x, gw, b, *w: moe.fp8_moe(x, *route(x, gw, b), *w, **options))
  args = tuple(values[name] for name in ("x", "gate_weight", "bias", "w13_q", "w13_s", "w2_q", "w2_s"))
  try:
    checked = _check(fn(*args), *check)
    us, kernels = time_us(fn, [args])
    record(contender, "ours", us=us, flops=counts["flops"], bytes=counts["bytes"], plan=str(plan),
           **bench_report.kernel_fields(kernels), **checked)
  except Exception as e:  # a failing contender is reported, not fatal for the others
    record(contender, "ours", error=f"{type(e).__name__}: {str(e)[:300]}")


def _time_steps(steps, values, check, time_us, counts, record) -> None:
  """Each step's row, then their sum (with the non-GEMM share and the check of the steps' final output)."""
  total = gemm_us = 0.0
  for step in steps:
    try:
      [(_, (us, kernels))] = run_steps([step], values, time_us)
    except Exception as e:  # the later steps need this one's outputs: the chain stops here
      record(step.name, "part", step=True, error=f"{type(e).__name__}: {str(e)[:300]}")
      return
    total += us
    gemm_us += us if step.gemm else 0.0
    record(step.name, "part", us=us, step=True, **bench_report.kernel_fields(kernels), **counts.get(step.name, {}))
  record("steps_summed", "summary", us=total, non_gemm_share=(total - gemm_us) / total, **_check(values["out"], *check))


def _time_unfused(plan, values, time_us, record) -> None:
  """gate_up and the SiLU-and-mul quantizer as two kernels again (the plan without the fused epilogue), on the fused
  step's inputs: their times ("gate_up_unfused", "silu_quant_unfused", not in the steps' sum) and the share of the
  live rows whose codes and scales equal the fused step's (one math library's exp in both: all of them expected)."""
  unfused = dataclasses.replace(plan, fused_silu_quant=False)
  try:
    timed = run_steps(_gate_up_steps(unfused, "_unfused"), values, time_us)
  except Exception as e:  # reported beside the others, not fatal
    record("gate_up_unfused", "part", error=f"{type(e).__name__}: {str(e)[:300]}")
    return
  ids = np.asarray(values["ids"]).reshape(-1)
  live = np.asarray(values["d"].rank)[(ids >= 0) & (ids < plan.experts)]  # the buffer rows of the local slots
  codes = [np.asarray(values[name])[live].view(np.uint8) for name in ("h_q", "h_q_unfused")]
  _record_unfused(timed, codes, [np.asarray(values[name])[:, live] for name in ("h_s", "h_s_unfused")], record)


def _record_unfused(timed, codes, scales, record) -> None:
  """The unfused steps' rows, each with the share of the live rows' codes and scales equal to the fused step's."""
  same = dict(same_codes=float(np.mean(codes[0] == codes[1])) if codes[0].size else 1.0,
              same_scales=float(np.mean(scales[0] == scales[1])) if scales[0].size else 1.0)
  for step, (us, kernels) in timed:
    record(step.name, "part", us=us, step=True, **bench_report.kernel_fields(kernels), **same)


def _time_quantize_then_permute(layer: Layer, t: int, values, time_us, record, **options) -> None:
  """quantize and permute as two steps again ("quantize_unfused", "permute_unfused": permute_in_quantize=False) on
  the same tokens and dispatch, with their codes and scales against the fused step's (all equal: the same quantizer)."""
  plan = _plan(layer, t, **dict(options, permute_in_quantize=False))
  try:
    timed = run_steps(_row_steps(plan, "_unfused"), values, time_us)
  except Exception as e:  # reported beside the others, not fatal
    record("quantize_unfused", "part", error=f"{type(e).__name__}: {str(e)[:300]}")
    return
  live = int(values["d"].live)
  codes = [np.asarray(values[name])[:live].view(np.uint8) for name in ("a_q", "a_q_unfused")]
  _record_unfused(timed, codes, [np.asarray(values[name])[..., :live] for name in ("a_s", "a_s_unfused")], record)


def _time_other_combine(layer: Layer, plan, t: int, values, time_us, record) -> None:
  """The combine step again on the implementation the plan did not pick (MoeOptions.combine_implementation), on the
  same inputs: its time, as "combine_<implementation>", and whether its output is the picked one's, bit for bit."""
  other = "xla" if plan.combine.implementation == "mosaic" else "mosaic"
  try:
    other_plan = _plan(layer, t, combine_implementation=other)
    fn = jax.jit(lambda y, d, ids, w: moe_layer.combine(y, d, w, (ids >= 0) & (ids < layer.experts), jnp.bfloat16,
                                                         other_plan))
    args = tuple(values[name] for name in ("y", "d", "ids", "weights"))
    same = np.asarray(fn(*args)).view(np.uint16).tobytes() == np.asarray(values["out"]).view(np.uint16).tobytes()
    us, kernels = time_us(fn, [args])
    record(f"combine_{other}", "part", us=us, step=True, bit_identical_to_picked=same,
           **bench_report.kernel_fields(kernels))
  except Exception as e:  # reported, not fatal for the other rows
    record(f"combine_{other}", "part", step=True, error=f"{type(e).__name__}: {str(e)[:300]}")


def _time_other_route(layer: Layer, values, time_us, record) -> None:
  """"route_<name>": the route on each router implementation its plan did not pick (same ids? weights_max_diff)."""
  router = _router(layer)
  logits = jax.eval_shape(router.logits, values["x"], values["gate_weight"])  # the routed logits' shape and dtype
  picked = router.explain(logits).implementation
  for other in (name for name in moe.routing.IMPLEMENTATIONS if name != picked):
    try:
      fn = jax.jit(_route_fn(layer, other))
      args = tuple(values[name] for name in ("x", "gate_weight", "bias"))
      ids, weights = fn(*args)
      same = bool(np.array_equal(np.asarray(ids), np.asarray(values["ids"])))
      diff = float(np.max(np.abs(np.asarray(weights) - np.asarray(values["weights"])), initial=0.0))
      us, kernels = time_us(fn, [args])
      record(f"route_{other}", "part", us=us, step=True, same_ids=same, weights_max_diff=diff,
             **bench_report.kernel_fields(kernels))
    except Exception as e:  # reported, not fatal for the other rows
      record(f"route_{other}", "part", step=True, error=f"{type(e).__name__}: {str(e)[:300]}")


def _time_bf16(baseline, route, values, bf16_weights, check, time_us, counts, record) -> None:
  """The bf16 layer on ragged_dot, or on the fastest Pallas config that builds (pallas_ragged_bf16)."""
  args = (values["x"], values["gate_weight"], values["bias"], *bf16_weights)
  dots = {"ragged_dot": _ragged_dot} if baseline == "ragged_dot_bf16" else {
      str(config): _pallas_dot(config) for config in PALLAS_CONFIGS}
  best, failures = None, []
  for label, dot in dots.items():
    fn = _bf16_layer(dot, route)
    try:
      checked = _check(fn(*args), *check)
      us, _ = time_us(fn, [args])
    except Exception as e:  # a Pallas config that does not build for this shape: the others may
      failures.append(f"{label}: {type(e).__name__}: {str(e)[:150]}")
      continue
    if best is None or us < best[0]:
      best = (us, label, checked)
  if best is None:
    record(baseline, "baseline", error="; ".join(failures))
    return
  note = None if baseline == "ragged_dot_bf16" else f"config {best[1]} (the fastest of PALLAS_CONFIGS)"
  record(baseline, "baseline", us=best[0], flops=counts["flops"], bytes=counts["bf16_bytes"], **best[2],
         **({"note": note} if note else {}))


def format_row(row: dict) -> str:
  head = f"{row['shape']:<16} T={row['tokens']:<5} {row['contender']:<20}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  extras = [f"rel err {row['rel_err']:.2e}{'' if row['within_bound'] else ' FAILED'}"] if "rel_err" in row else []
  if row.get("x_weight_stream"):
    extras.append(f"x{row['x_weight_stream']:.2f} weight stream ({row['weight_stream_us']:.1f} us)")
  if "non_gemm_share" in row:
    extras.append(f"non-GEMM {row['non_gemm_share']:.0%}")
  if "same_codes" in row:
    extras.append(f"as fused: codes {row['same_codes']:.4%}, scales {row['same_scales']:.4%}")
  return f"{head} {row['us']:10.1f} us  " + "  ".join(extras)


def summary_table(rows: list[dict]) -> str:
  """One line per (layer, T): each step's us, their sum and non-GEMM share, the layer (x the time to stream the
  touched experts' weights at 4.3 TB/s) and the bf16 layers."""
  steps = list(dict.fromkeys(r["implementation"] for r in rows if r.get("step")))
  by_key: dict = {}
  for r in rows:
    by_key.setdefault((r["shape"], r["m"]), {})[r["implementation"]] = r
  lines = ["MoE layer step by step (us): each step jitted alone; non-GEMM = the share of their sum outside gate_up "
           "(or gate_up_silu_quant) and down; *_unfused: the pair a fused step replaces, timed on its inputs, not "
           "summed; weight stream = the bytes of the experts that received rows / 4.3 TB/s.", "",
           "| layer | T | local rows | experts with rows | " + " | ".join(steps) +
           " | steps summed | non-GEMM | weight stream us | layer (x weight stream) | layer unfused | ragged_dot bf16 |"
           " Pallas bf16 | layer rel err |", "|---|---|---|---|" + "---|" * (len(steps) + 8)]
  for (shape, t), cells in by_key.items():
    any_row = next(iter(cells.values()))
    summed = cells.get("steps_summed", {})
    share = f"{summed['non_gemm_share']:.0%}" if "non_gemm_share" in summed else "-"
    err = f"{cells['layer']['rel_err']:.2e}" if "rel_err" in cells.get("layer", {}) else "-"
    tail = [bench_report.cell_us(cells.get("steps_summed")), share, f"{any_row['weight_stream_us']:.1f}",
            *(bench_report.cell_us(cells.get(c), "x_weight_stream") for c in ("layer", "layer_unfused")),
            *(bench_report.cell_us(cells.get(c)) for c in ("ragged_dot_bf16", "pallas_ragged_bf16")), err]
    lines.append(f"| {shape} | {t} | {any_row['local_rows']} | {any_row['active_experts']} | " +
                 " | ".join([*(bench_report.cell_us(cells.get(s)) for s in steps), *tail]) + " |")
  return "\n".join(lines) + "\n"
