"""Benchmark of the activation quantizers (`python -m jaxfp8 bench --ops=quant`): kernel times, bytes moved, share of
the copy bandwidth.

All implementations and the copy-bandwidth ceiling are measured in the same process, so ratios are meaningful. On a
GPU the times are CUPTI kernel times; `run` takes another timer (bench's wall clock on CPU). Before it is timed each
implementation's output is checked against the float64 reference on sampled rows (docs/CONTRACT.md §1: scales bit
for bit, codes at most one fp8 step off in at most 1e-4 of the values, pad rows zero with scale 1.0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import quant
from jaxfp8 import reference as ref
from jaxfp8.tools import results as results_io, timing

DEFAULT_MS = (1, 16, 64, 256, 1024, 4096, 16384)
DEFAULT_KS = (512, 2048, 7168, 18432)
ROLES = {"mosaic": "ours", "triton": "ours", "xla": "baseline"}
# timer(fn, arg_sets, *, iterations) -> median microseconds; default: CUPTI kernel time (jaxfp8.timing).
Timer = Callable[..., float]


def measure_copy_bandwidth(num_bytes: int = 1 << 30, timer: Timer | None = None) -> float:
  """Device-to-device streaming bandwidth (bytes read + written per second), the ceiling for a memory-bound kernel."""
  timer = timer or timing.median_kernel_us
  a = jnp.asarray(np.random.default_rng(0).integers(0, 255, num_bytes // 4, dtype=np.uint32))
  touch = jax.jit(lambda v: v ^ jnp.uint32(0x5A5A5A5A))  # one read and one write of every byte
  us = timer(touch, [(a,)], iterations=20)
  return 2 * num_bytes / (us * 1e-6)


def quant_bytes(m: int, k: int, group_size: int, in_itemsize: int = 2) -> int:
  """Fewest bytes a row-padded quantization must move: read x once, write q and the scales once."""
  m_pad = -(-m // 4) * 4
  return m * k * in_itemsize + m_pad * k + (k // group_size) * m_pad * 4


def run(ms: Sequence[int] = DEFAULT_MS, ks: Sequence[int] = DEFAULT_KS,
        implementations: Sequence[str] = quant.IMPLEMENTATIONS,
        group_size: int = 128, out_json: str | None = None, iterations: int = 30, log=print,
        timer: Timer | None = None, copy_bandwidth: float | None = None,
        timing_label: str | None = None) -> dict:
  """Times `per_token_group_quant_fp8_row_padded` (bf16 input) for every (M, K) and implementation.

  `timer` defaults to CUPTI kernel time; `copy_bandwidth` (bytes/s) is measured here unless given."""
  timer = timer or timing.median_kernel_us
  copy_bw = copy_bandwidth or measure_copy_bandwidth(timer=timer)
  log(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write, same process)")
  rows = []
  rng = np.random.default_rng(0)
  for k in ks:
    for m in ms:
      sets = max(1, min(4, (256 << 20) // (m * k * 2)))  # rotate inputs while they would fit in the 60 MB L2
      arg_sets = [(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16),) for _ in range(sets)]
      num_bytes = quant_bytes(m, k, group_size)
      for implementation in implementations:
        fn = jax.jit(lambda x, implementation=implementation: quant.per_token_group_quant_fp8_row_padded(
            x, group_size, implementation=implementation, interpret=False))
        row = dict(m=m, k=k, implementation=implementation)
        try:
          row.update(check_codes(fn(*arg_sets[0]), np.asarray(arg_sets[0][0]), group_size))
          us = timer(fn, arg_sets, iterations=iterations)
          row.update(us=us, gbps=num_bytes / (us * 1e-6) / 1e9, pct_copy_bw=100 * num_bytes / (us * 1e-6) / copy_bw)
        except Exception as e:  # a failing implementation is reported, not fatal for the others
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        log(format_row(row))
  result = dict(
      benchmark="per_token_group_quant_fp8_row_padded (bf16 in, group 128, rows padded to 4, column-major scales)",
      **results_io.run_metadata(), copy_bandwidth_tbps=copy_bw / 1e12,
      timing=timing_label or "CUPTI kernel time, median of %d calls" % iterations, rows=rows)
  results_io.write_results(result, out_json)
  return result


def check_codes(out, x: np.ndarray, group_size: int, column_major: bool = True) -> dict:
  """The check of one row-padded quantization (q, s) of x against the float64 reference on the first, middle and
  last rows (the reference quantizes each row alone) and every pad row."""
  q, s = (np.asarray(a) for a in out)
  s = s if column_major else s.T
  m = x.shape[0]
  rows, _ = results_io.sample_rows_and_blocks(m, 1, 1)
  ref_q, ref_s = ref.per_token_group_quant_fp8(x[rows], group_size)
  got_s = s[:, rows].T
  scales_exact = bool(np.array_equal(got_s.view(np.uint32), ref_s.view(np.uint32)))
  distance = ref.fp8_code_distance(q[rows], ref_q)
  codes_off = int(np.count_nonzero(distance))
  pads_ok = not q[m:].view(np.uint8).any() and bool((s[:, m:] == 1.0).all())
  dequantized = lambda codes, scales: codes.astype(np.float64) * np.repeat(scales, group_size, axis=1)
  return dict(rel_err=ref.relative_error(dequantized(q[rows], got_s), dequantized(ref_q, ref_s)),
              codes_off=codes_off, scales_exact=scales_exact,
              within_bound=scales_exact and pads_ok and int(distance.max()) <= 1
              and codes_off <= max(1, int(1e-4 * distance.size)))


def format_row(row: dict) -> str:
  if "error" in row:
    return f"M={row['m']:>6} K={row['k']:>6} {row['implementation']:>7}: ERROR {row['error']}"
  return (f"M={row['m']:>6} K={row['k']:>6} {row['implementation']:>7}: {row['us']:9.2f} us "
          f"{row['gbps']:8.1f} GB/s {row['pct_copy_bw']:5.1f}% of copy; codes off {row['codes_off']}, scales "
          f"{'exact' if row['scales_exact'] else 'DIFFER'}{'' if row['within_bound'] else '  <-- FAILED'}")


def markdown_table(result: dict) -> str:
  """One line per (M, K), one column per implementation: us (% of copy bandwidth)."""
  implementations = sorted({r["implementation"] for r in result["rows"]}, key=lambda s: quant.IMPLEMENTATIONS.index(s))
  lines = [f"Quantization, {result['device']}, jax {result['jax_version']}, {result['date'][:10]}; "
           f"copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s; {result['timing']}.", "",
           "| M | K | " + " | ".join(f"{i} us (% copy BW)" for i in implementations) + " |",
           "|---|---|" + "---|" * len(implementations)]
  by_key: dict = {}
  for r in result["rows"]:
    by_key.setdefault((r["k"], r["m"]), {})[r["implementation"]] = r
  for (k, m), cells in sorted(by_key.items()):
    texts = []
    for i in implementations:
      r = cells.get(i)
      texts.append("-" if r is None else ("error" if "error" in r else f"{r['us']:.2f} ({r['pct_copy_bw']:.0f}%)"))
    lines.append(f"| {m} | {k} | " + " | ".join(texts) + " |")
  return "\n".join(lines) + "\n"
