"""A/B of one GEMM kernel between two source trees, in one process: this tree's pallas_kernels/gemm_<impl>.py
against a base tree's (e.g. a worktree of main), so that a kernel change is judged by the same machine state.

  git worktree add .wip/wt/base main
  python scripts/ab_gemm.py OUT.json --base_tree .wip/wt/base --implementation triton \
      --shapes "64,7168,18432;4096,24576,7168"

On the H200 the device copies the working tree only: carry the worktree (`carry=[".wip/wt"]`). Each shape runs both
kernels with the same config (this tree's planner's choice, `jaxfp8.gemm.plan`), each called directly under its own
`jax.jit` (the library's jitted entry point
would serve one cached trace to both), checks that the outputs agree, then times them interleaved: `--reps` rounds
of a CUPTI median of `--iterations` calls each, inputs rotated past L2; the best round of each is reported.
`--interpret` runs the kernels in interpret mode with wall-clock timing, for a CPU smoke run on tiny shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import _platform, gemm
from jaxfp8.tools import bench_gemm, timing
from jaxfp8.tools.args import UsageError, parse_shapes

BLOCK_SIZE = (128, 128)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_module(tree: str, implementation: str, alias: str):
  """The gemm_<implementation> kernel module of `tree` (pallas_kernels/, or jaxfp8/kernels/ in older trees), imported
  with its kernel package under `alias` (so two trees' copies coexist)."""
  for folder in ("pallas_kernels", "jaxfp8/kernels"):
    path = pathlib.Path(tree) / folder
    if (path / f"gemm_{implementation}.py").is_file():
      break
  else:
    raise FileNotFoundError(f"no gemm_{implementation}.py under {tree}/pallas_kernels or {tree}/jaxfp8/kernels")
  spec = importlib.util.spec_from_file_location(alias, path / "__init__.py", submodule_search_locations=[str(path)])
  package = importlib.util.module_from_spec(spec)
  sys.modules[alias] = package  # dataclasses look their module up while the file executes
  spec.loader.exec_module(package)
  if folder == "pallas_kernels":  # trees with a top-level kernel package import their siblings by its name
    sys.modules.setdefault("pallas_kernels", package)
  return importlib.import_module(f"{alias}.gemm_{implementation}")


def chosen_config(implementation: str, m: int, n: int, k: int, interpret: bool):
  """This tree's planner's config for the shape (the one a call of `jaxfp8.w8a8_block_fp8_matmul` runs)."""
  problem = gemm.problem(m, n, k, BLOCK_SIZE, a_s_column_major=True)
  return gemm.plan(problem, implementation=implementation, interpret=interpret).config


def kernel_fn(module, implementation: str, config, interpret: bool):
  """A jitted f(a_q, b_q, a_s_col, b_s) -> bf16 of `module`'s kernel with `config` (rebuilt as that module's class)."""
  if implementation == "mosaic":
    config = module.MosaicGemmConfig(**{f: getattr(config, f) for f in module.MosaicGemmConfig.__dataclass_fields__})
    # Launchers of older trees take no SM count (they ask the device themselves).
    extra = {"num_sms": _platform.num_sms()} if "num_sms" in inspect.signature(module.block_fp8_matmul).parameters else {}
    return jax.jit(lambda a, b, s_a, s_b: module.block_fp8_matmul(a, b, s_a, s_b, config=config, interpret=interpret,
                                                                  **extra))
  config = module.TritonGemmConfig.from_dict(config.to_dict())
  return jax.jit(lambda a, b, s_a, s_b: module.block_fp8_matmul(
      a, b, s_a, s_b, None, block_size=BLOCK_SIZE, a_s_column_major=True, out_dtype=jnp.bfloat16, config=config,
      interpret=interpret))


def compare(base, new, implementation: str, m: int, n: int, k: int, *, reps: int, iterations: int,
            interpret: bool) -> dict:
  a_q, a_s = bench_gemm.make_activation(jax.random.key(m), m, k, BLOCK_SIZE[1])
  arg_sets = []
  for i in range(1 if interpret else bench_gemm.rotation_sets(n * k, m * k)):
    b_q, b_s = bench_gemm.make_weight(jax.random.key(n + k + i), n, k, BLOCK_SIZE)
    arg_sets.append((a_q, b_q, a_s, b_s))
  config = chosen_config(implementation, m, n, k, interpret)
  fns = {name: kernel_fn(module, implementation, config, interpret) for name, module in (("base", base), ("new", new))}
  outs = {name: np.asarray(fn(*arg_sets[0]).astype(jnp.float32)) for name, fn in fns.items()}
  scale = float(np.linalg.norm(outs["base"])) or 1.0
  timer = (lambda fn: timing.median_wall_us(fn, arg_sets, iterations=iterations)) if interpret else (
      lambda fn: timing.median_kernel_us(fn, arg_sets, iterations=iterations))
  rounds = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      rounds[name].append(timer(fn))
  base_us, new_us = min(rounds["base"]), min(rounds["new"])
  return dict(m=m, n=n, k=k, config=str(config), base_us=base_us, new_us=new_us, speedup=base_us / new_us,
              identical=bool(np.array_equal(outs["base"], outs["new"])),
              rel_diff=float(np.linalg.norm(outs["new"] - outs["base"])) / scale,
              new_tflops=2 * m * n * k / new_us / 1e6,
              new_x_floor=new_us / (n * k / bench_gemm.HBM_BYTES_PER_S * 1e6),
              rounds_us=rounds)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out", help="JSON results file (rewritten after every shape)")
  parser.add_argument("--base_tree", required=True, help="the source tree to compare against, e.g. a worktree")
  parser.add_argument("--implementation", choices=("mosaic", "triton"), required=True)
  parser.add_argument("--shapes", required=True, help='"M,N,K;M,N,K" (jaxfp8.tools.args): N and K multiples of 128')
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--interpret", action="store_true", help="CPU smoke run: interpret mode, wall clock")
  args = parser.parse_args(argv)
  try:
    parsed = parse_shapes(args.shapes)
  except UsageError as e:
    parser.error(str(e))
  if any(not s.ms for s in parsed):
    parser.error(f"--shapes: every item needs its M (M,N,K), got {args.shapes!r}")
  shapes = [(m, s.n, s.k) for s in parsed for m in s.ms]
  base = load_module(args.base_tree, args.implementation, f"base_gemm_{args.implementation}")
  new = load_module(str(ROOT), args.implementation, f"new_gemm_{args.implementation}")
  result = {"description": f"{args.implementation} GEMM kernel: this tree (new) vs {args.base_tree} (base), "
                           "one process, best of --reps medians", "command": " ".join(sys.argv), "rows": []}
  for m, n, k in shapes:
    row = compare(base, new, args.implementation, m, n, k, reps=args.reps, iterations=args.iterations,
                  interpret=args.interpret)
    result["rows"].append(row)
    print(f"M={m:5d} N={n:6d} K={k:6d}  base {row['base_us']:9.2f} us  new {row['new_us']:9.2f} us  "
          f"x{row['speedup']:.3f}  identical={row['identical']} rel_diff={row['rel_diff']:.1e}", flush=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return result["rows"]


if __name__ == "__main__":
  main()
