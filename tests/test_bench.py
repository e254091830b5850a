"""`python -m jaxfp8 bench` and `python -m jaxfp8 plot` on CPU: every op of the command end to end on tiny problems
(the JSON's rows: their fields and their checks against the float64 reference, not only the exit status), the
arithmetic of the table (roofline, speedup over the best baseline), the MoE step list, and the benchmarks/ folder's
index. The GPU numbers come from the H200."""

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8.moe import layer as moe_layer
from helpers import MOSAIC_GEMM_IMPORTABLE
from jaxfp8.tools import args, bench, bench_gemm, bench_grouped, bench_moe, bench_report, bench_valid_rows, cli, timing

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
ROW_FIELDS = ("op", "shape", "m", "n", "k", "implementation", "role", "us", "rel_err", "bound", "within_bound")


def test_bench_command_on_a_tiny_shape_list(tmp_path):
  out = tmp_path / "bench_cpu.json"
  command = [sys.executable, "-m", "jaxfp8", "bench", "--shapes=1,256,512;8,256,512;4,128,256", "--iterations=2",
             f"--out={out}", "--seed=3"]
  proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "say nothing about GPU speed" in proc.stdout and "wall us" in proc.stdout
  assert "is within its bound" in proc.stdout
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
  checked = [r for r in rows if "within_bound" in r]
  assert all(r["within_bound"] for r in checked) and {r["implementation"] for r in rows} - {
      r["implementation"] for r in checked} == {"fp8_per_tensor"}  # a speed reference only, on coarser scales
  assert {r["m"] for r in rows if r["op"] == "quant" and r["k"] == 512} == {1, 8}
  md = (tmp_path / "bench_cpu.md").read_text()
  assert "say nothing about GPU speed" in md
  assert sum(line.startswith("| gemm |") for line in md.splitlines()) == len([r for r in rows if r["op"] == "gemm"])

  png = tmp_path / "bench_cpu.png"
  proc = subprocess.run([sys.executable, "-m", "jaxfp8", "plot", f"--json={out}", f"--out={png}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- each op on CPU, through the command line ----------------------------------------------------------------------

def _bench(tmp_path, rng, *argv) -> dict:
  out = tmp_path / "op.json"
  status = cli.main(["jaxfp8", "bench", *argv, "--iterations=1", f"--seed={int(rng.integers(2**31))}", f"--out={out}"])
  assert status == 0
  result = json.loads(out.read_text())
  assert result["complete"] and result["rows"]
  for r in result["rows"]:
    assert "error" not in r, r
    quantizer = "quant" in (r["op"], r["implementation"])  # §1's check is on codes and scales: no numeric bound
    missing = [f for f in ROW_FIELDS if f not in r and not (f == "bound" and quantizer)]
    if r["role"] == "ceiling" or (r["role"] == "part" and r["op"] == "moe"):
      assert r.get("note") or r.get("step"), r  # a speed reference on other scales; an MoE step (the steps' output
    else:                                       # is checked on their sum's row)
      assert not missing, (r["implementation"], missing)
    assert r["us"] > 0 and r.get("within_bound", True), r
  return result


def _by_impl(result, op):
  return {r["implementation"]: r for r in result["rows"] if r["op"] == op}


def test_quant_op_checks_codes_and_scales(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=quant", "--k=256,1024", "--m=3,8")
  rows = result["rows"]
  assert {(r["k"], r["m"], r["implementation"]) for r in rows} == {(k, m, "xla") for k in (256, 1024) for m in (3, 8)}
  assert all(r["scales_exact"] and r["codes_off"] == 0 and r["rel_err"] == 0.0 for r in rows)  # XLA is exact


def test_gemm_and_linear_ops(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=gemm,linear", "--shapes=5,256,384")
  gemm, linear = _by_impl(result, "gemm"), _by_impl(result, "linear")
  assert set(gemm) == {"xla", "dequant_bf16", "fp8_per_tensor"} and set(linear) == set(bench.IMPLEMENTATIONS["linear"])
  assert all(r["rel_err"] <= 5e-3 and r["bound"] == 5e-3 for r in linear.values() if r["implementation"] != "quant")
  assert linear["quant"]["scales_exact"] and gemm["xla"]["role"] == "ours"
  assert gemm["fp8_per_tensor"]["role"] == "ceiling"


def test_linear_grad_op(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=linear_grad", "--shapes=256,384", "--m=2,9")
  rows = _by_impl(result, "linear_grad")
  assert set(rows) == {"fp8_fwd", "fp8_fwd_bwd", "bf16_bwd", "bf16_layer"}
  assert rows["fp8_fwd_bwd"]["bound"] == 6e-2 and rows["bf16_bwd"]["bound"] == 5e-3
  assert all(r["y_rel_err"] <= 5e-3 for name, r in rows.items() if name != "fp8_fwd")
  assert rows["fp8_fwd_bwd"]["flops"] == 2 * rows["fp8_fwd"]["flops"] == 4 * 9 * 256 * 384
  assert "Linear forward + backward" in (tmp_path / "op.md").read_text()


def test_grouped_op_ragged_rows_and_floors(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=grouped", "--expert_shapes=4,256,256", "--routed_rows=40,7",
                  "--routing=balanced,skewed")
  rows = result["rows"]
  assert {(r["shape"], r["m"], r["implementation"]) for r in rows} == {
      (f"E4.256x256/{routing}", m, name) for routing in ("balanced", "skewed") for m in (40, 7)
      for name in ("xla", "ragged_dot_bf16", "dense_same_rows")}
  for r in rows:
    assert r["floor_us"] > 0 and r["x_floor"] == pytest.approx(r["us"] / r["floor_us"]) and r["layout"] == "ragged"
    assert r["flops"] == 2 * r["m"] * 256 * 256 and 1 <= r["active_experts"] <= 4
  assert {r["role"] for r in rows} == {"ours", "baseline", "reference"}
  assert "| E4.256x256/balanced (E=4, N=256, K=256) | 40 |" in (tmp_path / "op.md").read_text()


@pytest.mark.skipif(not MOSAIC_GEMM_IMPORTABLE, reason="the Mosaic GPU kernel does not import here")
def test_moe_steps_of_a_fused_plan_and_the_unfused_pairs_beside_them():
  """Where the plan puts the SiLU-and-mul quantizer in gate_up's epilogue and the permute in the tokens' quantizer,
  the steps name the fused steps (gate_up_silu_quant a GEMM in the non-GEMM share), and the kernels each replaces
  are timed after it on its inputs, with the share of live rows whose codes and scales are the fused ones
  (interpreted, 2 experts of 128 rows each: aligned rows)."""
  from jaxfp8.moe import planner as moe_planner
  layer = bench_moe.Layer(2, 2, 256, 128, 1, "qwen3")
  options = moe_planner.MoeOptions(implementation="mosaic", interpret=True)
  plan = moe_planner.plan(256, 1, 2, 256, 128, (128, 128), jnp.bfloat16, options)
  assert plan.fused_silu_quant and plan.permute_in_quantize, str(plan)
  route = bench_moe._route_fn(layer)
  steps = bench_moe.layer_steps(plan, route)
  assert [s.name for s in steps] == ["route", *moe_layer.steps(plan)] == [
      "route", "dispatch", "quantize_permute", "gate_up_silu_quant", "down", "combine"]
  assert [s.name for s in steps if s.gemm] == ["gate_up_silu_quant", "down"]
  values = bench_moe._layer_values(layer, jax.random.key(3))
  values["x"] = jax.random.normal(jax.random.key(4), (256, 256), jnp.float32).astype(jnp.bfloat16)
  bench_moe.run_steps(steps, values, lambda fn, arg_sets: (1.0, None))
  rows = []
  record = lambda name, role, **f: rows.append(dict(f, name=name, role=role))
  bench_moe._time_unfused(plan, values, lambda fn, arg_sets: (2.0, None), record)
  bench_moe._time_quantize_then_permute(layer, 256, values, lambda fn, arg_sets: (2.0, None), record,
                                        implementation="mosaic", interpret=True)
  assert [r["name"] for r in rows] == ["gate_up_unfused", "silu_quant_unfused", "quantize_unfused",
                                       "permute_unfused"], rows
  assert all(r["us"] == 2.0 and r["step"] and r["same_codes"] == 1.0 and r["same_scales"] == 1.0 for r in rows), rows


def test_moe_op_times_every_step_and_checks_the_layer(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=moe", "--moe_layers=tiny", "--tokens=1,9")
  for t in (1, 9):
    rows = {r["implementation"]: r for r in result["rows"] if r["m"] == t}
    steps = [name for name, r in rows.items() if r.get("step")]
    assert steps == ["route", *moe_layer.STEPS]
    summed = rows["steps_summed"]
    assert summed["us"] == pytest.approx(sum(rows[s]["us"] for s in steps))
    gemm_us = rows["gate_up"]["us"] + rows["down"]["us"]
    assert summed["non_gemm_share"] == pytest.approx(1 - gemm_us / summed["us"]) and summed["within_bound"]
    assert rows["layer"]["within_bound"] and rows["layer"]["rel_err"] <= 1e-2
    assert rows["ragged_dot_bf16"]["within_bound"]
    layer = rows["layer"]
    local = layer["local_rows"]
    assert local == t * 2 and layer["active_experts"] <= min(8, local)  # tiny: all 8 experts are local, top-2
    weight_bytes = layer["active_experts"] * (2 * 128 * 256 + 256 * 128 + (4 + 2) * 4)  # codes + a scale per block
    assert layer["weight_stream_us"] == pytest.approx(weight_bytes / 4.3e12 * 1e6)
    assert layer["x_weight_stream"] == pytest.approx(layer["us"] / layer["weight_stream_us"])
    assert layer["flops"] == 2 * local * 3 * 128 * 256 and "gate_up" in layer["plan"]
  assert "MoE layer step by step" in (tmp_path / "op.md").read_text()


def test_moe_op_on_an_expert_parallel_share(tmp_path, rng):
  """4 local experts of 16 (DeepSeek-V3's router): slots routed elsewhere add nothing, and a token count whose slots
  all went to other devices has no weight-streaming time (nothing to read) rather than a division by zero."""
  result = _bench(tmp_path, rng, "--ops=moe", "--moe_layers=tiny_ep4", "--tokens=1,2,12",
                  "--implementations=layer,ragged_dot_bf16")
  layers = {r["m"]: r for r in result["rows"] if r["implementation"] == "layer"}
  assert set(layers) == {1, 2, 12} and all(r["family"] == "deepseek_v3" for r in result["raw"]["moe"])
  for t, r in layers.items():
    assert 0 <= r["local_rows"] <= 2 * t and r["active_experts"] <= min(4, r["local_rows"])
    assert (r["weight_stream_us"] > 0) == (r["local_rows"] > 0) == ("x_weight_stream" in r)
  assert layers[12]["local_rows"] < 24  # 12 tokens x top-2 of 16 experts: some slots are another device's


def test_valid_rows_op(tmp_path, rng):
  result = _bench(tmp_path, rng, "--ops=valid_rows", "--valid_rows_cases=256x384:64:13;256x384:128:70")
  rows = {(r["bucket"], r["implementation"]): r for r in result["rows"]}
  assert set(rows) == {(b, c) for b in (64, 128) for c in ("bucket_valid", "bucket_full", "exact")}
  assert rows[64, "exact"]["rows_computed"] == 64 and rows[128, "exact"]["rows_computed"] == 128
  assert rows[64, "bucket_valid"]["valid_vs_exact"] == pytest.approx(rows[64, "bucket_valid"]["us"] /
                                                                     rows[64, "exact"]["us"])
  assert rows[128, "bucket_full"]["m"] == 70 and rows[128, "bucket_full"]["shape"] == "256x384@128"
  assert "| 256x384@64 | 13 |" in (tmp_path / "op.md").read_text()


def test_valid_rows_given_schedules_are_the_switchs_picks():
  """given_schedule times the schedule bucket_valid's switch picks for the live count."""
  from jaxfp8.gemm import mosaic
  schedules = mosaic.live_row_schedules(1024, 24576, 7168, jnp.bfloat16, 132)
  assert len(schedules.configs) > 1  # the count picks among several
  plan = types.SimpleNamespace(gemm=types.SimpleNamespace(config=schedules))
  for live in (0, 1, 64, 65, 300, 1000, 1024):
    want = mosaic.default_config(min(max(-(-live // 64), 1) * 64, 1024), 24576, 7168, jnp.bfloat16, num_sms=132)
    assert bench_valid_rows._given(plan, live) == want, live
  assert bench_valid_rows._given(types.SimpleNamespace(gemm=types.SimpleNamespace(config=None)), 5) is None


def test_valid_rows_cases_and_their_errors():
  assert bench_valid_rows.parse_cases("deepseek_v3.dense_down:256:70;256x384:64:13;256x384:128:70") == [
      ("deepseek_v3.dense_down", 7168, 18432, ((256, 70),)), ("256x384", 256, 384, ((64, 13), (128, 70)))]
  for text, message in (("256x384:64", "not weight:bucket:live"), ("256x384:64:70", "live=70 exceeds bucket=64"),
                        ("nope.x:64:1", "is not N,K")):
    with pytest.raises(args.UsageError, match=message):
      bench_valid_rows.parse_cases(text)


def test_moe_steps_reproduce_the_layer(rng):
  """The benchmark's one list of steps, run in order, is the layer: its output equals `fp8_moe`'s, bit for bit (the
  same plan on the same backend)."""
  layer = bench_moe.LAYERS["tiny"]
  values = bench_moe._layer_values(layer, jax.random.key(int(rng.integers(2**31))))
  values["x"] = jnp.asarray(rng.standard_normal((11, layer.hidden)), jnp.bfloat16)
  route = bench_moe._route_fn(layer)
  plan = bench_moe.moe_planner.plan(11, layer.top_k, layer.experts, layer.hidden, layer.intermediate,
                                    bench_moe.BLOCK, jnp.bfloat16)
  steps = bench_moe.layer_steps(plan, route)
  timed = bench_moe.run_steps(steps, values, lambda fn, arg_sets: 1.0)
  assert [s.name for s, _ in timed] == [s.name for s in steps] and [s.name for s in steps if s.gemm] == ["gate_up",
                                                                                                         "down"]
  whole = bench_moe.moe.fp8_moe(values["x"], values["ids"], values["weights"], values["w13_q"], values["w13_s"],
                                values["w2_q"], values["w2_s"])
  np.testing.assert_array_equal(np.asarray(values["out"], np.float32), np.asarray(whole, np.float32))


def test_moe_route_is_timed_on_every_other_router_implementation(rng):
  """Beside the route step, each router implementation its plan did not pick (here, on CPU, XLA's compare-and-count
  picked), on the same inputs and checked against the picked route's choice (the Mosaic router interpreted)."""
  layer = bench_moe.LAYERS["tiny"]
  values = bench_moe._layer_values(layer, jax.random.key(int(rng.integers(2**31))))
  values["x"] = jnp.asarray(rng.standard_normal((11, layer.hidden)), jnp.bfloat16)
  values["ids"], values["weights"] = jax.jit(bench_moe._route_fn(layer))(values["x"], values["gate_weight"],
                                                                         values["bias"])
  rows = {}
  bench_moe._time_other_route(layer, values, lambda fn, arg_sets: (3.0, None),
                              lambda name, role, **fields: rows.setdefault(name, fields))
  assert set(rows) == {"route_mosaic", "route_xla_merge"}
  for row in rows.values():
    assert row["same_ids"] and row["weights_max_diff"] < 1e-6 and row["us"] == 3.0, row


# ---- what to run -----------------------------------------------------------------------------------------------------

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
  cpu = bench.select_implementations(None, list(bench.OPS), on_gpu=False)
  assert "torch_scaled_mm" not in cpu["gemm"] and "mosaic" not in cpu["quant"] and "xla" in cpu["quant"]
  assert cpu["moe"] == ["layer", "steps", "ragged_dot_bf16"] and "masked_mosaic" not in cpu["grouped"]
  if not bench._platform.is_hopper():  # asked for by name, what cannot run here is refused, not an ERROR row
    with pytest.raises(args.CommandError, match="mosaic needs a Hopper GPU"):
      bench.select_implementations(["mosaic", "xla"], ["gemm"], on_gpu=False)
    with pytest.raises(args.CommandError, match=r"mosaic\[tile_n=256\] needs a Hopper GPU"):
      bench.select_implementations(None, ["gemm"], on_gpu=False, gemm_configs=["mosaic[tile_n=256]"])


def test_steps_run_the_quantizer_once_per_k():
  shapes = [("a", 256, 512), ("b", 128, 512), ("c", 256, 1024)]
  todo = bench.steps(["gemm", "quant"], shapes, [1, 8], {"b": [4]}, None)
  assert todo == [("gemm", ("a", 256, 512), [1, 8]), ("gemm", ("b", 128, 512), [4]),
                  ("gemm", ("c", 256, 1024), [1, 8]), ("quant", 512, [1, 4, 8]), ("quant", 1024, [1, 8])]
  assert bench.steps(["quant"], shapes, [2], {}, [7168, 2048]) == [("quant", 2048, [2]), ("quant", 7168, [2])]


def test_default_problems_of_the_other_ops():
  gpu = bench.problem_steps(["grouped", "moe", "valid_rows"], bench.Problems(), on_gpu=True)
  grouped = {item[0]: rows for op, item, rows in gpu if op == "grouped"}
  assert grouped["dsv3_ep8.gate_up"] == [8, 64, 256, 4096, 16384] and grouped["qwen3_30b_a3b.down"][-1] == 32768
  assert grouped["qwen3_235b_a22b_ep8.gate_up"] == [8, 64, 256, 4096, 16384]
  assert [(item, tokens) for op, item, tokens in gpu if op == "moe"] == [("deepseek_v3_ep8", [1, 64, 4096]),
                                                                        ("qwen3_30b_a3b", [1, 64, 4096])]
  assert [item[3] for op, item, _ in gpu if op == "valid_rows"] == [((4096, 2100), (1024, 300)), ((256, 70),),
                                                                    ((256, 70),)]
  layers = {name: bench_moe.LAYERS[name] for name in bench_moe.GPU_LAYERS}
  assert (layers["deepseek_v3_ep8"].experts, layers["deepseek_v3_ep8"].total_experts) == (32, 256)
  assert (layers["qwen3_30b_a3b"].hidden, layers["qwen3_30b_a3b"].intermediate) == (2048, 768)


def test_gemm_config_contenders(monkeypatch):
  from pallas_kernels.gemm_mosaic_common import Dim
  name, config = bench_gemm.config_contender("mosaic:tile_m=128,tile_n=256,wg_split=N,persistent=false")
  assert name == "mosaic[tile_m=128,tile_n=256,wg_split=N,persistent=false]"
  assert (config.tile_n, config.wg_split, config.persistent) == (256, Dim.N, False)
  name, config = bench_gemm.config_contender("triton:block_m=64,split_k=2")
  assert name.startswith("triton[") and (config.block_m, config.split_k) == (64, 2)
  for text, message in (("cuda:x=1", "starts with one of mosaic, triton"), ("mosaic:tile_q=1", "tile_q=1"),
                        ("mosaic:tile_m=100", "tile_m"), ("triton:block_m=x", "not an integer")):
    with pytest.raises(ValueError, match=message):
      bench_gemm.config_contender(text)
  with pytest.raises(args.UsageError, match="--gemm_configs: 'mosaic:tile_m=100'"):
    bench.parse_gemm_configs("mosaic:tile_m=100")
  calls = []  # the contender runs the implementation of its name with its config
  monkeypatch.setattr(bench_gemm.gemm, "w8a8_block_fp8_matmul", lambda *a, **kw: calls.append(kw) or a[0])
  bench_gemm.jax_contender(name, (128, 128), config=config)(jnp.zeros((2, 2)), None, None, None)
  assert calls[0]["implementation"] == "triton" and calls[0]["config"] is config


def test_grouped_config_contenders_go_to_the_grouped_op(monkeypatch):
  configs = bench.parse_gemm_configs("mosaic:tile_n=64,persistent=false;masked_mosaic:tile_n=256;triton:block_m=64")
  names = list(configs)
  assert names[1] == "masked_mosaic[tile_n=256]" and configs[names[1]].tile_n == 256
  monkeypatch.setattr(bench, "unavailable", lambda name, on_gpu: None)  # as on a Hopper GPU
  chosen = bench.select_implementations(["xla"], ["gemm", "grouped"], on_gpu=True, gemm_configs=names)
  assert chosen["gemm"] == ["xla", names[0], names[2]] and chosen["grouped"] == ["xla", names[0], names[1]]
  with pytest.raises(args.UsageError, match="none of"):
    bench.select_implementations(["xla"], ["grouped"], on_gpu=True, gemm_configs=[names[2]])
  calls = []  # the masked contenders run the masked API with the config; "_live" leaves unowned rows unwritten
  monkeypatch.setattr(bench_grouped.grouped, "masked_w8a8_block_fp8_matmul", lambda *a, **kw: calls.append(kw) or a[0])
  for name in (names[1], "masked_mosaic_live"):
    bench_grouped.contender(name, (128, 128), config=configs.get(name))(jnp.zeros((2, 2)), None, None, None, None)
  assert calls[0]["config"] is configs[names[1]] and calls[0]["zero_unowned_rows"]
  assert calls[1]["config"] is None and not calls[1]["zero_unowned_rows"]


# ---- the table's arithmetic -----------------------------------------------------------------------------------------

def test_roofline_and_speedup_arithmetic():
  from jaxfp8.tools import bench_quant
  m, n, k = 4096, 24576, 7168
  flops = 2 * m * n * k
  kw = dict(peak_tflops=1979.0, copy_bandwidth=4.3e12, block_size=(128, 128), quant_bytes=bench_quant.quant_bytes)
  fast = dict(op="gemm", shape="s", m=m, n=n, k=k, implementation="mosaic", role="ours", us=1000.0)
  base = dict(fast, implementation="dequant_bf16", role="baseline", us=2000.0)
  wrong = dict(fast, implementation="torch_scaled_mm", role="baseline", us=10.0, within_bound=False)
  rows = [fast, base, wrong]
  for r in rows:
    bench_report.add_roofline(r, **kw)
  assert fast["bound_by"] == "compute" and fast["flops"] == flops
  assert fast["tflops"] == pytest.approx(flops / 1e-3 / 1e12)
  assert fast["pct_roofline"] == pytest.approx(100 * flops / 1979e12 / 1e-3)
  gemm_bytes = m * k + m * (k // 128) * 4 + n * k + (n // 128) * (k // 128) * 4 + m * n * 2
  assert fast["bytes"] == gemm_bytes
  bench_report.add_baseline_ratios(rows)  # a baseline that failed its check is not a baseline to beat
  assert fast["speedup_vs_best_baseline"] == 2.0 and fast["best_baseline"] == "dequant_bf16"
  assert bench_report.failed_checks(rows) == [wrong]
  decode = dict(op="gemm", shape="s", m=1, n=n, k=k, implementation="mosaic", role="ours", us=50.0)
  bench_report.add_roofline(decode, **kw)
  assert decode["bound_by"] == "memory" and decode["roofline_us"] == pytest.approx(decode["bytes"] / 4.3e12 * 1e6)
  quant = dict(op="quant", shape="K=7168", m=64, n=None, k=7168, implementation="xla", role="baseline", us=4.0)
  bench_report.add_roofline(quant, **kw)
  assert "tflops" not in quant and quant["bound_by"] == "memory"
  assert quant["bytes"] == bench_quant.quant_bytes(64, 7168, 128)
  step = dict(op="moe", shape="tiny", m=8, n=128, k=256, implementation="sort", role="part", us=3.0)
  bench_report.add_roofline(step, **kw)  # neither FLOPs nor bytes of its own: no roofline
  assert "pct_roofline" not in step and "tflops" not in step


# ---- plots -----------------------------------------------------------------------------------------------------------

def test_plot_of_the_committed_quantizer_results(tmp_path):
  pytest.importorskip("matplotlib")
  from jaxfp8.tools import plot
  result = json.loads((BENCHMARKS / "quant_h200.json").read_text())
  label, panels, sizes = plot.series(result)
  assert "GB/s" in label and plot.pick_shapes(panels, sizes) == ["K=7168", "K=18432"]
  assert set(panels["K=7168"]) == {"mosaic", "triton", "xla"}
  out = plot.plot_file(str(BENCHMARKS / "quant_h200.json"), str(tmp_path / "q.png"))
  assert Path(out).stat().st_size > 10_000
  with pytest.raises(ValueError, match="not in the results"):
    plot.plot_result(result, ["K=1"])


@pytest.mark.parametrize("name, ops, shapes, lines", [
    ("gemm_h200.json", [("gemm", "gemm: TFLOP/s")], ["deepseek_v3.q_proj_no_lora", "deepseek_v3.dense_down"],
     {"mosaic", "triton", "xla", "dequant_bf16", "torch_scaled_mm", "fp8_per_tensor"}),
    ("linear_h200.json", [("gemm", "gemm: TFLOP/s"), ("linear", "linear: TFLOP/s")],
     ["deepseek_v3.q_proj_no_lora", "deepseek_v3.dense_down"],
     {"mosaic", "triton", "xla", "dequant_bf16", "torch_scaled_mm", "fp8_per_tensor"}),
    ("tp_h200.json", [(None, "speedup over 1 GPU")], ["deepseek_v3.q_proj_no_lora", "deepseek_v3.dense_down"],
     {"column", "column_gather"}),
])
def test_plot_of_the_committed_gemm_linear_and_tp_results(tmp_path, name, ops, shapes, lines):
  pytest.importorskip("matplotlib")
  from jaxfp8.tools import plot
  path = BENCHMARKS / name
  result = json.loads(path.read_text())
  assert plot.ops_in(result) == [op for op, _ in ops]  # one row of panels per op
  for op, label_part in ops:
    label, panels, sizes = plot.series(result, op)
    assert label_part in label and plot.pick_shapes(panels, sizes) == shapes
  assert set(plot.series(result, ops[0][0])[1][shapes[0]]) == lines
  fig = plot.plot_result(result, source=str(path))
  assert len([ax for ax in fig.axes if ax.get_visible()]) == 2 * len(ops)
  assert Path(plot.plot_file(str(path), str(tmp_path / "p.png"))).stat().st_size > 10_000


def test_plot_of_every_op_of_a_cpu_run(tmp_path, rng):
  pytest.importorskip("matplotlib")
  from jaxfp8.tools import plot
  result = _bench(tmp_path, rng, "--ops=quant,grouped,moe,valid_rows", "--k=256", "--m=2", "--expert_shapes=4,256,256",
                  "--routed_rows=16", "--moe_layers=tiny", "--tokens=3", "--valid_rows_cases=256x256:64:9")
  assert plot.ops_in(result) == ["quant", "grouped", "moe", "valid_rows"]
  label, panels, _ = plot.series(result, "moe")
  assert label == "moe: us" and set(panels["tiny"]) == {"layer", "steps_summed", "ragged_dot_bf16"}  # no steps
  fig = plot.plot_result(result, ops=["moe", "grouped"])
  assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["tiny", "E4.256x256/balanced"]
  with pytest.raises(ValueError, match=r"ops \['gemm'\] are not in the results"):
    plot.plot_result(result, ops=["gemm"])


def test_plots_keep_one_colour_per_implementation_and_name_their_file(tmp_path):
  pytest.importorskip("matplotlib")
  import matplotlib
  matplotlib.use("Agg")
  from jaxfp8.tools import plot
  colours = {}
  for name in ("linear_h200.json", "quant_h200.json", "gemm_decode_h200.json"):
    path = BENCHMARKS / name
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
  every_name = {name for roles in bench.ROLES.values() for name in roles if name != "steps"}
  assert every_name <= set(plot.COLORS), every_name - set(plot.COLORS)
  assert plot.color("some_new_baseline") == plot.color("some_new_baseline")


# ---- the benchmarks/ folder ------------------------------------------------------------------------------------------

# A file name that says when its result was made (a round's or a run's number, a date, a before/after) instead of
# what it is.
_HISTORY_NAME = re.compile(r"(^|[_.-])(s\d+|round\d*|session\d*|call\d+|\d{4}-\d\d-\d\d|\d{8}|before|after|"
                           r"restructure|old|new|tmp|wip)([_.-]|$)")


def test_benchmarks_folder_is_an_index_of_current_results():
  entries = sorted(p.name for p in BENCHMARKS.iterdir())
  assert len(entries) <= 40, f"{len(entries)} entries in benchmarks/: {entries}"
  named_by_history = [name for name in entries if _HISTORY_NAME.search(name)]
  assert not named_by_history, f"name results by op and device, not by round or date: {named_by_history}"
  readme = (BENCHMARKS / "README.md").read_text()
  links = re.findall(r"\]\(([^)#\s]+)\)", readme)
  assert len(links) > 20
  missing = sorted({link for link in links if not (BENCHMARKS / link).exists()})
  assert not missing, f"benchmarks/README.md links files that do not exist: {missing}"
  unlisted = [name for name in entries if name != "README.md" and f"({name})" not in readme]
  assert not unlisted, f"files in benchmarks/ that the index does not link: {unlisted}"


def test_every_plottable_result_has_its_plot():
  """`make plots` redraws the PNG beside each JSON: every JSON of bench or tp has one."""
  for path in sorted(BENCHMARKS.glob("*.json")):
    rows = json.loads(path.read_text())["rows"]
    plottable = rows and ("op" in rows[0] or "mode" in rows[0] or "contender" in rows[0] or "pct_copy_bw" in rows[0])
    assert not plottable or path.with_suffix(".png").exists(), path.name
  assert _HISTORY_NAME.search("bench_gemm_s11_h200.json") and not _HISTORY_NAME.search("gemm_decode_h200.json")


# ---- the GPU code path, CUPTI faked ---------------------------------------------------------------------------------

def test_gpu_branch_with_a_fake_cupti_timer(monkeypatch, tmp_path):
  """The GPU code path (CUPTI timer, measured copy bandwidth, datasheet peak) with CUPTI faked, on CPU."""
  from jaxfp8.tools import bench_quant

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
  assert all(r["us"] == 7.0 and r["within_bound"] for r in rows.values())
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


# ---- scripts/ab_gemm.py ----------------------------------------------------------------------------------------------

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
  shutil.copytree(ROOT / "pallas_kernels", base / "pallas_kernels", ignore=shutil.ignore_patterns("__pycache__"))
  source = (ROOT / "pallas_kernels" / "gemm_triton.py").read_text()
  doubled = source.replace("  out = acc.astype(o_ref.dtype)", "  out = (2 * acc).astype(o_ref.dtype)")
  assert doubled != source
  (base / "pallas_kernels" / "gemm_triton.py").write_text(doubled)
  [row] = _run_ab_gemm(tmp_path / "ab.json", base, "triton", "5,256,384")
  assert (row["m"], row["n"], row["k"]) == (5, 256, 384)
  assert not row["identical"] and row["rel_diff"] == pytest.approx(0.5, abs=1e-6)
  assert row["base_us"] > 0 and row["new_us"] > 0


def test_ab_gemm_of_a_tree_with_itself_is_identical(tmp_path):
  rows = _run_ab_gemm(tmp_path / "ab.json", ROOT, "mosaic", "64,256,256")
  assert [(r["identical"], r["rel_diff"]) for r in rows] == [(True, 0.0)]


def test_timed_gives_the_kernels_only_from_cupti(monkeypatch):
  assert timing.timed(lambda: None, [()], iterations=3, timer=lambda fn, sets, iterations: 7.5) == (7.5, None)
  records = [("gemm", 10.0), ("gather", 1.0), ("gemm", 12.0), ("gather", 3.0)]
  monkeypatch.setattr(timing, "kernel_records", lambda run, iterations, sync: records)
  us, kernels = timing.timed(lambda: None, [()], iterations=2)
  assert us == 13.0 and kernels == [dict(name="gemm", launches_per_call=1.0, us_per_call=11.0),
                                    dict(name="gather", launches_per_call=1.0, us_per_call=2.0)]
  assert bench_report.kernel_fields(kernels)["kernel_launches"] == 2.0 and bench_report.kernel_fields(None) == {}


def test_kernel_times_by_name_split_calls_and_kernels(monkeypatch):
  # Three calls of a split-K GEMM (two kernels each): per-call totals 12, 15, 13.5 -> median 13.5; each kernel's own
  # median beside it. A record count that is not a multiple of the calls is an error, not a silent mis-slice.
  records = [("gemm", 10.0), ("reduce", 2.0), ("gemm", 12.0), ("reduce", 3.0), ("gemm", 11.0), ("reduce", 2.5)]
  monkeypatch.setattr(timing, "kernel_records", lambda run, iterations, sync, warmup=2: records)
  assert timing.median_kernel_us_by_name(lambda: None, [()], iterations=3) == (13.5, {"gemm": 11.0, "reduce": 2.5})
  with pytest.raises(RuntimeError, match="not the same kernels each call"):
    timing.median_kernel_us_by_name(lambda: None, [()], iterations=4)


def test_mosaic_table_from_sweep_keeps_the_winners_by_more_than_2_percent():
  """scripts/mosaic_table_from_sweep.py: a config that beat the planner's by more than 2% at every M measured in a
  bucket (as many 64-row tiles) becomes one entry with all its fields and the three times; a bucket where no config
  did, or where the winner at one M lost at another, gets none; the entry's config builds back."""
  sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
  try:
    import mosaic_table_from_sweep as script
  finally:
    sys.path.pop(0)
  wide = "mosaic[tile_m=128,tile_n=256,max_concurrent_steps=4,num_compute_wgs=2,wg_split=N]"
  k2 = "mosaic[tile_m=128,tile_n=128,max_concurrent_steps=3,k_blocks_per_step=2,num_compute_wgs=2,wg_split=M]"
  rows = [dict(m=1024, n=3072, k=7168, implementation=name, us=us)
          for name, us in (("mosaic", 60.0), ("torch_scaled_mm", 44.0), (wide, 50.0), (k2, 47.0))]
  rows += [dict(m=1000, n=3072, k=7168, implementation=name, us=us)  # the same bucket: k2 wins here too, wide not
           for name, us in (("mosaic", 58.0), ("torch_scaled_mm", 43.0), (wide, 58.5), (k2, 46.0))]
  rows += [dict(m=512, n=6144, k=2560, implementation=name, us=us)
           for name, us in (("mosaic", 20.0), ("torch_scaled_mm", 19.0), (wide, 19.8), (k2, None))]
  rows += [dict(m=m, n=7168, k=2048, implementation=name, us=us)  # wins at 128, loses at 100: no entry
           for m, times in ((128, (10.0, 8.0)), (100, (10.0, 11.0))) for name, us in zip(("mosaic", wide), times)]
  table = script.table(dict(rows=rows, command="bench ...", device="NVIDIA H100 80GB HBM3", jax_version="0.11.2"),
                       "NVIDIA H100")
  assert list(table["entries"]) == ["3072,7168,1024"] and "NVIDIA H100 80GB HBM3" in table["source"]
  assert table["num_sms"] == 132
  entry = table["entries"]["3072,7168,1024"]
  assert (entry["us"], entry["heuristic_us"], entry["cublas_us"]) == (47.0, 60.0, 44.0)
  from jaxfp8.gemm import mosaic
  config = mosaic.entry_config(entry)
  assert (config.tile_m, config.tile_n, config.k_blocks_per_step, config.wg_split.name) == (128, 128, 2, "M")
  assert entry["config"]["warp_specialized"] is True and "grid_size" in entry["config"]


@pytest.mark.skipif(not MOSAIC_GEMM_IMPORTABLE, reason="the Mosaic GEMM's row alignment reads its kernel module")
def test_gemm_bench_gives_mosaic_the_quantizers_row_padded_buffers(monkeypatch):
  """Where the Mosaic GEMM's row alignment pads (below 64 rows a whole decode tile, M % 8 != 0 to a multiple of 8),
  its contender reads the quantizer's padded buffers with out_rows=M, as jaxfp8.linear calls it; elsewhere the rows
  as they are. The launcher then copies nothing."""
  seen = []

  def contender(name, block_size, out_rows=None, config=None):
    def fn(a_q, b_q, a_s, b_s):
      seen.append((a_q.shape[0], a_s.shape[1], out_rows))
      return jnp.zeros((out_rows or a_q.shape[0], b_q.shape[0]), jnp.float32)
    return fn

  monkeypatch.setattr(bench_gemm, "jax_contender", contender)
  b_q, b_s = bench_gemm.make_weight(jax.random.key(0), 256, 256, (128, 128))
  for m, rows in ((7, 64), (100, 104), (511, 512), (128, 128)):
    a_q, a_s = bench_gemm.make_activation(jax.random.key(m), m, 256, 128)
    records = []
    seen.clear()
    bench_gemm._time_jax("mosaic", contender("mosaic", (128, 128)), [(a_q, b_q, a_s, b_s)], (128, 128),
                         (np.zeros((1, 8)), [0], np.arange(8)), 1, lambda name, **kw: records.append(kw),
                         lambda fn, arg_sets, iterations: (fn(*arg_sets[0]), 1.0)[1])
    assert seen and set(seen) == {(rows, rows, m if rows > m else None)}, (m, seen)
    assert (rows > m) == (f"{rows}-row buffers" in (records[0].get("note") or "")), (m, records)
