"""`python -m jaxfp8 plot`: a results JSON as throughput against the problem size, one line per implementation, one
row of panels per op, one panel per shape.

Reads the JSON of `python -m jaxfp8 bench` (one row of panels per op in it, or --ops: GEMMs and the linear TFLOP/s,
the quantizer GB/s with the copy bandwidth measured in the same run as a dashed line, the MoE layer and valid_rows
microseconds on a log scale), of `python -m jaxfp8 tp` (the sharded layer's kernel-time speedup over one GPU, per
mode), and the older per-op runs (bench_gemm, bench_linear, bench_quant) kept in benchmarks/:

    python -m jaxfp8 plot --json=benchmarks/quant_h200.json --out=benchmarks/quant_h200.png

Each implementation keeps its colour in every panel and every plot (COLORS); the figure names the file it shows.
matplotlib is an optional dependency (extra `notebooks`).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence

from absl import flags

from jaxfp8.tools import args

FLAGS = flags.FlagValues()
_KW = dict(flag_values=FLAGS, module_name=__name__)
flags.DEFINE_string("json", None, "The results JSON to plot (required).", **_KW)
flags.DEFINE_string("out", None, "The image to write (PNG, or any format matplotlib writes). Default: beside the "
                    "JSON, with .png.", **_KW)
flags.DEFINE_list("panels", None, "Shape names (or K=... for the quantizer) to plot, one panel each, in every op "
                  "that has them. Default: two representative shapes per op.", **_KW)
flags.DEFINE_list("ops", None, "bench results: the ops to plot, one row of panels each. Default: every op in the "
                  "file.", **_KW)
flags.mark_flag_as_required("json", flag_values=FLAGS)

MATPLOTLIB_MISSING = "needs matplotlib: pip install 'jaxfp8[notebooks]'"
# One colour per implementation (and per tensor-parallel mode), the same in every panel and plot.
COLORS = {
    "mosaic": "#1f77b4", "triton": "#ff7f0e", "xla": "#2ca02c", "dequant_bf16": "#d62728",
    "torch_scaled_mm": "#9467bd", "fp8_per_tensor": "#8c564b", "linear": "#e377c2", "gemm": "#17becf",
    "quant": "#bcbd22", "w8a16_bf16": "#7f7f7f", "column": "#1b9e77", "column_gather": "#d95f02", "row": "#7570b3",
    "masked_mosaic": "#aec7e8", "masked_mosaic_live": "#6baed6", "ragged_dot_bf16": "#ff9896",
    "pallas_ragged_bf16": "#c5b0d5",
    "dense_same_rows": "#c49c94", "layer": "#f7b6d2", "steps_summed": "#dbdb8d", "fp8_fwd": "#9edae5",
    "fp8_fwd_bwd": "#e7298a", "bf16_bwd": "#66a61e", "bf16_layer": "#e6ab02", "bucket_valid": "#a6761d",
    "bucket_full": "#666666", "exact": "#393bb9", "given_schedule": "#e7ba52",
}
_SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
REFERENCE_LINE = dict(color="black", ls="--", lw=1.0)


def color(name: str) -> str:
  """The colour of an implementation or mode: COLORS, else one picked from the name (the same in every plot)."""
  return COLORS.get(name) or _SPARE_COLORS[zlib.crc32(name.encode()) % len(_SPARE_COLORS)]


# Two shapes that stand for the rest: a wide projection (compute bound at prefill) and a long-K down projection; the
# DeepSeek-V3 expert GEMMs and MoE layer.
PREFERRED_SHAPES = ("deepseek_v3.q_proj_no_lora", "dsv3.q_proj_no_lora", "deepseek_v3.dense_down", "dsv3.dense_down",
                    "dsv3_ep8.gate_up/balanced", "dsv3_ep8.down/balanced", "deepseek_v3_ep8", "qwen3_30b_a3b")
PREFERRED_QUANT_KS = ("K=7168", "K=18432")
# bench's ops: (the row's metric, its label, log scale, the x axis); the MoE layer's steps stay in its summary table.
OP_METRICS = {
    "quant": ("gbps", "GB/s", False, "M (rows)"), "gemm": ("tflops", "TFLOP/s", False, "M (rows)"),
    "linear": ("tflops", "TFLOP/s", False, "M (rows)"), "linear_grad": ("tflops", "TFLOP/s", False, "M (rows)"),
    "grouped": ("tflops", "TFLOP/s", False, "R (routed rows)"), "moe": ("us", "us", True, "T (tokens)"),
    "valid_rows": ("us", "us", True, "live rows"),
}
OLD_METRIC = (None, None, False, "M (rows)")


def ops_in(result: dict) -> list[str | None]:
  """The ops of a bench results dict, in order of appearance; [None] for the other kinds of results."""
  rows = result["rows"]
  return list(dict.fromkeys(r["op"] for r in rows)) if rows and "op" in rows[0] else [None]


def series(result: dict, op: str | None = None) -> tuple[str, dict[str, dict[str, list[tuple[int, float]]]], dict]:
  """(y label, {panel: {implementation: [(size, y)]}}, panel sizes) of a results dict, whatever wrote it; `op`: the
  op of a bench results dict (default: gemm if it has one, else its first)."""
  rows = result["rows"]
  if rows and "op" in rows[0]:  # python -m jaxfp8 bench
    ops = ops_in(result)
    op = op or ("gemm" if "gemm" in ops else ops[0])
    metric, unit = OP_METRICS.get(op, ("us", "us"))[:2]
    rows = [r for r in rows if r["op"] == op and r.get(metric) and not r.get("step")]
    label, name_of = f"{op}: {unit}", lambda r: r["implementation"]
  elif rows and "mode" in rows[0]:  # bench_tp: kernel-time speedup of the sharded layer over one GPU
    rows = [r for r in rows if r.get("timed") and r.get("speedup_kernel") is not None]
    metric, label, name_of = "speedup_kernel", "speedup over 1 GPU (kernel time)", (lambda r: r["mode"])
  elif rows and "contender" in rows[0]:  # bench_gemm / bench_linear
    rows = [r for r in rows if "tflops" in r]
    metric, label, name_of = "tflops", "TFLOP/s", (lambda r: r["contender"])
  else:  # bench_quant
    rows = [dict(r, shape=f"K={r['k']}") for r in rows if "us" in r]
    metric, label, name_of = "gbps", "quantizer: GB/s", (lambda r: r["implementation"])
  panels: dict = {}
  sizes: dict = {}
  for r in rows:
    shape = r.get("shape", f"K={r['k']}")
    panels.setdefault(shape, {}).setdefault(name_of(r), []).append((r["m"], r[metric]))
    sizes[shape] = (r.get("n") or 1) * r["k"] * r.get("groups", 1)
  for lines in panels.values():
    for points in lines.values():
      points.sort()
  return label, panels, sizes


def pick_shapes(panels: dict, sizes: dict, count: int = 2) -> list[str]:
  """The preferred representative shapes that are present, else the largest ones."""
  preferred = [s for s in PREFERRED_SHAPES + PREFERRED_QUANT_KS if s in panels]
  rest = sorted((s for s in panels if s not in preferred), key=lambda s: -sizes[s])
  chosen = []
  for s in preferred + rest:  # one shape per name (dsv3.x and deepseek_v3.x are the same layer)
    if s.split(".")[-1] not in {c.split(".")[-1] for c in chosen}:
      chosen.append(s)
  return chosen[:count]


def _figure_rows(result: dict, shapes: Sequence[str] | None, ops: Sequence[str] | None) -> list[tuple]:
  """(op, label, panels, the shapes to draw) per row of the figure."""
  present = ops_in(result)
  missing_ops = [op for op in ops or () if op not in present]
  if missing_ops:
    raise ValueError(f"ops {missing_ops} are not in the results; they hold {[op for op in present if op]}")
  out = []
  for op in ops or present:
    label, panels, sizes = series(result, op)
    if panels:
      out.append((op, label, panels, [s for s in shapes if s in panels] if shapes else pick_shapes(panels, sizes)))
  if not out:
    raise ValueError("the results hold no timed rows to plot")
  missing = [s for s in shapes or () if not any(s in panels for _, _, panels, _ in out)]
  if missing:
    held = sorted(p for _, _, panels, _ in out for p in panels)
    raise ValueError(f"shapes {missing} are not in the results; they hold {held}")
  return [row for row in out if row[3]]


def _draw_panel(ax, result: dict, op: str | None, label: str, shape: str, lines: dict) -> None:
  _, _, log_y, x_label = OP_METRICS.get(op, OLD_METRIC)
  for name, points in sorted(lines.items()):
    ms, ys = zip(*points)
    ax.plot(ms, ys, marker="o", label=name, color=color(name))
  if "GB/s" in label and result.get("copy_bandwidth_tbps"):
    ax.axhline(result["copy_bandwidth_tbps"] * 1e3, label="copy bandwidth (same run)", **REFERENCE_LINE)
  if "speedup" in label and result.get("device_count"):
    ax.axhline(result["device_count"], label=f"ideal ({result['device_count']} GPUs)", **REFERENCE_LINE)
    ax.axhline(1.0, color="black", lw=0.8)
  if "TFLOP/s" in label and result.get("compute_peak_tflops"):
    ax.axhline(result["compute_peak_tflops"], label="FP8 dense peak (datasheet)", **REFERENCE_LINE)
  ax.set_xscale("log", base=2)
  if log_y:
    ax.set_yscale("log")
  ax.set_xlabel(x_label)
  ax.set_ylabel(label)
  ax.set_title(shape)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)


def plot_result(result: dict, shapes: Sequence[str] | None = None, source: str | None = None,
                ops: Sequence[str] | None = None):
  """A matplotlib Figure: a row of panels per op (`ops`, default every op of a bench results dict), one panel per
  shape, y against the problem size (log 2), one line per implementation; its footer names `source` (the results
  file) and the command that made the results."""
  import matplotlib.pyplot as plt

  figure_rows = _figure_rows(result, shapes, ops)
  columns = max(len(row[3]) for row in figure_rows)
  fig, axes = plt.subplots(len(figure_rows), columns, figsize=(6 * columns, 4.2 * len(figure_rows)), squeeze=False)
  for axes_row, (op, label, panels, chosen) in zip(axes, figure_rows):
    for ax, shape in zip(axes_row, chosen):
      _draw_panel(ax, result, op, label, shape, panels[shape])
    for ax in axes_row[len(chosen):]:
      ax.set_visible(False)
  cpu = " - CPU WALL CLOCK, says nothing about GPU speed" if result.get("cpu_warning") else ""
  fig.suptitle(f"{result.get('device', '?')}, jax {result.get('jax_version', '?')}, {result.get('date', '')[:10]}{cpu}")
  footer = f"data: {source}" if source else "data: (not from a file)"
  if result.get("command"):
    footer += f"    command: {result['command']}"
  fig.text(0.005, 0.005, footer, fontsize=7, ha="left", va="bottom", wrap=True)
  fig.tight_layout(rect=(0, 0.04 / len(figure_rows), 1, 1))
  return fig


def plot_file(json_path: str, out_path: str, shapes: Sequence[str] | None = None,
              ops: Sequence[str] | None = None) -> str:
  """Plot the results JSON at `json_path` into `out_path` (PNG, or any format matplotlib writes)."""
  import matplotlib
  matplotlib.use("Agg")  # a file, no window
  with open(json_path) as f:
    result = json.load(f)
  fig = plot_result(result, shapes, source=json_path, ops=ops)
  fig.savefig(out_path, dpi=110)
  return out_path


def main(command_line: str) -> int:
  """`python -m jaxfp8 plot` with this module's FLAGS."""
  del command_line
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise args.CommandError(MATPLOTLIB_MISSING) from None
  if not os.path.exists(FLAGS.json):
    raise args.UsageError(f"--json: no such file {FLAGS.json}")
  out = FLAGS.out or FLAGS.json.removesuffix(".json") + ".png"
  try:
    plot_file(FLAGS.json, out, shapes=FLAGS.panels, ops=FLAGS.ops)
  except (ValueError, KeyError, json.JSONDecodeError) as e:
    raise args.UsageError(f"--json={FLAGS.json}: cannot plot it: {type(e).__name__}: {e}") from None
  print(f"wrote {out}")
  return 0
