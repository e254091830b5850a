"""`python -m jaxfp8 plot`: a results JSON as throughput against M, one line per implementation, one panel per shape.

Reads the JSON of `python -m jaxfp8 bench` (GEMM: TFLOP/s; quantizer only: GB/s, with the copy bandwidth measured in
the same run as a dashed line), of `python -m jaxfp8 tp` (the sharded layer's kernel-time speedup over one GPU, per
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
flags.DEFINE_list("panels", None, "Shape names (or K=... for the quantizer) to plot, one panel each. Default: two "
                  "representative shapes.", **_KW)
flags.mark_flag_as_required("json", flag_values=FLAGS)

MATPLOTLIB_MISSING = "needs matplotlib: pip install 'jaxfp8[notebooks]'"
# One colour per implementation (and per tensor-parallel mode), the same in every panel and plot.
COLORS = {
    "mosaic": "#1f77b4", "triton": "#ff7f0e", "xla": "#2ca02c", "dequant_bf16": "#d62728",
    "torch_scaled_mm": "#9467bd", "fp8_per_tensor": "#8c564b", "linear": "#e377c2", "gemm": "#17becf",
    "quant": "#bcbd22", "w8a16_bf16": "#7f7f7f", "column": "#1b9e77", "column_gather": "#d95f02", "row": "#7570b3",
}
_SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
REFERENCE_LINE = dict(color="black", ls="--", lw=1.0)


def color(name: str) -> str:
  """The colour of an implementation or mode: COLORS, else one picked from the name (the same in every plot)."""
  return COLORS.get(name) or _SPARE_COLORS[zlib.crc32(name.encode()) % len(_SPARE_COLORS)]


# Two shapes that stand for the rest: a wide projection (compute bound at prefill) and a long-K down projection.
PREFERRED_SHAPES = ("deepseek_v3.q_proj_no_lora", "dsv3.q_proj_no_lora", "deepseek_v3.dense_down", "dsv3.dense_down")
PREFERRED_QUANT_KS = ("K=7168", "K=18432")


def series(result: dict) -> tuple[str, dict[str, dict[str, list[tuple[int, float]]]], dict]:
  """(y label, {panel: {implementation: [(M, y)]}}, panel sizes) of a results dict, whatever wrote it."""
  rows = result["rows"]
  if rows and "op" in rows[0]:  # python -m jaxfp8 bench
    op = "gemm" if any(r["op"] == "gemm" for r in rows) else rows[0]["op"]
    rows = [r for r in rows if r["op"] == op and "us" in r]
    metric, label = ("gbps", "GB/s") if op == "quant" else ("tflops", "TFLOP/s")
    label = f"{op}: {label}"
    name_of = lambda r: r["implementation"]
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
    sizes[shape] = (r.get("n") or 1) * r["k"]
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


def plot_result(result: dict, shapes: Sequence[str] | None = None, source: str | None = None):
  """A matplotlib Figure: one panel per shape, y against M (log 2), one line per implementation; its footer names
  `source` (the results file) and the command that made the results."""
  import matplotlib.pyplot as plt

  label, panels, sizes = series(result)
  if not panels:
    raise ValueError("the results hold no timed rows to plot")
  shapes = list(shapes) if shapes else pick_shapes(panels, sizes)
  missing = [s for s in shapes if s not in panels]
  if missing:
    raise ValueError(f"shapes {missing} are not in the results; they hold {sorted(panels)}")
  fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
  for ax, shape in zip(axes[0], shapes):
    for name, points in sorted(panels[shape].items()):
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
    ax.set_xlabel("M (rows)")
    ax.set_ylabel(label)
    ax.set_title(shape)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  cpu = " - CPU WALL CLOCK, says nothing about GPU speed" if result.get("cpu_warning") else ""
  fig.suptitle(f"{result.get('device', '?')}, jax {result.get('jax_version', '?')}, {result.get('date', '')[:10]}{cpu}")
  footer = f"data: {source}" if source else "data: (not from a file)"
  if result.get("command"):
    footer += f"    command: {result['command']}"
  fig.text(0.005, 0.005, footer, fontsize=7, ha="left", va="bottom", wrap=True)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  return fig


def plot_file(json_path: str, out_path: str, shapes: Sequence[str] | None = None) -> str:
  """Plot the results JSON at `json_path` into `out_path` (PNG, or any format matplotlib writes)."""
  import matplotlib
  matplotlib.use("Agg")  # a file, no window
  with open(json_path) as f:
    result = json.load(f)
  fig = plot_result(result, shapes, source=json_path)
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
    plot_file(FLAGS.json, out, shapes=FLAGS.panels)
  except (ValueError, KeyError, json.JSONDecodeError) as e:
    raise args.UsageError(f"--json={FLAGS.json}: cannot plot it: {type(e).__name__}: {e}") from None
  print(f"wrote {out}")
  return 0
