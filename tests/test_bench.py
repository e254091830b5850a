"""`python -m jaxfp8 bench` and `python -m jaxfp8 plot` on CPU: the command line end to end on a tiny shape list,
and the arithmetic of the table (roofline, speedup over the best baseline). The GPU numbers come from the H200."""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8.tools import args, bench, timing

ROOT = Path(__file__).resolve().parent.parent


def test_bench_command_on_a_tiny_shape_list(tmp_path):
  out = tmp_path / "bench_cpu.json"
  command = [sys.executable, "-m", "jaxfp8", "bench", "--shapes=1,256,512;8,256,512;4,128,256", "--iterations=2",
             f"--out={out}", "--seed=3"]
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "say nothing about GPU speed" in proc.stdout and "wall us" in proc.stdout
  result = json.loads(out.read_text())
  assert result["complete"] and result["cpu_warning"] and "WALL-CLOCK" in result["timing"]
  assert result["command"].startswith("python -m jaxfp8 bench '--shapes=1,256,512;") and result["seed"] == 3
  for key in ("date", "device", "jax_version", "copy_bandwidth_tbps", "implementations"):
    assert result[key]
  assert result["ms_by_shape"] == {"256x512": [1, 8], "128x256": [4]}
  rows = result["rows"]
  seen = {(r["op"], r["shape"], r["m"], r["implementation"]) for r in rows}
  for op, names in result["implementations"].items():
    assert names, op
    for name in names:
      for shape, ms in (("256x512", (1, 8)), ("128x256", (4,))):
        for m in ms:
          key = (op, f"K={shape.split('x')[1]}" if op == "quant" else shape, m, name)
          assert key in seen, key
  assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
  assert all(r["us"] > 0 and r["gbps"] > 0 and r["pct_roofline"] > 0 for r in rows)
  assert all(r["within_bf16_bound"] for r in rows if "within_bf16_bound" in r)
  assert {r["m"] for r in rows if r["op"] == "quant" and r["k"] == 512} == {1, 8}
  md = (tmp_path / "bench_cpu.md").read_text()
  assert "say nothing about GPU speed" in md
  assert sum(line.startswith("| gemm |") for line in md.splitlines()) == len([r for r in rows if r["op"] == "gemm"])

  png = tmp_path / "bench_cpu.png"
  proc = subprocess.run([sys.executable, "-m", "jaxfp8", "plot", f"--json={out}", f"--out={png}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_budget_leaves_an_incomplete_json(tmp_path):
  out = tmp_path / "cut.json"
  result = bench.run(["gemm"], [("s", 128, 256)], [2], ["xla"], str(out), iterations=1, time_budget_s=1e-9,
                     log=lambda *_: None)
  assert not result["complete"] and json.loads(out.read_text())["complete"] is False
  assert "INCOMPLETE" in (tmp_path / "cut.md").read_text()


def test_implementation_names():
  chosen = bench.select_implementations(["dequant_bf16", "xla"], ["gemm", "linear", "quant"], on_gpu=False)
  assert chosen == {"gemm": ["xla", "dequant_bf16"], "linear": ["dequant_bf16"], "quant": ["xla"]}
  with pytest.raises(ValueError, match="cuda_magic"):
    bench.select_implementations(["cuda_magic"], ["gemm"], on_gpu=False)
  cpu = bench.select_implementations(None, ["gemm", "quant"], on_gpu=False)
  assert "torch_scaled_mm" not in cpu["gemm"] and "mosaic" not in cpu["quant"] and "xla" in cpu["quant"]
  if not bench._platform.is_hopper():  # asked for by name, what cannot run here is refused, not an ERROR row
    with pytest.raises(args.CommandError, match="mosaic needs a Hopper GPU"):
      bench.select_implementations(["mosaic", "xla"], ["gemm"], on_gpu=False)


def test_steps_run_the_quantizer_once_per_k():
  shapes = [("a", 256, 512), ("b", 128, 512), ("c", 256, 1024)]
  todo = bench.steps(["gemm", "quant"], shapes, [1, 8], {"b": [4]}, None)
  assert todo == [("gemm", ("a", 256, 512), [1, 8]), ("gemm", ("b", 128, 512), [4]),
                  ("gemm", ("c", 256, 1024), [1, 8]), ("quant", 512, [1, 4, 8]), ("quant", 1024, [1, 8])]
  assert bench.steps(["quant"], shapes, [2], {}, [7168, 2048]) == [("quant", 2048, [2]), ("quant", 7168, [2])]


def test_roofline_and_speedup_arithmetic():
  m, n, k = 4096, 24576, 7168
  flops = 2 * m * n * k
  fast = dict(op="gemm", shape="s", m=m, n=n, k=k, implementation="mosaic", role="ours", us=1000.0)
  base = dict(fast, implementation="dequant_bf16", role="baseline", us=2000.0)
  wrong = dict(fast, implementation="torch_scaled_mm", role="baseline", us=10.0, within_bf16_bound=False)
  rows = [fast, base, wrong]
  for r in rows:
    bench.add_roofline(r, peak_tflops=1979.0, copy_bandwidth=4.3e12, block_size=(128, 128))
  assert fast["bound"] == "compute" and fast["flops"] == flops
  assert fast["tflops"] == pytest.approx(flops / 1e-3 / 1e12)
  assert fast["pct_roofline"] == pytest.approx(100 * flops / 1979e12 / 1e-3)
  gemm_bytes = m * k + m * (k // 128) * 4 + n * k + (n // 128) * (k // 128) * 4 + m * n * 2
  assert fast["bytes"] == gemm_bytes
  bench.add_baseline_ratios(rows)  # a baseline outside the bf16 bound is not a baseline to beat
  assert fast["speedup_vs_best_baseline"] == 2.0 and fast["best_baseline"] == "dequant_bf16"
  decode = dict(fast, m=1, us=50.0)
  bench.add_roofline(decode, peak_tflops=1979.0, copy_bandwidth=4.3e12, block_size=(128, 128))
  assert decode["bound"] == "memory" and decode["roofline_us"] == pytest.approx(decode["bytes"] / 4.3e12 * 1e6)
  quant = dict(op="quant", shape="K=7168", m=64, n=None, k=7168, implementation="xla", role="baseline", us=4.0)
  bench.add_roofline(quant, peak_tflops=None, copy_bandwidth=4.3e12, block_size=(128, 128))
  assert "tflops" not in quant and quant["bound"] == "memory"
  from jaxfp8.tools import bench_quant
  assert quant["bytes"] == bench_quant.quant_bytes(64, 7168, 128)


def test_plot_of_the_committed_quantizer_results(tmp_path):
  pytest.importorskip("matplotlib")
  from jaxfp8.tools import plot
  result = json.loads((ROOT / "benchmarks" / "quant_h200.json").read_text())
  label, panels, sizes = plot.series(result)
  assert "GB/s" in label and plot.pick_shapes(panels, sizes) == ["K=7168", "K=18432"]
  assert set(panels["K=7168"]) == {"mosaic", "triton", "xla"}
  out = plot.plot_file(str(ROOT / "benchmarks" / "quant_h200.json"), str(tmp_path / "q.png"))
  assert Path(out).stat().st_size > 10_000
  with pytest.raises(ValueError, match="not in the results"):
    plot.plot_result(result, ["K=1"])


@pytest.mark.parametrize("name, label_part, shapes, lines", [
    ("bench_h200.json", "gemm: TFLOP/s", ["deepseek_v3.q_proj_no_lora", "deepseek_v3.dense_down"],
     {"mosaic", "triton", "xla", "dequant_bf16", "torch_scaled_mm", "fp8_per_tensor"}),
    ("tp_h200.json", "speedup over 1 GPU", ["deepseek_v3.q_proj_no_lora", "deepseek_v3.dense_down"],
     {"column", "column_gather"}),
])
def test_plot_of_the_committed_gemm_and_tp_results(tmp_path, name, label_part, shapes, lines):
  pytest.importorskip("matplotlib")
  from jaxfp8.tools import plot
  path = ROOT / "benchmarks" / name
  label, panels, sizes = plot.series(json.loads(path.read_text()))
  assert label_part in label and plot.pick_shapes(panels, sizes) == shapes
  assert set(panels[shapes[0]]) == lines
  assert Path(plot.plot_file(str(path), str(tmp_path / "p.png"))).stat().st_size > 10_000


def test_plots_keep_one_colour_per_implementation_and_name_their_file(tmp_path):
  pytest.importorskip("matplotlib")
  import matplotlib
  matplotlib.use("Agg")
  from jaxfp8.tools import plot
  colours = {}
  for name in ("bench_h200.json", "quant_h200.json", "bench_gemm_s11_h200.json"):
    path = ROOT / "benchmarks" / name
    fig = plot.plot_result(json.loads(path.read_text()), source=str(path))
    assert any(str(path) in text.get_text() for text in fig.texts), [t.get_text() for t in fig.texts]
    for ax in fig.axes:
      for line in ax.get_lines():
        if line.get_label().startswith("_") or line.get_linestyle() != "-":
          continue  # reference lines (peak, copy bandwidth)
        colour = matplotlib.colors.to_hex(line.get_color())
        assert colours.setdefault(line.get_label(), colour) == colour, line.get_label()
  assert colours["mosaic"] == plot.COLORS["mosaic"] and colours["xla"] == plot.COLORS["xla"]
  assert len(set(plot.COLORS.values())) == len(plot.COLORS)  # no two names share a colour
  assert plot.color("some_new_baseline") == plot.color("some_new_baseline")


def test_gpu_branch_with_a_fake_cupti_timer(monkeypatch, tmp_path):
  """The GPU code path (CUPTI timer, measured copy bandwidth, datasheet peak) with CUPTI faked, on CPU."""
  from jaxfp8.tools import bench_quant, timing

  def fake_cupti(fn, arg_sets, *, iterations=30, sync=None):
    (sync or (lambda out: out.block_until_ready() if hasattr(out, "block_until_ready") else out))(fn(*arg_sets[0]))
    return 7.0

  # bench sees an H200; the library underneath still dispatches for the CPU it runs on.
  monkeypatch.setattr(bench, "_platform", types.SimpleNamespace(
      gpu_compute_capability=lambda: (9, 0), is_hopper=lambda: True, has_fp8_gpu=lambda: True))
  monkeypatch.setattr(timing, "median_kernel_us", fake_cupti)
  monkeypatch.setattr(timing, "kernel_names", lambda fn, args, **_: ["quantize", "gemm"])
  monkeypatch.setattr(bench_quant, "measure_copy_bandwidth", lambda *a, **k: 4.0e12)
  lines = []
  result = bench.run(["gemm", "linear", "quant"], [("s", 256, 512)], [4], ["xla", "dequant_bf16", "linear"],
                     str(tmp_path / "gpu.json"), iterations=2, peak_tflops=1979.0, seed=1, log=lines.append)
  assert result["timing"].startswith("CUPTI") and result["cpu_warning"] is None
  assert result["copy_bandwidth_tbps"] == 4.0 and result["compute_peak_tflops"] == 1979.0
  rows = {(r["op"], r["implementation"]): r for r in result["rows"]}
  assert set(rows) == {("gemm", "xla"), ("gemm", "dequant_bf16"), ("linear", "linear"), ("linear", "dequant_bf16"),
                       ("quant", "xla")}
  assert all(r["us"] == 7.0 for r in rows.values())
  assert rows[("gemm", "xla")]["speedup_vs_best_baseline"] == 1.0
  assert rows[("linear", "linear")]["kernels"] == ["quantize", "gemm"]
  assert not any("WARNING" in line for line in lines) and "wall us" not in "\n".join(lines)


def test_linear_bench_gemm_part_reads_the_plans_padded_buffers():
  # The "gemm" part times the GEMM as the linear runs it: on the quantizer's padded rows, computing the live rows only.
  from jaxfp8 import linear, weights
  from jaxfp8.tools import bench_linear
  m, n, k = 5, 256, 512
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
  w_q, w_s = weights.quantize_weight_blockwise(jax.random.normal(jax.random.key(1), (n, k), jnp.float32), (128, 128))
  plan = linear.explain(x, w_q, (128, 128), implementation="xla", row_alignment=64)
  assert (plan.m, plan.padded_rows) == (m, 64)
  parts = bench_linear._contenders(plan, (128, 128))
  a_q, a_s = parts["quant"](x, w_q, w_s, None, None)
  assert a_q.shape == (64, k)
  out = np.asarray(parts["gemm"](x, w_q, w_s, a_q, a_s), np.float32)
  whole = np.asarray(parts["linear"](x, w_q, w_s, a_q, a_s), np.float32)
  assert out.shape == whole.shape == (m, n)
  np.testing.assert_allclose(out, whole, rtol=2e-2, atol=1e-2 * np.abs(whole).max())


def _run_ab_gemm(out, base_tree, implementation, shapes):
  command = [sys.executable, "scripts/ab_gemm.py", str(out), "--base_tree", str(base_tree), "--implementation",
             implementation, "--shapes", shapes, "--interpret", "--reps", "1", "--iterations", "1"]
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())["rows"]


def test_ab_gemm_runs_the_base_trees_kernel(tmp_path):
  # A base tree whose Triton kernel doubles its output: the A/B must run two different kernels in its one process
  # (not one cached trace twice) and say that their outputs differ, by exactly half of the base's norm.
  base = tmp_path / "base"
  shutil.copytree(ROOT / "jaxfp8" / "kernels", base / "jaxfp8" / "kernels")
  source = (ROOT / "jaxfp8" / "kernels" / "gemm_triton.py").read_text()
  doubled = source.replace("  out = acc.astype(o_ref.dtype)", "  out = (2 * acc).astype(o_ref.dtype)")
  assert doubled != source
  (base / "jaxfp8" / "kernels" / "gemm_triton.py").write_text(doubled)
  [row] = _run_ab_gemm(tmp_path / "ab.json", base, "triton", "5,256,384")
  assert (row["m"], row["n"], row["k"]) == (5, 256, 384)
  assert not row["identical"] and row["rel_diff"] == pytest.approx(0.5, abs=1e-6)
  assert row["base_us"] > 0 and row["new_us"] > 0


def test_ab_gemm_of_a_tree_with_itself_is_identical(tmp_path):
  rows = _run_ab_gemm(tmp_path / "ab.json", ROOT, "mosaic", "64,256,256")
  assert [(r["identical"], r["rel_diff"]) for r in rows] == [(True, 0.0)]


def test_kernel_times_by_name_split_calls_and_kernels(monkeypatch):
  # Three calls of a split-K GEMM (two kernels each): per-call totals 12, 15, 13.5 -> median 13.5; each kernel's own
  # median beside it. A record count that is not a multiple of the calls is an error, not a silent mis-slice.
  records = [("gemm", 10.0), ("reduce", 2.0), ("gemm", 12.0), ("reduce", 3.0), ("gemm", 11.0), ("reduce", 2.5)]
  monkeypatch.setattr(timing, "kernel_records", lambda run, iterations, sync, warmup=2: records)
  assert timing.median_kernel_us_by_name(lambda: None, [()], iterations=3) == (13.5, {"gemm": 11.0, "reduce": 2.5})
  with pytest.raises(RuntimeError, match="not the same kernels each call"):
    timing.median_kernel_us_by_name(lambda: None, [()], iterations=4)
