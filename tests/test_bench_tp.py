"""`python -m jaxfp8.bench_tp`: the tensor-parallel check + benchmark.

On CPU the command runs end to end in a subprocess on 2 simulated devices (XLA_FLAGS must be set before JAX starts)
on tiny shapes: the XLA path as dispatch picks it, and the Triton kernels interpreted. The checks themselves are shown
to fail on wrong outputs in this process (one device). The GPU test runs the real command over every local GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import bench, bench_tp, linear

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = {
    "single": {"finite", "rel_err_vs_reference"},
    "column": {"sharded_along_n", "bit_identical_to_single", "rel_err_vs_reference"},
    "column_gather": {"replicated", "bit_identical_to_single", "rel_err_vs_reference"},
    "row": {"replicated", "finite", "rel_err_vs_single", "rel_err_vs_reference"},
}


def _run_command(args: list[str], out: Path, *, cpu_devices: int | None, timeout: int) -> tuple[dict, str]:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if cpu_devices:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}").strip()
  proc = subprocess.run([sys.executable, "-m", "jaxfp8.bench_tp", f"--out={out}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-5000:]
  return json.loads(out.read_text()), output


def _check_rows(result: dict, expected: set[tuple]) -> None:
  rows = result["rows"]
  assert {(r["shape"], r["m"], r["mode"], r["bias"]) for r in rows} == expected
  assert len(rows) == len(expected)
  assert result["complete"] and result["checks_passed"] and not result["failures"], result["failures"]
  for r in rows:
    assert "error" not in r and r["passed"], r
    assert {c["name"] for c in r["checks"]} == CHECK_NAMES[r["mode"]], r
    assert all(c["passed"] for c in r["checks"]), r
    assert r["timed"] == (not r["bias"])
    if r["timed"]:
      assert r["wall_us"] > 0
      if r["mode"] != "single":
        assert r["speedup_wall"] > 0
    if r["mode"] in ("column", "column_gather"):
      assert r["elements_differing_vs_single"] == 0 and r["max_abs_diff_vs_single"] == 0
    if r["mode"] == "row":
      assert r["rel_err_vs_single"] <= bench_tp.ROW_VS_SINGLE_BOUND


def _expected(shapes_ms: dict[str, list[int]], modes: tuple[str, ...]) -> set[tuple]:
  """Every (shape, M, mode, bias) row: all modes without bias, and with bias at the first case of each parallel mode
  (plus the single-device output it is compared with)."""
  out = {(s, m, mode, False) for s, ms in shapes_ms.items() for m in ms for mode in modes}
  first_shape = next(iter(shapes_ms))
  first_m = shapes_ms[first_shape][0]
  out |= {(first_shape, first_m, mode, True) for mode in modes}
  return out


def test_command_on_two_simulated_cpu_devices(tmp_path):
  out = tmp_path / "tp_cpu.json"
  result, output = _run_command(["--shapes=512,256;256,512", "--m=1,5", "--seed=3"], out, cpu_devices=2, timeout=240)
  assert "ALL CHECKS PASSED" in output and "simulated CPU devices" in output
  _check_rows(result, _expected({"512x256": [1, 5], "256x512": [1, 5]}, bench_tp.MODES))
  assert result["device_count"] == 2 and result["devices"] == ["cpu:0", "cpu:1"] and result["cpu_warning"]
  assert result["command"].startswith("python -m jaxfp8.bench_tp --out=") and result["seed"] == 3
  assert result["layers"] == [["512x256", 512, 256, ["column", "row"]], ["256x512", 256, 512, ["column", "row"]]]
  for key in ("date", "jax_version", "timing", "timing_notes", "tolerances"):
    assert result[key]
  assert all(r["implementation"] == "xla" for r in result["rows"])  # what dispatch picks on CPU
  # Each device's plan is for its shard: N/2 columns (column) or K/2 (row, float32 partial outputs).
  plans = {(r["shape"], r["mode"]): r["plan"] for r in result["rows"] if r["m"] == 5}
  assert "N=256, K=256" in plans["512x256", "column"] and "N=512, K=128" in plans["512x256", "row"]
  assert "out float32" in plans["512x256", "row"] and "N=512, K=256" in plans["512x256", "single"]
  md = (tmp_path / "tp_cpu.md").read_text()
  assert "Checks: all passed" in md and "simulated CPU devices" in md
  table = [line for line in md.splitlines() if line.startswith("| 512x256") or line.startswith("| 256x512")]
  assert len(table) == len(result["rows"]) - 4  # the timed single rows live in the sharded rows' 1-device columns


def test_command_with_interpreted_triton_kernels(tmp_path):
  out = tmp_path / "tp_triton.json"
  result, _ = _run_command(["--shapes=256,256", "--m=3", "--implementation=triton", "--iterations=1",
                            "--parallel=both"], out, cpu_devices=2, timeout=240)
  _check_rows(result, _expected({"256x256": [3]}, bench_tp.MODES))
  assert all(r["implementation"] == "triton" and "(interpreted)" in r["plan"] for r in result["rows"])


def test_plan_layers_of_deepseek_v3():
  dsv3 = bench.model_shapes(["deepseek_v3"])
  layers, skipped = bench_tp.plan_layers(dsv3, "serving", 2)
  modes = {name.split(".")[-1]: m for name, _, _, m in layers}
  assert modes == {"q_b_proj": ("column",), "kv_b_proj": ("column",), "o_proj": ("row",),
                   "dense_gate_up": ("column",), "dense_down": ("row",), "q_proj_no_lora": ("column",),
                   "shared_expert_gate_up": ("column",), "shared_expert_down": ("row",)}
  assert {s["shape"].split(".")[-1] for s in skipped} == {"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj"}
  # Every mode where the split gives whole 128-blocks: N=576 and 2112 do not split by columns over 2 devices.
  layers, skipped = bench_tp.plan_layers(dsv3, "both", 2)
  assert len(layers) == 11 and sum(len(m) for _, _, _, m in layers) == 20
  assert {(s["shape"].split(".")[-1], s["parallel"]) for s in skipped} == {
      ("kv_a_proj_with_mqa", "column"), ("fused_qkv_a_proj", "column")}
  assert "N=576 does not split into whole 128-blocks over 2 devices" in skipped[0]["reason"]
  # Over 8 devices K=1536 (q_b_proj) and K=512 (kv_b_proj) no longer split by rows.
  _, skipped = bench_tp.plan_layers(dsv3, "row", 8)
  assert {s["shape"].split(".")[-1] for s in skipped} == {"q_b_proj", "kv_b_proj"}
  layers, _ = bench_tp.plan_layers([("256x512", 256, 512)], "serving", 2)  # not a named layer: both modes
  assert layers == [("256x512", 256, 512, ("column", "row"))]
  with pytest.raises(ValueError, match="parallel must be one of"):
    bench_tp.plan_layers(dsv3, "data", 2)


def test_checks_fail_on_wrong_outputs():
  mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
  n, k, m = 256, 512, 6
  w_q, w_s = bench_tp._random_weight(jax.random.key(1), n, k, bench_tp.BLOCK_SIZE)
  bias = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16) * 4
  sample = bench_tp._Sample(w_q, w_s, bias, bench_tp.BLOCK_SIZE)
  single = linear.w8a8_block_fp8_linear(x, w_q, w_s, bench_tp.BLOCK_SIZE)

  def failed(mode, out, with_bias=False):
    checks, _ = bench_tp.check_output(mode, out, single, mesh, sample, x, with_bias)
    assert {c["name"] for c in checks} == CHECK_NAMES[mode]
    return {c["name"] for c in checks if not c["passed"]}

  assert failed("single", single) == set() and failed("column", single) == set() and failed("row", single) == set()
  # One element one bf16 step away: no longer bit-identical, still close to the reference and to single.
  bits = jax.lax.bitcast_convert_type(single, jnp.uint16)
  nudged = jax.lax.bitcast_convert_type(bits.at[2, 5].add(1), jnp.bfloat16)
  assert failed("column", nudged) == failed("column_gather", nudged) == {"bit_identical_to_single"}
  assert failed("row", nudged) == set()
  # 1% off everywhere: beyond the row-parallel bound vs single and beyond SPEC's bound vs the reference.
  assert failed("row", (single.astype(jnp.float32) * 1.01).astype(jnp.bfloat16)) == {
      "rel_err_vs_single", "rel_err_vs_reference"}
  # A NaN outside the sampled rows is caught by the full-output checks.
  poisoned = single.at[1, 7].set(jnp.nan)
  assert "finite" in failed("single", poisoned) and "finite" in failed("row", poisoned)
  assert failed("column", poisoned) == {"bit_identical_to_single"}
  # The reference check sees the bias: an output computed without it fails the with-bias check.
  assert failed("single", single, with_bias=True) == {"rel_err_vs_reference"}


def test_compare_counts_bits_and_errors():
  a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  stats = bench_tp.compare(a.at[0, 0].set(-0.0), a)  # -0.0 == 0.0 numerically, but not bitwise
  assert stats == dict(max_abs_diff=0.0, elements_differing=1, nonfinite=0, rel_err=0.0)
  stats = bench_tp.compare(a.at[2, 3].add(3.0), a)
  assert stats["max_abs_diff"] == 3.0 and stats["elements_differing"] == 1
  np.testing.assert_allclose(stats["rel_err"], 3.0 / np.linalg.norm(np.arange(12)), rtol=1e-6)


@pytest.mark.skipif(len(jax.local_devices()) >= 2, reason="this process has several devices")
def test_refuses_a_single_device(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench_tp.main(["--shapes=256,256", "--m=1", f"--out={tmp_path / 'x.json'}"])
  assert exit_info.value.code == 2
  assert "tensor parallelism needs at least 2 devices; this process sees 1" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()
  with pytest.raises(ValueError, match="needs 2 or more devices"):
    bench_tp.run([("256x256", 256, 256)], [1])


@pytest.mark.gpu
def test_tensor_parallel_on_every_gpu(tmp_path):
  if jax.device_count() < 2:
    pytest.skip(f"needs 2 or more GPUs, this machine has {jax.device_count()}")
  out = tmp_path / "tp_gpu.json"
  shapes = ["deepseek_v3.shared_expert_gate_up", "deepseek_v3.shared_expert_down"]
  result, output = _run_command([f"--models={','.join(shapes)}", "--m=1,64,1024", "--iterations=5",
                                 "--time_budget_s=0"], out, cpu_devices=None, timeout=540)
  print(output[-6000:])
  rows = result["rows"]
  assert result["device_count"] == jax.device_count() and result["cpu_warning"] is None
  gate_up, down = shapes
  expected = ({(gate_up, m, mode, False) for m in (1, 64, 1024) for mode in ("single", "column", "column_gather")}
              | {(down, m, mode, False) for m in (1, 64, 1024) for mode in ("single", "row")}
              | {(gate_up, 1, mode, True) for mode in ("single", "column", "column_gather")}
              | {(down, 1, mode, True) for mode in ("single", "row")})
  _check_rows(result, expected)
  for r in rows:
    if r["timed"]:
      # CUPTI kernel times: the single device always; the sharded calls should show their collective kernels.
      assert "kernel_us_per_device" in r or (r["mode"] != "single" and "kernel_error" in r), r
      if "kernel_us_per_device" in r and r["mode"] in ("row", "column_gather"):
        assert r["collective_us_per_device"] > 0, r["kernels"]
