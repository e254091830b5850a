"""`python -m jaxfp8 check` (the default command): the main job.

Quantizes real-model-sized activations (DeepSeek-V3 layer widths) with every quantizer implementation that runs here,
checks each against the float64 reference (scales bit-exact, codes at most one fp8 step off in at most 1e-4 of the
values, pad rows zero with scale 1.0: docs/CONTRACT.md §1) and prints a table; exits 1 if any check fails. On CPU the
Pallas kernels run in interpret mode (under a minute in all); their wall times say nothing about GPU speed.
"""

from __future__ import annotations

import time

from absl import flags

from jaxfp8.tools import args

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
flags.DEFINE_list("implementations", None, "Quantizer implementations to check (mosaic, triton, xla). Default: every "
                  "one that runs here.", **_KW)
flags.DEFINE_string("m", None, "Row counts M, ','-separated (with --k: every (M, K) pair). Default: the built-in "
                    "cases.", **_KW)
flags.DEFINE_string("k", None, "Widths K, ','-separated (multiples of 128). Default: the built-in cases.", **_KW)
flags.DEFINE_integer("seed", None, "Random seed of the activations. Default: fresh.", **_KW)

# Activation shapes of DeepSeek-V3 layers (K = input features of q_a/kv_a/gate_up, o_proj, dense_down, shared_down).
CASES = ((1, 7168), (64, 7168), (13, 2048), (5, 18432), (128, 1536))
GROUP = 128


def runnable(implementations) -> tuple[list[str], dict[str, str]]:
  """The implementations whose plan is allowed here, and why each other one is not."""
  from jaxfp8 import quant
  p = quant.problem(1, 64, 7168, "bfloat16", group_size=GROUP, eps=1e-10, row_alignment=4, scale_layout="col",
                    scale_tma_aligned=True)
  ok, skipped = [], {}
  for implementation in implementations:
    try:
      quant.plan(p, implementation=implementation)
      ok.append(implementation)
    except (ValueError, TypeError) as e:
      skipped[implementation] = str(e)
  return ok, skipped


def check_case(m: int, k: int, implementation: str, rng) -> tuple[bool, str]:
  """Quantizes one random (M, K) bf16 activation with `implementation`; (passed, the table's cells)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxfp8 import quant
  from jaxfp8 import reference as ref

  x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 6, (m, 1)))).astype(np.float32)
  x_bf16 = jnp.asarray(x, jnp.bfloat16)
  ref_q, ref_s = ref.per_token_group_quant_fp8(np.asarray(x_bf16), GROUP, column_major_scales=True,
                                               scale_tma_aligned=True, row_alignment=4)
  start = time.perf_counter()
  try:
    q, s = jax.block_until_ready(quant.per_token_group_quant_fp8_row_padded(x_bf16, GROUP,
                                                                            implementation=implementation))
  except Exception as e:  # reported in the table, which should show every implementation
    return False, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
  wall_ms = (time.perf_counter() - start) * 1e3
  q, s = np.asarray(q), np.asarray(s)
  same_shape = q.shape == ref_q.shape and s.shape == ref_s.shape
  scales_exact = same_shape and np.array_equal(s.view(np.uint32), ref_s.view(np.uint32))
  dist = ref.fp8_code_distance(q, ref_q) if q.shape == ref_q.shape else np.array([99])
  codes_off = np.count_nonzero(dist)
  pad_ok = not q[m:].view(np.uint8).any() and (s[:, m:] == 1.0).all()
  ok = scales_exact and dist.max() <= 1 and codes_off <= max(1, int(1e-4 * dist.size)) and pad_ok
  return ok, (f"{'exact' if scales_exact else 'DIFFER':>10} {codes_off:>10} {'ok' if pad_ok else 'BAD':>9} "
              f"{wall_ms:>9.1f}{'' if ok else '  <-- FAIL'}")


def check(implementations=None, cases=CASES, seed: int | None = None, log=print) -> int:
  """Checks every implementation on every (M, K) case and prints the table; returns the number of failures."""
  import jax
  import numpy as np

  from jaxfp8 import _platform, quant

  on_gpu = _platform.gpu_compute_capability() is not None
  chosen, skipped = runnable(implementations or quant.IMPLEMENTATIONS)
  if implementations and skipped:
    raise args.CommandError("; ".join(skipped.values()))
  log(f"jaxfp8 check on {jax.devices()[0].device_kind} (jax {jax.__version__}); Pallas kernels "
      f"{'run natively' if on_gpu else 'run in interpret mode (CPU): wall times say nothing about GPU speed'}")
  for implementation, why in skipped.items():
    log(f"not checked here: {implementation}: {why}")
  header = f"{'M':>5} {'K':>6} {'implementation':>14} {'scales':>10} {'codes off':>10} {'pad rows':>9} {'wall ms':>9}"
  log(header)
  log("-" * len(header))
  rng = np.random.default_rng(seed)
  failures = 0
  for m, k in cases:
    for implementation in chosen:
      ok, cells = check_case(m, k, implementation, rng)
      failures += not ok
      log(f"{m:>5} {k:>6} {implementation:>14} {cells}")
  log("all implementations agree with the reference" if not failures else f"{failures} FAILURES")
  return failures


def main(command_line: str) -> int:
  del command_line
  from jaxfp8 import quant
  unknown = [i for i in FLAGS.implementations or () if i not in quant.IMPLEMENTATIONS]
  if unknown:
    raise args.UsageError(f"--implementations: unknown {unknown}; known: {', '.join(quant.IMPLEMENTATIONS)}")
  cases = CASES
  if FLAGS.m or FLAGS.k:
    ms = args.parse_ms(FLAGS.m) if FLAGS.m else (64,)
    ks = args.parse_ints(FLAGS.k, flag="--k") if FLAGS.k else (7168,)
    bad = [k for k in ks if k % GROUP]
    if bad:
      raise args.UsageError(f"--k: {bad} not a multiple of the group size {GROUP}")
    cases = tuple((m, k) for m in ms for k in ks)
  return 1 if check(FLAGS.implementations, cases, FLAGS.seed) else 0
