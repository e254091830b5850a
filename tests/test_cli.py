"""The command line, `python -m jaxfp8 COMMAND`: per-command help, the one parser of --shapes and --m, one-line errors
where a command cannot run (checked in subprocesses on CPU, as a user sees them), tune's search space, and the
scripts (each compiles and imports)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxfp8 import gemm
from pallas_kernels import gemm_triton
from jaxfp8.tools import args, bench, cli, timing, tune

ROOT = Path(__file__).resolve().parent.parent
# Each command's own flags, and flags of other commands that its help must not show.
OWN_FLAGS = {
    "check": ({"--implementations", "--k", "--m", "--seed"}, {"--ops", "--max_configs", "--json", "--rerender"}),
    "bench": ({"--ops", "--shapes", "--models", "--m", "--k", "--implementations", "--iterations", "--peak_tflops",
               "--time_budget_s", "--out", "--expert_shapes", "--routed_rows", "--routing", "--moe_layers", "--tokens",
               "--valid_rows_cases", "--gemm_configs"}, {"--max_configs", "--json", "--panels", "--rerender",
                                                          "--parallel"}),
    "tune": ({"--shapes", "--m", "--max_configs", "--iterations", "--out", "--block_size"},
             {"--ops", "--peak_tflops", "--json", "--rerender", "--implementations"}),
    "plot": ({"--json", "--out", "--panels", "--ops"}, {"--shapes", "--m", "--max_configs", "--rerender"}),
    "tp": ({"--shapes", "--models", "--m", "--devices", "--parallel", "--rerender", "--out", "--implementation"},
           {"--ops", "--max_configs", "--json", "--peak_tflops", "--shapes_json"}),
}


def _cli(*argv: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
  """`python -m jaxfp8 ARGV` in a subprocess on CPU, as a user runs it."""
  return subprocess.run([sys.executable, "-m", "jaxfp8", *argv], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))


def _flags_in(text: str) -> set[str]:
  return {line.split(":")[0].strip() for line in text.splitlines() if line.startswith("  --")}


# ---- help ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", list(OWN_FLAGS))
def test_each_command_help_lists_its_own_flags(command, capsys):
  assert cli.main(["jaxfp8", command, "--help"]) == 0
  out = capsys.readouterr().out
  own, others = OWN_FLAGS[command]
  shown = _flags_in(out)
  assert own <= shown, own - shown
  assert not shown & others, shown & others
  assert out.startswith(f"usage: python -m jaxfp8 {command} ")
  assert not any("absl" in flag or "logtostderr" in flag for flag in shown)  # absl's own flags stay out


def test_help_in_a_subprocess_and_the_overview():
  proc = _cli("tune", "--help")
  assert proc.returncode == 0 and "--max_configs" in proc.stdout and "--ops" not in proc.stdout, proc.stderr
  proc = _cli("--help")
  assert proc.returncode == 0, proc.stderr
  for command in cli.COMMANDS:
    assert f"\n  {command} " in proc.stdout
  assert "usage: python -m jaxfp8 check" in proc.stdout  # the default command's flags follow


def test_no_argparse_and_import_jaxfp8_loads_no_tool():
  offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "jaxfp8").rglob("*.py") if "argparse" in p.read_text()]
  assert offenders == []
  code = ("import sys, jaxfp8; loaded = [m for m in sys.modules if m.startswith('jaxfp8.tools')]; "
          "assert not loaded, loaded")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr


def test_tool_modules_and_functions_stay_small():
  for path in sorted((ROOT / "jaxfp8" / "tools").glob("*.py")) + [ROOT / "jaxfp8" / "__main__.py"]:
    text = path.read_text()
    assert text.count("\n") <= 500, f"{path.name}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.FunctionDef):
        assert node.end_lineno - node.lineno < 85, f"{path.name}: {node.name} has {node.end_lineno - node.lineno} lines"


# ---- the shapes parser -----------------------------------------------------------------------------------------------

def test_shapes_in_both_forms():
  assert args.parse_shapes("24576,7168; 576,7168") == [("24576x7168", 24576, 7168, None), ("576x7168", 576, 7168, None)]
  # M,N,K: the Ms of one weight collected, in order of appearance.
  assert args.parse_shapes("64,24576,7168;4096,24576,7168;1,576,7168") == [
      ("24576x7168", 24576, 7168, (64, 4096)), ("576x7168", 576, 7168, (1,))]
  assert args.parse_shapes("1x256x512") == [("256x512", 256, 512, (1,))]
  assert args.parse_ms("1,16,64,16") == (1, 16, 64)


def test_shapes_by_model_name():
  dsv3 = args.parse_shapes("deepseek_v3")
  assert ("deepseek_v3.q_proj_no_lora", 24576, 7168, None) in dsv3 and len(dsv3) == 11
  assert not [s for s in args.parse_shapes("all") if s.name.startswith("unaligned")]
  two = args.parse_shapes("deepseek_v3.q_proj_no_lora;qwen3_32b/down_proj;deepseek_v3.q_proj_no_lora")
  assert [(s.name, s.n, s.k) for s in two] == [("deepseek_v3.q_proj_no_lora", 24576, 7168),
                                               ("qwen3_32b.down_proj", 5120, 25600)]
  mixed = args.parse_shapes("qwen3_4b.o_proj;8,256,512")
  assert mixed == [("qwen3_4b.o_proj", 2560, 4096, None), ("256x512", 256, 512, (8,))]
  # --shapes_json: another table of models.
  table = {"toy": {"up": (512, 256)}}
  assert args.parse_shapes("toy", table=table) == [("toy.up", 512, 256, None)]


@pytest.mark.parametrize("text, flag, message", [
    ("1,2,3,4", "--shapes", "'1,2,3,4' is not N,K, M,N,K"),
    ("0,128", "--shapes", "'0,128': M, N and K must be positive"),
    ("a,b", "--shapes", "'a,b' is not N,K, M,N,K"),
    ("256,512;no_such_model", "--shapes",
     "'no_such_model' is not N,K, M,N,K (positive integers) or a shapes.json model"),
    ("deepseek_v3.nope", "--shapes", "deepseek_v3 has no layer 'nope'"),
    ("256,512;1,256,512", "--shapes", "256,512 is given both with and without M"),
    ("", "--shapes", "no shapes given"),
    ("256,512", "--models", "'256,512' is not a shapes.json model"),
])
def test_shapes_errors_name_the_flag_and_the_token(text, flag, message):
  with pytest.raises(args.UsageError) as error:
    args.parse_shapes(text, flag=flag, numbers=flag == "--shapes")
  assert str(error.value).startswith(f"{flag}: ") and message in str(error.value)
  assert isinstance(error.value, ValueError) and error.value.status == 2


def test_ms_errors_and_shapes_with_their_own_ms():
  for text, message in (("1,a", "--m: 'a' is not a positive integer (in '1,a')"), ("0", "--m: '0' is not a positive"),
                        ("", "--m: no values given")):
    with pytest.raises(args.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
      args.parse_ms(text)
  shapes = args.parse_shapes("1,256,512;4,256,512;128,256")
  assert args.shapes_and_ms(shapes, (2,)) == ([("256x512", 256, 512), ("128x256", 128, 256)], {"256x512": [1, 4]})
  with pytest.raises(args.UsageError, match="every --shapes item gives its own M"):
    args.shapes_and_ms(shapes[:1], (2,))


def test_bench_takes_every_form_in_process(tmp_path, monkeypatch):
  """The command line feeds the parser's shapes and the quantizer's --k to bench.run (a fast fake run)."""
  seen = {}
  monkeypatch.setattr(bench, "run", lambda *a, **kw: seen.update(args=a, **kw) or dict(rows=[]))
  assert cli.main(["jaxfp8", "bench", "--shapes=1,256,512;4,256,512;qwen3_4b.o_proj", "--m=8", "--ops=gemm,quant",
                   "--k=2048,512", "--block_size=128,128"]) == 0
  ops, shape_list, ms, implementations, out = seen["args"]
  assert ops == ["gemm", "quant"] and ms == (8,) and implementations is None and out is None
  assert shape_list == [("256x512", 256, 512), ("qwen3_4b.o_proj", 2560, 4096)]
  assert seen["problems"].ms_by_shape == {"256x512": [1, 4]} and seen["problems"].quant_ks == (2048, 512)
  assert seen["command"] == "python -m jaxfp8 bench '--shapes=1,256,512;4,256,512;qwen3_4b.o_proj' --m=8 " \
                            "--ops=gemm,quant --k=2048,512 --block_size=128,128"


def test_bench_quant_at_given_widths_on_cpu(tmp_path):
  out = tmp_path / "q.json"
  assert cli.main(["jaxfp8", "bench", "--ops=quant", "--k=256,512", "--m=2", "--iterations=1", f"--out={out}"]) == 0
  result = json.loads(out.read_text())
  assert {(r["op"], r["k"], r["m"], r["implementation"]) for r in result["rows"]} == {
      ("quant", 256, 2, "xla"), ("quant", 512, 2, "xla")}
  assert result["quant_ks"] == [256, 512] and result["cpu_warning"] and "WALL-CLOCK" in result["timing"]


def test_the_main_job_checks_every_op_against_the_reference():
  """`python -m jaxfp8` (`make run`): the quantizer, the linear on shapes.json weights and a small MoE layer of each
  family, each checked against the float64 reference, in one table; exit 0; what CPU leaves out is said."""
  proc = _cli(timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  table = proc.stdout.split("\nop ", 1)[1]
  rows = [line.split() for line in table.splitlines()[2:] if line.startswith(("quant ", "linear ", "moe "))]
  assert {row[0] for row in rows} == {"quant", "linear", "moe"} and len(rows) == 8
  assert all(" ok " in f" {' '.join(row)} " and "FAILED" not in row for row in rows), table
  assert "deepseek_v3.q_a_proj 1536x7168, M=5" in table and "qwen3_4b.qkv_proj" in table
  assert "deepseek_v3 router" in table and "qwen3 router" in table
  assert "no NVIDIA GPU" in table  # why the planner chose XLA here
  assert "not checked: quant mosaic: runs in interpret mode on CPU" in proc.stdout
  assert "8 checks in" in proc.stdout and "every output within the contract's bound" in proc.stdout


def test_a_failed_check_exits_1(monkeypatch, capsys):
  from jaxfp8.tools import check
  real = check.linear_case

  def wrong(layer, m):
    case = real(layer, m)
    return check.Case(case.op, case.shape, lambda impl, rng: check.Outcome("xla", "xla", "-", "rel err 1", False, 1.0))
  monkeypatch.setattr(check, "LINEAR_CASES", check.LINEAR_CASES[:1])
  monkeypatch.setattr(check, "MOE_CASES", ())
  monkeypatch.setattr(check, "linear_case", wrong)
  assert cli.main(["jaxfp8", "check", "--m=2", "--k=256"]) == 1
  out = capsys.readouterr().out
  assert "FAILED" in out and "1 FAILED" in out


# ---- errors: one line on stderr, a non-zero exit status, no traceback ------------------------------------------------

def _one_line_error(proc: subprocess.CompletedProcess, status: int, *parts: str) -> None:
  assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
  for part in parts:
    assert part in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, status, parts", [
    (["tune", "--out=/tmp/never_written.json"], 1,
     ["python -m jaxfp8 tune: needs an NVIDIA GPU", "this machine has cpu"]),
    (["tune"], 2, ["python -m jaxfp8 tune: --out is required"]),
    (["bench", "--ops=quant", "--implementations=mosaic,triton"], 1,
     ["python -m jaxfp8 bench: --implementations: mosaic needs a Hopper GPU", "triton needs an NVIDIA GPU"]),
    (["bench", "--shapes=1,256,512;a,b"], 2, ["python -m jaxfp8 bench: --shapes: 'a,b'"]),
    (["bench", "--m=1,x"], 2, ["--m: 'x' is not a positive integer"]),
    (["bench", "--nosuchflag=1"], 2, ["Unknown command line flag 'nosuchflag'"]),
    (["bench", "--ops=grouped", "--expert_shapes=dsv3.gate_up"], 2,
     ["--expert_shapes: 'dsv3.gate_up' is neither E,N,K nor one of dsv3_ep8.gate_up"]),
    (["bench", "--ops=gemm", "--routed_rows=8"], 2,
     ["--routed_rows: a flag of the grouped op, but --ops has no grouped"]),
    (["bench", "--ops=grouped_gemm"], 2, ["--ops: expected some of quant, gemm, linear, linear_grad, grouped, moe"]),
    (["bench", "--ops=moe", "--moe_layers=nope"], 2, ["--moe_layers: unknown ['nope']"]),
    (["bench", "--ops=grouped", "--routing=zipf"], 2, ["--routing: expected some of balanced, skewed"]),
    (["bench", "--ops=valid_rows", "--valid_rows_cases=256x256:8"], 2, ["is not weight:bucket:live"]),
    (["bench", "--gemm_configs=mosaic:tile_m=100"], 2, ["--gemm_configs: 'mosaic:tile_m=100'"]),
    (["bench", "--gemm_configs=mosaic:tile_n=256"], 1, ["mosaic[tile_n=256] needs a Hopper GPU"]),
    (["tp", "--shapes=256,256", "--m=1", "--out=/tmp/never_written.json"], 1,
     ["python -m jaxfp8 tp: tensor parallelism needs 2 or more devices"]),
    (["nosuchcommand"], 2, ["python -m jaxfp8: unknown command 'nosuchcommand'"]),
])
def test_commands_that_cannot_run_here_say_so_in_one_line(argv, status, parts):
  _one_line_error(_cli(*argv), status, *parts)


def test_plot_without_matplotlib_says_which_extra(tmp_path):
  fake = tmp_path / "no_matplotlib" / "matplotlib"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
  path = os.pathsep.join([str(fake.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])
  proc = _cli("plot", f"--json={ROOT / 'benchmarks' / 'quant_h200.json'}", f"--out={tmp_path / 'q.png'}",
              env={"PYTHONPATH": path})
  _one_line_error(proc, 1, "python -m jaxfp8 plot: needs matplotlib: pip install 'jaxfp8[notebooks]'")
  assert not (tmp_path / "q.png").exists()


# ---- tune's search space ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 16, 64, 256, 4096])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 64), (128, 64)])
def test_tune_candidates_come_from_the_declared_space(m, block_size):
  n, k = 7168, 2048
  space = tune.candidate_space(m, n, k, block_size)
  heuristic = gemm.triton.heuristic_config(m, n, k, block_size)
  assert space[0] == heuristic
  assert all(not gemm_triton.config_problems(c, block_size) for c in space)  # every candidate can run
  launched = [dataclasses.replace(c, split_k=gemm_triton.split_k_steps(k, c)[1]) for c in space]
  assert len(set(launched)) == len(space)  # distinct as launched
  regime = tune.SEARCH_SPACE["decode" if m <= tune.DECODE_MAX_M else "prefill"]
  for config in space:
    for axis, values in regime.items():
      assert getattr(config, axis) in (*values, getattr(heuristic, axis)), (axis, config)
  axes = tune.search_space(m, heuristic)
  distances = [sum(abs(v.index(getattr(c, a)) - v.index(getattr(heuristic, a))) for a, v in axes.items())
               for c in space]
  assert distances == sorted(distances)  # nearest to the heuristic first
  assert tune.candidate_configs(m, n, k, block_size, max_configs=7) == space[:7]


def test_tune_says_how_many_configs_it_left_out(monkeypatch, tmp_path):
  def fake_cupti(fn, arg_sets, *, iterations=30, sync=jax.block_until_ready):
    sync(fn(*arg_sets[0]))
    return 1.0

  monkeypatch.setattr(timing, "median_kernel_us", fake_cupti)
  out = tmp_path / "table.json"
  lines = []
  table = tune.tune([(200, 384)], [8], (128, 128), str(out), max_configs=2, iterations=1, interpret=True,
                    log=lines.append)
  total = len(tune.candidate_space(8, 200, 384, (128, 128)))
  [entry] = table["entries"].values()
  assert total > 2 and entry["search_space"] == total and entry["left_out"] == total - 2
  left_out = f"{total - 2} left out by max_configs=2"
  assert f"N=200 K=384 M=8: 2 of the {total} configs of the search space; {left_out}" in lines
  assert lines[-2].endswith(f"{total - 2} of the search space left out]"), lines[-2]


def test_tune_writes_only_where_told(tmp_path):
  # --out is required (the shipped table is copied into the package by hand); on CPU nothing is written.
  assert tune.FLAGS["out"].default is None
  proc = _cli("tune", f"--out={tmp_path / 't.json'}", "--shapes=256,512", "--m=8")
  assert proc.returncode == 1 and not (tmp_path / "t.json").exists()


# ---- scripts ---------------------------------------------------------------------------------------------------------

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def test_every_script_compiles_and_imports(tmp_path):
  for path in SCRIPTS:
    py_compile.compile(str(path), cfile=str(tmp_path / (path.stem + ".pyc")), doraise=True)
  for path in sorted((ROOT / "scripts").glob("*.sh")):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, (path.name, proc.stderr)
  # Importing runs nothing: every script's work is under `if __name__ == "__main__"`. Each script is its own program,
  # so the absl flags one defines on the global FLAGS are removed before the next is imported (two may share a name).
  code = "\n".join([
      "import importlib.util, sys",
      "from absl import flags",
      "sys.path.insert(0, 'scripts')",
      "for path in sys.argv[1:]:",
      "  before = set(flags.FLAGS)",
      "  spec = importlib.util.spec_from_file_location(path.rsplit('/', 1)[-1][:-3].replace('-', '_'), path)",
      "  module = importlib.util.module_from_spec(spec)",
      "  spec.loader.exec_module(module)",
      "  for name in set(flags.FLAGS) - before:",
      "    delattr(flags.FLAGS, name)",
      "print('imported', len(sys.argv) - 1)"])
  proc = subprocess.run([sys.executable, "-c", code, *(str(p.relative_to(ROOT)) for p in SCRIPTS)], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines() == [f"imported {len(SCRIPTS)}"], proc.stdout[-3000:]


def test_gpu_round_runs_only_commands_that_exist():
  text = (ROOT / "scripts" / "gpu_round.sh").read_text()
  assert "-m jaxfp8." not in text  # no module of jaxfp8 runs as a command of its own
  for line in text.splitlines():
    if "-m jaxfp8 " in line and not line.lstrip().startswith("#"):
      command = line.split("-m jaxfp8 ", 1)[1].split()[0]
      assert command in cli.COMMANDS, line
