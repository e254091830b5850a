"""Determinism on the GPU: every kernel run 20 times on the same inputs must give bit-identical outputs.

  python3 scripts/determinism.py OUT.json [--runs 20]

For each kernel of scripts/reliability_kernels.py and each of its shapes (aligned and unaligned), fresh random inputs
(a new seed per shape and per invocation), 20 calls; the raw bytes of every output are compared with the first call's.
Prints a table, writes JSON, exits 1 if any output differed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import reliability_kernels as rk  # noqa: E402


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("--runs", type=int, default=20)
  args = parser.parse_args()
  base_seed = int(np.random.SeedSequence().entropy % 2**31)
  rows, failed = [], False
  for name, (_, _, shapes) in rk.KERNELS.items():
    for shape in shapes:
      row = dict(kernel=name, shape=list(shape), runs=args.runs, seed=base_seed)
      if why := rk.available(name):
        row.update(status="skipped", reason=why)
        rows.append(row)
        continue
      try:
        fn, inputs = rk.make_call(name, shape, base_seed + len(rows))
        first = [np.asarray(o).tobytes() for o in jax.tree.leaves(fn(*inputs))]
        differing = 0
        for _ in range(args.runs - 1):
          outs = [np.asarray(o).tobytes() for o in jax.tree.leaves(fn(*inputs))]
          differing += outs != first
        row.update(status="identical" if differing == 0 else "DIFFERENT", differing_runs=differing)
        failed |= differing > 0
      except Exception as e:  # a kernel that fails to run is reported, and fails the script
        row.update(status="ERROR", error=f"{type(e).__name__}: {e}"[:500])
        failed = True
      rows.append(row)
      print(f"{name:16s} {str(tuple(shape)):20s} {row['status']:10s} {row.get('differing_runs', '')}", flush=True)
  result = dict(date=datetime.datetime.now(datetime.UTC).isoformat(), device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, command=" ".join(sys.argv), results=rows)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print("| kernel | shape | runs | result |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['kernel']} | {tuple(r['shape'])} | {r['runs']} | {r['status']} {r.get('reason', r.get('error', ''))} |")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
