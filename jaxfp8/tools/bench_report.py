"""The rows of `python -m jaxfp8 bench` in one form, whatever op made them, and what is computed from them: the
roofline, the speedup over the best baseline, the text table, the markdown table and each op's own summary table.

Every op's runner returns raw rows (its own names); `unify` turns them into the bench's rows: op, shape, m, n, k,
implementation, role, then the fields of `KEEP` that the row has. A row checked against the float64 reference has
rel_err, bound and within_bound (the check's result).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

BF16_BOUND = 5e-3  # docs/CONTRACT.md §2: relative Frobenius error of a bf16 output
# A raw row's fields that its bench row keeps (x_weight_floor and x_floor are against a fixed 4.3 TB/s;
# pct_roofline uses this run's copy bandwidth).
KEEP = ("us", "rel_err", "bound", "within_bound", "error", "note", "plan", "kernels", "kernel_launches",
        "rotation_sets", "bytes", "flops", "groups", "routing", "active_experts", "floor_us", "x_floor", "x_weight_floor",
        "layout", "tokens", "local_rows", "weight_stream_us", "x_weight_stream", "non_gemm_share", "bucket", "live", "rows_computed",
        "valid_vs_exact", "y_rel_err", "codes_off", "scales_exact", "step", "bit_identical_to_picked")


def kernel_fields(kernels: list[dict] | None) -> dict:
  """A timed row's kernels (GPU only, `timing.timed`): how many it launches per call and each one's name and time."""
  if kernels is None:
    return {}
  return dict(kernel_launches=sum(k["launches_per_call"] for k in kernels), kernels=kernels)


def unify(op: str, raw_rows: Sequence[dict], roles: Mapping[str, str]) -> list[dict]:
  """The bench rows of one op's raw rows (summary rows of an op's own, `summary=True`, stay in its raw results)."""
  out = []
  for raw in raw_rows:
    if raw.get("summary"):
      continue
    name = raw.get("contender", raw.get("implementation"))
    row = dict(op=op, shape=raw.get("shape", f"K={raw['k']}"), m=raw["m"], n=raw.get("n"), k=raw["k"],
               implementation=name, role=raw.get("role") or role_of(roles, name))
    row.update({key: raw[key] for key in KEEP if key in raw})
    if "within_bf16_bound" in raw:  # the GEMM's and linear's runners name their check by its bound
      row.update(within_bound=raw["within_bf16_bound"], bound=BF16_BOUND)
    out.append(row)
  return out


def role_of(roles: Mapping[str, str], name: str) -> str:
  """The role of implementation `name`; an explicit kernel config ("mosaic[tile_n=256]") is a "config"."""
  return "config" if "[" in name else roles[name]


# ---- the roofline ----------------------------------------------------------------------------------------------------

def op_flops(op: str, implementation: str, m: int, n: int | None, k: int) -> int | None:
  if op in ("quant", "valid_rows", "linear_grad", "grouped", "moe") or implementation == "quant":
    return None  # the quantizer does no math; the other ops' runners count their own
  return 2 * m * n * k


def op_bytes(op: str, implementation: str, m: int, n: int | None, k: int, block_size: tuple[int, int],
             quant_bytes: Callable[[int, int, int], int]) -> int | None:
  """Fewest bytes the call must move: read its inputs once, write its output once (bf16 out, fp8 codes, f32 scales)."""
  gn, gk = block_size
  groups = -(-k // gk)
  if op == "quant" or implementation == "quant":
    return quant_bytes(m, k, gk)
  if op not in ("gemm", "linear"):
    return None  # the other ops' runners count their own
  weight = n * k + -(-n // gn) * groups * 4
  out = m * n * 2
  if op == "linear" and implementation in ("linear", "w8a16_bf16"):
    return m * k * 2 + weight + out  # bf16 activations in
  return m * k + m * groups * 4 + weight + out  # fp8 activations and their scales in


def add_roofline(row: dict, *, peak_tflops: float | None, copy_bandwidth: float, block_size,
                 quant_bytes: Callable[[int, int, int], int]) -> None:
  """Adds bytes, GB/s, the roofline time (max of compute and memory time), its bound and the share reached; rows
  whose bytes are unknown (an MoE step that is neither a GEMM nor the layer) get TFLOP/s at most."""
  if "us" not in row:
    return
  flops = row.get("flops") or op_flops(row["op"], row["implementation"], row["m"], row["n"], row["k"])
  if flops:
    row.update(flops=flops, tflops=flops / (row["us"] * 1e-6) / 1e12)
  num_bytes = row.get("bytes") or op_bytes(row["op"], row["implementation"], row["m"], row["n"], row["k"],
                                           block_size, quant_bytes)
  if not num_bytes:
    return
  memory_us = num_bytes / copy_bandwidth * 1e6
  compute_us = flops / (peak_tflops * 1e12) * 1e6 if flops and peak_tflops else 0.0
  roofline_us = max(memory_us, compute_us)
  row.update(bytes=num_bytes, gbps=num_bytes / (row["us"] * 1e-6) / 1e9, roofline_us=roofline_us,
             bound_by="compute" if compute_us > memory_us else "memory", pct_roofline=100 * roofline_us / row["us"])


def add_baseline_ratios(rows: list[dict]) -> None:
  """speedup_vs_best_baseline = (fastest baseline of the same op, shape, M) / this time, for every timed row; a
  baseline that failed its check is no baseline to beat."""
  best: dict = {}
  for r in rows:
    if r.get("role") == "baseline" and "us" in r and r.get("within_bound", True):
      key = (r["op"], r["shape"], r["m"])
      if key not in best or r["us"] < best[key][0]:
        best[key] = (r["us"], r["implementation"])
  for r in rows:
    key = (r["op"], r["shape"], r["m"])
    if "us" in r and key in best:
      r["best_baseline"] = best[key][1]
      r["speedup_vs_best_baseline"] = best[key][0] / r["us"]


def failed_checks(rows: Sequence[dict]) -> list[dict]:
  """The rows whose output was outside its bound (or failed to run)."""
  return [r for r in rows if "error" in r and "needs" not in r["error"] or r.get("within_bound") is False]


# ---- tables ----------------------------------------------------------------------------------------------------------

HEADER = ("op", "shape", "M", "N", "K", "implementation", "role", "us", "TFLOP/s", "GB/s", "roofline",
          "vs best baseline", "rel err", "check")


def _cells(r: dict) -> list[str]:
  head = [r["op"], r["shape"], str(r["m"]), str(r["n"] or "-"), str(r["k"]), r["implementation"], r["role"]]
  if "error" in r:
    return head + ["n/a" if "needs" in r["error"] else "error"] + [""] * 6
  check = "-" if "within_bound" not in r else ("ok" if r["within_bound"] else "FAILED")
  return head + [f"{r['us']:.2f}", f"{r['tflops']:.1f}" if "tflops" in r else "-",
                 f"{r['gbps']:.1f}" if "gbps" in r else "-",
                 f"{r['pct_roofline']:.0f}% {r['bound_by'][:3]}" if "pct_roofline" in r else "-",
                 f"{r['speedup_vs_best_baseline']:.2f}x" if "speedup_vs_best_baseline" in r else "-",
                 f"{r['rel_err']:.1e}" if "rel_err" in r else "-", check]


def text_table(result: dict) -> str:
  lines = [_cells(r) for r in result["rows"]]
  header = list(HEADER)
  if result.get("cpu_warning"):
    header[7] = "wall us"
  widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.rjust(w) if 2 <= i <= 4 or i >= 7 else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([fmt(header), "-" * (sum(widths) + 2 * len(widths))] + [fmt(line) for line in lines])


def markdown_table(result: dict, summaries: Mapping[str, Callable[[list[dict]], str]] = {}) -> str:
  """The run's caption and command, every row, then each op's own summary table (`summaries`: op -> table)."""
  header = list(HEADER)
  if result.get("cpu_warning"):
    header[7] = "wall us (CPU)"
  peak, source = result["compute_peak_tflops"], result["compute_peak_source"]
  lines = [f"jaxfp8 bench, {result['device']}, jax {result['jax_version']}, {result['date'][:10]}"
           f"{'' if result['complete'] else ' (INCOMPLETE run)'}; {result['timing']}. Roofline: "
           f"{f'{peak:g} TFLOP/s FP8 dense ({source})' if peak else 'no compute peak'}"
           f" and the copy bandwidth {result['copy_bandwidth_tbps']:.2f} TB/s measured in the same run; "
           f"'vs best baseline' = fastest baseline / this (above 1: faster); 'check': the output against the float64 "
           "reference, before timing.", "", f"Command: `{result['command']}`", ""]
  if result.get("cpu_warning"):
    lines += [f"**{result['cpu_warning']}**", ""]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
  for op, summary in summaries.items():
    rows = [r for r in result["rows"] if r["op"] == op]
    if rows:
      lines += ["", summary(rows).rstrip("\n")]
  return "\n".join(lines) + "\n"


def cell_us(r: dict | None, ratio_key: str | None = None) -> str:
  """A summary table's cell: us (and `ratio_key`'s value as NNx), '-' when absent, 'error' or 'FAILED'."""
  if r is None:
    return "-"
  if "error" in r:
    return "n/a" if "needs" in r["error"] else "error"
  extra = f" ({r[ratio_key]:.2f}x)" if ratio_key and r.get(ratio_key) is not None else ""
  return f"{r['us']:.1f}{extra}{'' if r.get('within_bound', True) else ' FAILED'}"
