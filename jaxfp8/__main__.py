"""Command line of jaxfp8.

  python -m jaxfp8              # the main job: quantize real-model-sized activations with every implementation
                                # that runs here, check each against the float64 reference, print a table
  python -m jaxfp8 bench        # every GEMM/linear/quantizer implementation and baseline in one run: progress, a
                                # table (us, TFLOP/s, GB/s, % of roofline, speedup over the best baseline), --out JSON
                                # (GPU: CUPTI kernel times; CPU: wall clock on small shapes, says nothing of GPU speed)
  python -m jaxfp8 plot --json=benchmarks/quant_h200.json --out=benchmarks/quant_h200.png
                                # plot a results JSON (bench, bench_gemm or bench_quant): TFLOP/s or GB/s against M
  python -m jaxfp8 bench_quant  # GPU: CUPTI timing of the quantizers (writes --out JSON and a markdown table)
  python -m jaxfp8 bench_gemm   # GPU: CUPTI timing of the block GEMMs and their baselines (--help for its flags)
  python -m jaxfp8 bench_linear # GPU: CUPTI timing of the linear vs the GEMM alone and the bf16 baselines
  python -m jaxfp8 tune         # GPU: sweep Triton GEMM configs and write the shipped table (--help for its flags)
"""

from __future__ import annotations

import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("implementations", None, "Implementations to run (default: every one that runs here).")
flags.DEFINE_list("m", None, "Row counts M (default: depends on the command).")
flags.DEFINE_list("k", None, "Widths K (default: depends on the command).")
flags.DEFINE_string("out", None, "Where to write JSON results (a .md table is written beside it).")
flags.DEFINE_integer("seed", None, "Random seed (default: fresh).")
# bench
flags.DEFINE_list("ops", ["gemm", "linear", "quant"], "bench: which ops to time (gemm, linear, quant).")
flags.DEFINE_list("models", None, "bench: shapes.json model keys whose weight shapes to run ('all' for every model).")
flags.DEFINE_string("shapes", None, "bench: 'N,K;N,K' weight shapes (with --m), or 'M,N,K;...' problems.")
flags.DEFINE_string("shapes_json", None, "bench: take --models from this shapes.json instead of the shipped one.")
flags.DEFINE_list("block_size", ["128", "128"], "bench: quantization block (gn, gk).")
flags.DEFINE_integer("iterations", None, "bench: timed calls per measurement (default 30 on GPU, 5 on CPU).")
flags.DEFINE_float("peak_tflops", None, "bench: compute peak for the roofline (default: 1979 on an H200, FP8 dense).")
flags.DEFINE_float("time_budget_s", None, "bench: stop starting new shapes after this many seconds (JSON marks it).")
# plot
flags.DEFINE_string("json", None, "plot: the results JSON to plot.")
flags.DEFINE_list("plot_shapes", None, "plot: shape names (or K=... for quantization) to plot (default: two).")

# Activation shapes of DeepSeek-V3 layers (K = input features of q_a/kv_a/gate_up, o_proj, dense_down, shared_down).
CHECK_CASES = ((1, 7168), (64, 7168), (13, 2048), (5, 18432), (128, 1536))


def _ints(values, default):
  return tuple(int(v) for v in values) if values else default


def check() -> int:
  """Quantize with every available implementation, compare with the reference, print a table. Returns failures."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxfp8 import _platform, quant
  from jaxfp8 import reference as ref

  on_gpu = _platform.gpu_compute_capability() is not None
  implementations = FLAGS.implementations or [
      i for i in quant.IMPLEMENTATIONS if i == "xla" or not on_gpu
      or (i == "triton" and _platform.has_fp8_gpu()) or (i == "mosaic" and _platform.is_hopper())]
  cases = CHECK_CASES if not (FLAGS.m or FLAGS.k) else tuple(
      (m, k) for m in _ints(FLAGS.m, (64,)) for k in _ints(FLAGS.k, (7168,)))
  rng = np.random.default_rng(FLAGS.seed)
  device = jax.devices()[0].device_kind
  print(f"jaxfp8 check on {device} (jax {jax.__version__}); Pallas kernels "
        f"{'run natively' if on_gpu else 'run in interpret mode (CPU): wall times say nothing about GPU speed'}")
  header = f"{'M':>5} {'K':>6} {'implementation':>14} {'scales':>10} {'codes off':>10} {'pad rows':>9} {'wall ms':>9}"
  print(header)
  print("-" * len(header))
  failures = 0
  for m, k in cases:
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-4, 6, (m, 1)))).astype(np.float32)
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    ref_q, ref_s = ref.per_token_group_quant_fp8(np.asarray(x_bf16), 128, column_major_scales=True,
                                                 scale_tma_aligned=True, row_alignment=4)
    for implementation in implementations:
      start = time.perf_counter()
      try:
        q, s = quant.per_token_group_quant_fp8_row_padded(x_bf16, 128, implementation=implementation)
        q, s = jax.block_until_ready((q, s))
      except Exception as e:  # report and keep going: the table should show every implementation
        print(f"{m:>5} {k:>6} {implementation:>14} ERROR {type(e).__name__}: {str(e)[:200]}")
        failures += 1
        continue
      wall_ms = (time.perf_counter() - start) * 1e3
      q, s = np.asarray(q), np.asarray(s)
      scales_exact = q.shape == ref_q.shape and s.shape == ref_s.shape and np.array_equal(
          s.view(np.uint32), ref_s.view(np.uint32))
      dist = ref.fp8_code_distance(q, ref_q) if q.shape == ref_q.shape else np.array([99])
      codes_off = np.count_nonzero(dist)
      pad_ok = not q[m:].view(np.uint8).any() and (s[:, m:] == 1.0).all()
      ok = scales_exact and dist.max() <= 1 and codes_off <= max(1, int(1e-4 * dist.size)) and pad_ok
      failures += not ok
      print(f"{m:>5} {k:>6} {implementation:>14} {'exact' if scales_exact else 'DIFFER':>10} "
            f"{codes_off:>10} {'ok' if pad_ok else 'BAD':>9} {wall_ms:>9.1f}{'' if ok else '  <-- FAIL'}")
  print(f"{'all implementations agree with the reference' if not failures else f'{failures} FAILURES'}")
  return failures


def bench_quant() -> None:
  from jaxfp8.tools import bench_quant as bq
  from jaxfp8 import quant
  out = FLAGS.out or "benchmarks/quant_h200.json"
  result = bq.run(ms=_ints(FLAGS.m, bq.DEFAULT_MS), ks=_ints(FLAGS.k, bq.DEFAULT_KS),
                  implementations=FLAGS.implementations or quant.IMPLEMENTATIONS, out_json=out)
  table = bq.markdown_table(result)
  with open(out.removesuffix(".json") + ".md", "w") as f:
    f.write(table)
  print(table)


def bench() -> None:
  import os
  import sys
  # JAX and torch may share the GPU: JAX must not take 75% of it up front (only effective before JAX starts).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from jaxfp8.tools import bench as bench_module
  bench_module.main_from_flags(FLAGS, sys.argv)


def plot() -> None:
  from jaxfp8.tools import plot as plot_module
  if not FLAGS.json:
    raise app.UsageError("plot needs --json=RESULTS.json (and --out=PLOT.png; default: beside the JSON)")
  out = FLAGS.out or FLAGS.json.removesuffix(".json") + ".png"
  plot_module.plot_file(FLAGS.json, out, shapes=FLAGS.plot_shapes)
  print(f"wrote {out}")


COMMANDS = {"check": check, "bench": bench, "plot": plot, "bench_quant": bench_quant}


def main(argv):
  command = argv[1] if len(argv) > 1 else "check"
  if command not in COMMANDS or len(argv) > 2:
    raise app.UsageError(f"usage: python -m jaxfp8 [{'|'.join([*COMMANDS, *DELEGATED])}] [--flags]; got {argv[1:]}")
  result = COMMANDS[command]()
  if command == "check" and result:
    raise SystemExit(1)


# Commands with their own argument parsers (argparse): everything after the command name is theirs.
DELEGATED = {"bench_gemm": "jaxfp8.tools.bench_gemm", "bench_linear": "jaxfp8.tools.bench_linear", "tune": "jaxfp8.tools.tune"}


if __name__ == "__main__":
  import importlib
  import sys
  if len(sys.argv) > 1 and sys.argv[1] in DELEGATED:
    importlib.import_module(DELEGATED[sys.argv[1]]).main(sys.argv[2:])
  else:
    app.run(main)
