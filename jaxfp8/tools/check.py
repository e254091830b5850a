"""`python -m jaxfp8 check` (the default command, `make run`): the main job.

Runs each op of the library on real-model shapes and checks it against the float64 reference (`jaxfp8.reference`):
  quant   `per_token_group_quant_fp8_row_padded` on activations of DeepSeek-V3 layer widths: scales bit for bit,
          codes at most one fp8 step off in at most 1e-4 of the values, pad rows zero with scale 1.0
          (docs/CONTRACT.md §1)
  linear  `w8a8_block_fp8_linear` on a DeepSeek-V3 and a Qwen3 weight of shapes.json at a few rows: relative error
          at most 5e-3 (bf16 output, §2 and §3)
  moe     `moe.fp8_moe_from_logits`, a small layer of each family (DeepSeek-V3's router with its correction bias,
          Qwen3-MoE's), against the float64 router and layer: relative error at most 1e-2 (§8)
and prints one table: op, shape, the implementation the planner chose and why (its `explain`), the error against the
reference, the check, the wall time of a call after its compilation. Exits 1 if any check fails.

Which implementations: the planner's choice for every case, and on a GPU every other implementation that runs
there. On CPU the Pallas kernels would run in interpret mode, which takes minutes: they are left out (the table says
so) unless named with --implementations.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from absl import flags

from jaxfp8.tools import args

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
flags.DEFINE_list("implementations", None, "Implementations to check (mosaic, triton, xla), for every op that has "
                  "them. Default: the planner's choice, and on a GPU every other one that runs there.", **_KW)
flags.DEFINE_string("m", None, "quant: row counts M, ','-separated (with --k: every (M, K) pair). Default: the "
                    "built-in cases.", **_KW)
flags.DEFINE_string("k", None, "quant: widths K, ','-separated (multiples of 128). Default: the built-in cases.",
                    **_KW)
flags.DEFINE_integer("seed", None, "Random seed of the inputs. Default: fresh.", **_KW)

GROUP = 128
BLOCK = (128, 128)
# Activations of DeepSeek-V3 layers (K = the input features of q_a/kv_a/gate_up, shared_expert_down, dense_down).
QUANT_CASES = ((1, 7168), (64, 7168), (13, 2048), (5, 18432))
# (shapes.json layer, rows): a DeepSeek-V3 and a Qwen3 projection at decode row counts.
LINEAR_CASES = (("deepseek_v3.q_a_proj", 5), ("qwen3_4b.qkv_proj", 3))
LINEAR_BOUND = 5e-3  # docs/CONTRACT.md §2: bf16 output
MOE_BOUND = 1e-2     # docs/CONTRACT.md §8: bf16 x
OP_IMPLEMENTATIONS = {"quant": ("mosaic", "triton", "xla"), "linear": ("mosaic", "triton", "xla"),
                      "moe": ("mosaic", "xla")}


@dataclasses.dataclass(frozen=True)
class MoeCase:
  """A small MoE layer: E experts, hidden H, intermediate I, T tokens, the family's router."""
  family: str
  experts: int
  hidden: int
  intermediate: int
  top_k: int
  tokens: int


MOE_CASES = (MoeCase("deepseek_v3", 16, 256, 128, 4, 24), MoeCase("qwen3", 16, 256, 128, 4, 24))


@dataclasses.dataclass(frozen=True)
class Case:
  """One check: the op, what it runs on (for the table), and `run(implementation, rng) -> Outcome`."""
  op: str
  shape: str
  run: Callable


class Refused(Exception):
  """The planner refuses the implementation asked for here (its ValueError's message)."""


def _plan(make):
  """make() -> a plan, its refusal (a ValueError) raised as Refused."""
  try:
    return make()
  except ValueError as e:
    raise Refused(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Outcome:
  name: str             # the implementation (of the GEMM, for the linear and the layer)
  implementation: str   # what ran: the plan's implementations
  why: str              # the planner's reason
  error: str            # the error against the reference, as the table shows it
  ok: bool
  ms: float | None


# ---- the cases -------------------------------------------------------------------------------------------------------

def _timed(fn):
  """(output, wall ms of a call after a first, compiling one)."""
  import jax
  jax.block_until_ready(fn())
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, (time.perf_counter() - start) * 1e3


def quant_case(m: int, k: int) -> Case:
  def run(implementation, rng) -> Outcome:
    import jax.numpy as jnp
    import numpy as np

    from jaxfp8 import quant
    from jaxfp8 import reference as ref
    p = quant.problem(1, m, k, "bfloat16", group_size=GROUP, eps=quant.planner.DEFAULT_EPS, row_alignment=4,
                      scale_layout="col", scale_tma_aligned=True)
    plan = _plan(lambda: quant.plan(p, implementation=implementation))
    x = jnp.asarray((rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 6, (m, 1)))).astype(np.float32),
                    jnp.bfloat16)
    (q, s), ms = _timed(lambda: quant.per_token_group_quant_fp8_row_padded(x, GROUP, implementation=implementation))
    ref_q, ref_s = ref.per_token_group_quant_fp8(np.asarray(x), GROUP, column_major_scales=True,
                                                 scale_tma_aligned=True, row_alignment=4)
    q, s = np.asarray(q), np.asarray(s)
    if q.shape != ref_q.shape or s.shape != ref_s.shape:
      return Outcome(plan.implementation, plan.implementation, plan.reason,
                     f"shapes {q.shape}, {s.shape} vs {ref_q.shape}, {ref_s.shape}", False, ms)
    scales_exact = np.array_equal(s.view(np.uint32), ref_s.view(np.uint32))
    distance = ref.fp8_code_distance(q, ref_q)
    off = int(np.count_nonzero(distance))
    pads_ok = not q[m:].view(np.uint8).any() and bool((s[:, m:] == 1.0).all())
    ok = scales_exact and pads_ok and int(distance.max()) <= 1 and off <= max(1, int(1e-4 * distance.size))
    error = (f"scales {'exact' if scales_exact else 'DIFFER'}, {off} codes off by <= {int(distance.max())}"
             f"{'' if pads_ok else ', pad rows BAD'}")
    return Outcome(plan.implementation, f"{plan.implementation} quantizer", plan.reason, error, ok, ms)
  return Case("quant", f"{m}x{k} activations", run)


def linear_case(layer: str, m: int) -> Case:
  [(name, n, k, _)] = args.parse_shapes(layer, numbers=False)

  def run(implementation, rng) -> Outcome:
    import jax.numpy as jnp
    import numpy as np

    import jaxfp8
    from jaxfp8 import reference as ref
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_q, w_s = jaxfp8.quantize_weight_blockwise(jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.02), BLOCK)
    plan = _plan(lambda: jaxfp8.linear.explain(x, w_q, BLOCK, implementation=implementation))
    y, ms = _timed(lambda: jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, BLOCK, implementation=implementation))
    want = ref.cast_output(ref.w8a8_block_fp8_linear(np.asarray(x), np.asarray(w_q), np.asarray(w_s), BLOCK),
                           np.float32)
    err = ref.relative_error(np.asarray(y, np.float32), want)
    return Outcome(plan.implementation, f"{plan.implementation} GEMM + {plan.quant_implementation} quantizer",
                   plan.reason,
                   f"rel err {err:.2e} (bound {LINEAR_BOUND:g})", bool(err <= LINEAR_BOUND), ms)
  return Case("linear", f"{name} {n}x{k}, M={m}", run)


def _router(case: MoeCase):
  from jaxfp8 import moe
  if case.family == "deepseek_v3":  # DeepSeek-V3's grouping, scaled down to 16 experts
    return moe.DeepSeekV3Router(top_k=case.top_k, n_group=4, topk_group=2)
  return moe.Qwen3MoeRouter(top_k=case.top_k)


def _reference_route(router, logits, bias):
  from jaxfp8 import reference as ref
  if bias is None:
    return ref.qwen3_moe_route(logits, top_k=router.top_k, norm_topk_prob=router.norm_topk_prob)
  return ref.deepseek_v3_route(logits, bias, top_k=router.top_k, n_group=router.n_group,
                               topk_group=router.topk_group, routed_scaling_factor=router.routed_scaling_factor,
                               norm_topk_prob=router.norm_topk_prob)


def moe_case(case: MoeCase) -> Case:
  def run(implementation, rng) -> Outcome:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfp8
    from jaxfp8 import moe
    from jaxfp8 import reference as ref
    e, h, i, t = case.experts, case.hidden, case.intermediate, case.tokens
    quantize = jax.vmap(lambda w: jaxfp8.quantize_weight_blockwise(w, BLOCK))
    w13_q, w13_s = quantize(jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.05, jnp.float32))
    w2_q, w2_s = quantize(jnp.asarray(rng.standard_normal((e, h, i)) * 0.05, jnp.float32))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    router = _router(case)
    logits = router.logits(x, jnp.asarray(rng.standard_normal((e, h)) * 0.05, jnp.float32))
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, e), jnp.float32) if router.uses_correction_bias else None
    plan = _plan(lambda: moe.explain(x, w13_q, w2_q, case.top_k, BLOCK, implementation=implementation))
    out, ms = _timed(lambda: moe.fp8_moe_from_logits(x, logits, w13_q, w13_s, w2_q, w2_s, BLOCK, router=router,
                                                     correction_bias=bias, implementation=implementation))
    ids, weights = _reference_route(router, np.asarray(logits), None if bias is None else np.asarray(bias))
    want = ref.fp8_moe(np.asarray(x), ids, weights, *(np.asarray(a) for a in (w13_q, w13_s, w2_q, w2_s)), BLOCK)
    err = ref.relative_error(np.asarray(out, np.float32), ref.cast_output(want, jnp.bfloat16).astype(np.float32))
    return Outcome(plan.gate_up.implementation,
                   f"{plan.gate_up.implementation} grouped GEMMs + {plan.quant_x.implementation} quantizers",
                   plan.gate_up.reason, f"rel err {err:.2e} (bound {MOE_BOUND:g}; router against float64 too)",
                   bool(err <= MOE_BOUND), ms)
  return Case("moe", f"{case.family} router, E={case.experts} H={case.hidden} I={case.intermediate} "
              f"top-{case.top_k}, T={case.tokens}", run)


def default_cases(quant_cases=QUANT_CASES) -> list[Case]:
  return ([quant_case(m, k) for m, k in quant_cases] + [linear_case(layer, m) for layer, m in LINEAR_CASES] +
          [moe_case(case) for case in MOE_CASES])


# ---- which implementations -------------------------------------------------------------------------------------------

def others_to_run(op: str, requested, on_gpu: bool) -> tuple[list[str | None], dict[str, str]]:
  """The implementations of `op` to check (None: the planner's choice) and why each other one is not checked."""
  names = OP_IMPLEMENTATIONS[op]
  if requested:
    skipped = {name: f"{op} has no {name} implementation" for name in requested if name not in names}
    return [name for name in requested if name in names], skipped
  if not on_gpu:
    return [None], {name: f"runs in interpret mode on CPU (slow): --implementations={name} checks it"
                    for name in names if name != "xla"}
  return [None, *names], {}


# ---- the run ---------------------------------------------------------------------------------------------------------

HEADER = ("op", "shape", "implementation", "error against the reference", "check", "ms", "why this implementation")


def _table(rows: list[tuple[str, ...]]) -> str:
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
  fmt = lambda cells: "  ".join(c.ljust(w) if i != 5 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([fmt(HEADER), "-" * (sum(widths) + 2 * len(widths)), *(fmt(r) for r in rows)])


def check(cases: list[Case], implementations=None, seed: int | None = None, log=print) -> int:
  """Runs every case with each implementation to check, prints the table; returns the number of failed checks."""
  import jax
  import numpy as np

  from jaxfp8 import _platform

  on_gpu = _platform.gpu_compute_capability() is not None
  log(f"jaxfp8 check on {jax.devices()[0].device_kind} (jax {jax.__version__}): each op against the float64 "
      "reference (docs/CONTRACT.md)" + ("" if on_gpu else "; CPU: wall times say nothing about GPU speed"))
  rng = np.random.default_rng(seed)
  todo, skipped = [], {}
  for case in cases:
    chosen, why_not = others_to_run(case.op, implementations, on_gpu)
    todo += [(case, name) for name in chosen]
    skipped.update({(case.op, name): why for name, why in why_not.items()})
  rows, failures, default = [], 0, {}
  started = time.perf_counter()
  for index, (case, name) in enumerate(todo, 1):
    if name is not None and default.get(id(case)) == name:
      continue  # the planner's choice, already checked
    log(f"[{index}/{len(todo)}, {time.perf_counter() - started:.1f} s] {case.op} {case.shape} "
        f"({name or 'the planner' + chr(39) + 's choice'})")
    try:
      outcome = case.run(name, rng)
    except Refused as e:
      if name is None or implementations:
        raise args.CommandError(f"{case.op} {case.shape}: {e}") from None
      skipped[(case.op, name)] = str(e).split(";")[0]
      continue
    except Exception as e:  # reported in the table, which shows every case
      outcome = Outcome(name or "?", name or "the planner's choice", "-",
                        f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", False, None)
    if name is None:
      default[id(case)] = outcome.name
    failures += not outcome.ok
    rows.append((case.op, case.shape, outcome.implementation, outcome.error, "ok" if outcome.ok else "FAILED",
                 "-" if outcome.ms is None else f"{outcome.ms:.1f}", outcome.why))
  log("")
  log(_table(rows))
  for (op, name), why in skipped.items():
    log(f"not checked: {op} {name}: {why}")
  log(f"{len(rows)} checks in {time.perf_counter() - started:.1f} s: " +
      (f"{failures} FAILED" if failures else "every output within the contract's bound of the float64 reference"))
  return failures


def main(command_line: str) -> int:
  del command_line
  known = sorted({name for names in OP_IMPLEMENTATIONS.values() for name in names})
  unknown = [i for i in FLAGS.implementations or () if i not in known]
  if unknown:
    raise args.UsageError(f"--implementations: unknown {unknown}; known: {', '.join(known)}")
  quant_cases = QUANT_CASES
  if FLAGS.m or FLAGS.k:
    ms = args.parse_ms(FLAGS.m) if FLAGS.m else (64,)
    ks = args.parse_ints(FLAGS.k, flag="--k") if FLAGS.k else (7168,)
    bad = [k for k in ks if k % GROUP]
    if bad:
      raise args.UsageError(f"--k: {bad} not a multiple of the group size {GROUP}")
    quant_cases = tuple((m, k) for m in ms for k in ks)
  return 1 if check(default_cases(quant_cases), FLAGS.implementations, FLAGS.seed) else 0
