"""`python -m jaxfp8 tp`: the tensor-parallel check + benchmark.

On CPU the command runs end to end in a subprocess on 2 simulated devices (XLA_FLAGS must be set before JAX starts)
on tiny shapes: the XLA path as dispatch picks it, and the Triton kernels interpreted. The checks themselves are shown
to fail on wrong outputs in this process (one device). The kernel-name classifier is tested on the names CUPTI gave on
2 H200s, and --rerender on a small synthetic result. The GPU test runs the real command over every local GPU.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import linear
from jaxfp8.tools import args, cli, tp, tp_checks, tp_report

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = {
    "single": {"finite", "rel_err_vs_reference"},
    "column": {"sharded_along_n", "bit_identical_to_single", "rel_err_vs_reference"},
    "column_gather": {"replicated", "bit_identical_to_single", "rel_err_vs_reference"},
    "row": {"replicated", "finite", "rel_err_vs_single", "rel_err_vs_reference"},
}


def _run_command(flags: list[str], out: Path, *, cpu_devices: int | None, timeout: int) -> tuple[dict, str]:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if cpu_devices:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}").strip()
  proc = subprocess.run([sys.executable, "-m", "jaxfp8", "tp", f"--out={out}", *flags], cwd=ROOT, env=env,
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
      assert r["rel_err_vs_single"] <= tp_checks.ROW_VS_SINGLE_BOUND


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
  _check_rows(result, _expected({"512x256": [1, 5], "256x512": [1, 5]}, tp.MODES))
  assert result["device_count"] == 2 and result["devices"] == ["cpu:0", "cpu:1"] and result["cpu_warning"]
  assert result["command"].startswith("python -m jaxfp8 tp --out=") and result["seed"] == 3
  assert result["layers"] == [["512x256", 512, 256, ["column", "row"]], ["256x512", 256, 512, ["column", "row"]]]
  for key in ("date", "jax_version", "timing", "timing_notes", "tolerances"):
    assert result[key]
  assert all(r["implementation"] == "xla" for r in result["rows"])  # what dispatch picks on CPU
  # Each device's plan is for its shard: N/2 columns (column) or K/2 (row, float32 partial outputs).
  plans = {(r["shape"], r["mode"]): r["plan"] for r in result["rows"] if r["m"] == 5}
  assert "N=256, K=256" in plans["512x256", "column"] and "N=512, K=128" in plans["512x256", "row"]
  assert "out float32" in plans["512x256", "row"] and "N=512, K=256" in plans["512x256", "single"]
  md = (tmp_path / "tp_cpu.md").read_text()
  assert "Checks: all passed" in md and "simulated CPU devices" in md and "Wall-clock columns are host-side" in md
  assert "overhead dominates" not in md  # no kernel times on CPU to say it with
  table = [line for line in md.splitlines() if line.startswith("| 512x256") or line.startswith("| 256x512")]
  assert len(table) == len(result["rows"]) - 4  # the timed single rows live in the sharded rows' 1-device columns


def test_command_with_interpreted_triton_kernels(tmp_path):
  out = tmp_path / "tp_triton.json"
  result, _ = _run_command(["--shapes=256,256", "--m=3", "--implementation=triton", "--iterations=1",
                            "--parallel=both"], out, cpu_devices=2, timeout=240)
  _check_rows(result, _expected({"256x256": [3]}, tp.MODES))
  assert all(r["implementation"] == "triton" and "(interpreted)" in r["plan"] for r in result["rows"])


def test_plan_layers_of_deepseek_v3():
  dsv3 = [(s.name, s.n, s.k) for s in args.parse_shapes("deepseek_v3")]
  layers, skipped = tp.plan_layers(dsv3, "serving", 2)
  modes = {name.split(".")[-1]: m for name, _, _, m in layers}
  assert modes == {"q_b_proj": ("column",), "kv_b_proj": ("column",), "o_proj": ("row",),
                   "dense_gate_up": ("column",), "dense_down": ("row",), "q_proj_no_lora": ("column",),
                   "shared_expert_gate_up": ("column",), "shared_expert_down": ("row",)}
  assert {s["shape"].split(".")[-1] for s in skipped} == {"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj"}
  # Every mode where the split gives whole 128-blocks: N=576 and 2112 do not split by columns over 2 devices.
  layers, skipped = tp.plan_layers(dsv3, "both", 2)
  assert len(layers) == 11 and sum(len(m) for _, _, _, m in layers) == 20
  assert {(s["shape"].split(".")[-1], s["parallel"]) for s in skipped} == {
      ("kv_a_proj_with_mqa", "column"), ("fused_qkv_a_proj", "column")}
  assert "N=576 does not split into whole 128-blocks over 2 devices" in skipped[0]["reason"]
  # Over 8 devices K=1536 (q_b_proj) and K=512 (kv_b_proj) no longer split by rows.
  _, skipped = tp.plan_layers(dsv3, "row", 8)
  assert {s["shape"].split(".")[-1] for s in skipped} == {"q_b_proj", "kv_b_proj"}
  layers, _ = tp.plan_layers([("256x512", 256, 512)], "serving", 2)  # not a named layer: both modes
  assert layers == [("256x512", 256, 512, ("column", "row"))]
  with pytest.raises(ValueError, match="parallel must be one of"):
    tp.plan_layers(dsv3, "data", 2)


def test_checks_fail_on_wrong_outputs():
  mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1])
  n, k, m = 256, 512, 6
  w_q, w_s = tp._random_weight(jax.random.key(1), n, k, tp.BLOCK_SIZE)
  bias = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16) * 4
  sample = tp_checks.Sample(w_q, w_s, bias, tp.BLOCK_SIZE)
  single = linear.w8a8_block_fp8_linear(x, w_q, w_s, tp.BLOCK_SIZE)

  def failed(mode, out, with_bias=False):
    checks, _ = tp_checks.check_output(mode, out, single, mesh, sample, x, with_bias)
    assert {c["name"] for c in checks} == CHECK_NAMES[mode]
    return {c["name"] for c in checks if not c["passed"]}

  assert failed("single", single) == set() and failed("column", single) == set() and failed("row", single) == set()
  # One element one bf16 step away: no longer bit-identical, still close to the reference and to single.
  bits = jax.lax.bitcast_convert_type(single, jnp.uint16)
  nudged = jax.lax.bitcast_convert_type(bits.at[2, 5].add(1), jnp.bfloat16)
  assert failed("column", nudged) == failed("column_gather", nudged) == {"bit_identical_to_single"}
  assert failed("row", nudged) == set()
  # 1% off everywhere: beyond the row-parallel bound vs single and beyond the bf16 bound of docs/CONTRACT.md §2 vs
  # the reference.
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
  stats = tp_checks.compare(a.at[0, 0].set(-0.0), a)  # -0.0 == 0.0 numerically, but not bitwise
  assert stats == dict(max_abs_diff=0.0, elements_differing=1, nonfinite=0, rel_err=0.0)
  stats = tp_checks.compare(a.at[2, 3].add(3.0), a)
  assert stats["max_abs_diff"] == 3.0 and stats["elements_differing"] == 1
  np.testing.assert_allclose(stats["rel_err"], 3.0 / np.linalg.norm(np.arange(12)), rtol=1e-6)


# Every kernel name CUPTI reported in a 2 x H200 run of the tp benchmark at --m=1,64,1024 (jax 0.11.2).
# Row-parallel psum ran as XLA's own kernel at M=1 and 64 (psum_7_0_fusion_1) and through NCCL at M=1024.
H200_COLLECTIVE_KERNELS = [
    "_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgsStorageILm4096EE",
    "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE",
    "psum_7_0_fusion_1",
]
H200_COMPUTE_KERNELS = ["body_mosaic_gpu_kernel", "per_token_group_quant_fp8_mosaic_gpu_kernel", "wrapped_convert",
                        "loop_transpose_fusion"]


def test_collective_kernel_names():
  # Names of the shapes XLA and NCCL give collectives: HLO ops, stream_executor's all-reduce kernel, JAX primitives.
  collective = H200_COLLECTIVE_KERNELS + [
      "all-reduce-start.1", "all-gather-start", "reduce-scatter.3", "all-to-all", "ragged-all-to-all",
      "collective-permute-done", "all_gather_fusion", "psum_scatter_2_fusion", "ppermute_fusion", "pmax_4_0_fusion",
      "psum.7", "ncclKernel_AllReduce_RING_LL_Sum_float", "_ZN15stream_executor3gpu19AllReduceKernelImplIfLN3xla13Red"]
  # Compute whose names hold a collective's letters: a local gather or scatter, small_reduce, cumsum, slices.
  compute = H200_COMPUTE_KERNELS + [
      "loop_gather_fusion", "input_scatter_fusion", "small_reduce_fusion", "input_reduce_fusion", "cumsum_fusion",
      "wrapped_slice", "loop_dynamic_slice_fusion", "loop_dynamic_update_slice_fusion", "gemm_fusion_dot_1",
      "loop_broadcast_fusion", "wrapped_concatenate", "all_gathered_copy", "sm90_xmma_gemm_e4m3bf16_f32_tn_n"]
  assert [n for n in collective if not tp_report.is_collective_kernel(n)] == []
  assert [n for n in compute if tp_report.is_collective_kernel(n)] == []


def _kernel(name: str, us: float, collective: bool) -> dict:
  return dict(name=name, launches_per_call=2.0, us_per_call_all_devices=us, collective=collective)


def _row(shape: str, m: int, mode: str, *, wall: float | None = None, kernels: list[dict] | None = None,
         devices: int = 2, bias: bool = False) -> dict:
  """A results row as `run` writes it, with the collective split of the classifier that missed XLA's psum."""
  row = dict(shape=shape, n=512, k=256, m=m, mode=mode, parallel=None if mode == "single" else mode.split("_")[0],
             devices=devices, gather_output=mode == "column_gather", bias=bias, timed=not bias,
             checks=[dict(name="finite", value=0, bound=0, passed=True, about="")], plan="p", implementation="mosaic",
             quant_implementation="mosaic", passed=True)
  if mode == "row":
    row["rel_err_vs_single"] = 1e-5
  if wall is not None:
    row["wall_us"] = wall
  if kernels is not None:
    total = sum(k["us_per_call_all_devices"] for k in kernels) / devices
    collective = sum(k["us_per_call_all_devices"] for k in kernels if k["collective"]) / devices
    row.update(kernel_us_per_device=total, collective_us_per_device=collective,
               compute_us_per_device=total - collective, kernel_launches_per_call=2.0 * len(kernels), kernels=kernels)
  return row


def _saved_result() -> dict:
  """A small result of a 2-GPU run, speedups as `run` computed them, psum_7_0_fusion_1 counted as compute."""
  rows = [
      _row("A", 64, "single", wall=100.0, devices=1,
           kernels=[_kernel("body_mosaic_gpu_kernel", 34.0, False),
                    _kernel("per_token_group_quant_fp8_mosaic_gpu_kernel", 3.0, False)]),
      _row("A", 64, "row", wall=125.0,
           kernels=[_kernel("body_mosaic_gpu_kernel", 40.0, False), _kernel("psum_7_0_fusion_1", 34.0, False),
                    _kernel("per_token_group_quant_fp8_mosaic_gpu_kernel", 4.0, False),
                    _kernel("wrapped_convert", 2.0, False)]),
      _row("A", 64, "row", bias=True),
      _row("B", 1, "single", wall=90.0, devices=1, kernels=[_kernel("body_mosaic_gpu_kernel", 10.0, False)]),
      _row("B", 1, "column", wall=120.0),  # its kernel times failed: wall clock only
      _row("B", 1, "column_gather", wall=200.0,
           kernels=[_kernel(H200_COLLECTIVE_KERNELS[0], 20.0, True), _kernel("body_mosaic_gpu_kernel", 12.0, False),
                    _kernel("loop_transpose_fusion", 4.0, False)]),
  ]
  rows[4]["kernel_error"] = "RuntimeError: CUPTI"
  singles = {r["shape"]: r for r in rows if r["mode"] == "single"}
  for r in rows:
    if r["mode"] != "single" and r["timed"]:
      tp_report.add_speedups(r, singles[r["shape"]])
      r.pop("speedup_compute", None)  # the old run did not write it
  return dict(benchmark="tp", command="python -m jaxfp8 tp --out=/tmp/r/tp.json --m=1,64",
              date="2026-11-28T10:00:00+00:00", device="NVIDIA H200", jax_version="0.11.2", platform="gpu",
              device_count=2, timing="wall clock (median) and CUPTI kernel time (mean) of 30 calls",
              timing_notes={"old": "notes"}, cpu_warning=None, skipped=[], complete=True, checks_passed=True,
              failures=[], rows=rows)


def test_rerender_reclassifies_a_saved_result(tmp_path):
  saved = _saved_result()
  src = tmp_path / "saved.json"
  src.write_text(json.dumps(saved, indent=1))
  raw = src.read_bytes()
  out = tmp_path / "out" / "tp.json"
  flags = [f"--rerender={src}", f"--out={out}"]
  assert cli.main(["jaxfp8", "tp", *flags]) == 0  # on one device: --rerender needs no mesh
  result = json.loads(out.read_text())
  assert src.read_bytes() == raw
  rows = result["rows"]
  # The row-parallel psum fusion is now a collective: 34 us over 2 devices of the 40 us per device.
  assert [k["collective"] for k in rows[1]["kernels"]] == [False, True, False, False]
  assert rows[1]["collective_us_per_device"] == 17.0 and rows[1]["compute_us_per_device"] == 23.0
  assert rows[1]["speedup_kernel"] == 37.0 / 40.0 and rows[1]["speedup_compute"] == 37.0 / 23.0
  assert rows[1]["speedup_wall"] == 100.0 / 125.0
  assert rows[5]["collective_us_per_device"] == 10.0 and rows[5]["speedup_compute"] == 10.0 / 8.0
  assert "speedup_kernel" not in rows[4] and rows[4]["speedup_wall"] == 90.0 / 120.0
  # Nothing measured or checked changed, nor the run's own record.
  for before, after in zip(saved["rows"], rows, strict=True):
    recomputed = {"kernels", "collective_us_per_device", "compute_us_per_device", "speedup_compute"}
    assert {k: v for k, v in before.items() if k not in recomputed} == {
        k: v for k, v in after.items() if k not in recomputed}
    for k_before, k_after in zip(before.get("kernels", []), after.get("kernels", []), strict=True):
      assert {**k_before, "collective": None} == {**k_after, "collective": None}
  assert {k: v for k, v in result.items() if k not in ("rows", "timing_notes", "rederived")} == {
      k: v for k, v in saved.items() if k not in ("rows", "timing_notes")}
  assert result["timing_notes"] == tp_report.TIMING_NOTES
  [record] = result["rederived"]
  assert record["source"] == str(src) and record["source_sha256"] == hashlib.sha256(raw).hexdigest()
  assert record["command"] == "python -m jaxfp8 tp " + " ".join(flags)
  assert record["reclassified"] == [dict(name="psum_7_0_fusion_1", collective=True)]
  assert record["measurements"].startswith("unchanged")
  assert datetime.datetime.fromisoformat(record["date"]) > datetime.datetime.fromisoformat(saved["date"])
  md = out.with_suffix(".md").read_text()
  assert f"Command: `{saved['command']}`" in md and f"from `{src}`" in md and "`psum_7_0_fusion_1` -> collective" in md
  assert "Wall-clock columns are host-side" in md
  # The fastest calls that have kernel times (B column, 120 us, has none).
  assert "1 dev 90.0 us wall for 10.0 us of kernels; 2 dev 125.0 us wall for 40.0 us of kernels per device" in md
  assert "| A | 64 | 512 | 256 | row | mosaic+mosaic | 100.0 | 125.0 | 0.80x | 37.0 | 40.0 (17.0) | 0.93x | 1.61x |" in md
  # Again on its own output: the same numbers, nothing left to reclassify, a second record.
  assert cli.main(["jaxfp8", "tp", f"--rerender={out}", f"--out={tmp_path / 'again.json'}"]) == 0
  again = json.loads((tmp_path / "again.json").read_text())
  assert again["rows"] == rows and len(again["rederived"]) == 2 and again["rederived"][1]["reclassified"] == []


def test_rerender_refuses_what_it_cannot_do(tmp_path, capsys):
  src = tmp_path / "saved.json"
  src.write_text(json.dumps(_saved_result()))
  for flags, message in (([f"--rerender={src}"], "--rerender needs --out"),
                         ([f"--rerender={src}", "--out=x.json", "--m=1"], "--m would have no effect")):
    assert cli.main(["jaxfp8", "tp", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
  broken = _saved_result()
  broken["rows"][1]["kernels"].pop()  # records that no longer add up to the measured total
  with pytest.raises(ValueError, match="A M=64 row: its kernel records sum to 39.0 us per device"):
    tp_report.rederive(broken)
  assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(len(jax.local_devices()) >= 2, reason="this process has several devices")
def test_refuses_a_single_device(tmp_path, capsys):
  assert cli.main(["jaxfp8", "tp", "--shapes=256,256", "--m=1", f"--out={tmp_path / 'x.json'}"]) == 1
  err = capsys.readouterr().err
  assert "tensor parallelism needs 2 or more devices, and at most the 1 local ones" in err and err.count("\n") == 1
  assert not (tmp_path / "x.json").exists()
  with pytest.raises(args.CommandError, match="needs 2 or more devices"):
    tp.run([("256x256", 256, 256)], [1])


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
      if "kernel_us_per_device" in r and r["mode"] in ("single", "column"):  # nothing to communicate
        assert r["collective_us_per_device"] == 0, r["kernels"]
