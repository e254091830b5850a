"""Summarizes Nsight Compute's source page (per-SASS-instruction counters) for each kernel of a report.

On the H200 (where ncu runs):
  ncu --profile-from-start off --clock-control none --set full --import-source yes --export $OUT/gemm \
      python3 scripts/ncu_gemm.py
  ncu -i $OUT/gemm.ncu-rep --page source --csv --print-source sass | gzip > $OUT/gemm_src.csv.gz
Here: python scripts/ncu_source_summary.py gemm_src.csv.gz [--top 30] [--loop_count N]

For each kernel: the warp-stall reasons over all samples, executed instructions and stall samples by opcode, the
instructions that hold the most samples, and the samples of each run of instructions executed equally often (a
loop body shows as one run, e.g. the consumers' K loop). --loop_count N splits the instructions executed exactly N
times into FFMA / wgmma wait / barrier-wait branch / other, with their stall reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path: str):
  """Yields (kernel name, column index, rows) for each kernel section of the CSV."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(f))
  name, header, body = None, None, []
  for row in rows:
    if row and row[0] == "Kernel Name":
      if name is not None:
        yield name, header, body
      name, header, body = row[1], None, []
    elif row and row[0] == "Address":
      header = {column: i for i, column in enumerate(row)}
    elif row and name is not None:
      body.append(row)
  if name is not None:
    yield name, header, body


def _int(row, ix, column) -> int:
  return int(row[ix[column]] or 0)


def _opcode(source: str) -> str:
  words = source.split()
  if not words:
    return ""
  op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
  return op.split(".")[0]


def summarize(name, ix, rows, top: int, loop_count: int | None) -> None:
  stalls = [c for c in ix if c.startswith("stall_") and "Not Issued" not in c]
  samples = sum(_int(r, ix, SAMPLES) for r in rows) or 1
  executed = sum(_int(r, ix, EXECUTED) for r in rows) or 1
  print(f"===== {name}: {len(rows)} instructions, {samples} samples, {executed} executed")
  totals = collections.Counter({c[6:]: sum(_int(r, ix, c) for r in rows) for c in stalls})
  print(" stall reasons:", ", ".join(f"{c}={v / samples:.1%}" for c, v in totals.most_common(10)))
  by_exec, by_samples = collections.Counter(), collections.Counter()
  for r in rows:
    op = _opcode(r[ix["Source"]].strip())
    by_exec[op] += _int(r, ix, EXECUTED)
    by_samples[op] += _int(r, ix, SAMPLES)
  print(" executed by opcode:", ", ".join(f"{o}={v / executed:.1%}" for o, v in by_exec.most_common(12)))
  print(" samples by opcode:", ", ".join(f"{o}={v / samples:.1%}" for o, v in by_samples.most_common(12)))
  runs: list[tuple[int, list]] = []
  for r in rows:
    count = _int(r, ix, EXECUTED)
    if runs and runs[-1][0] == count:
      runs[-1][1].append(r)
    else:
      runs.append((count, [r]))
  per_count, width = collections.Counter(), collections.Counter()
  for count, members in runs:
    per_count[count] += sum(_int(r, ix, SAMPLES) for r in members)
    width[count] += len(members)
  print(" samples by execution count (a loop body is one count):")
  for count, s in per_count.most_common(6):
    print(f"   executed {count:>10} times: {width[count]:4d} instructions, {s / samples:6.1%} of samples")
  print(f" top {top} instructions by samples:")
  for r in sorted(rows, key=lambda r: -_int(r, ix, SAMPLES))[:top]:
    reasons = sorted(((_int(r, ix, c), c[6:]) for c in stalls), reverse=True)[:2]
    print(f"   {_int(r, ix, SAMPLES) / samples:6.1%} x{_int(r, ix, EXECUTED):>9} {r[ix['Source']].strip()[:58]:58s} "
          + ", ".join(f"{c} {v}" for v, c in reasons if v))
  if loop_count is not None:
    groups = collections.defaultdict(collections.Counter)
    for r in rows:
      if _int(r, ix, EXECUTED) != loop_count:
        continue
      source = r[ix["Source"]].strip()
      op = _opcode(source)
      group = ("FFMA" if op == "FFMA" else "wgmma wait" if "DEPBAR" in source else
               "barrier-wait branch" if op == "BRA" else "other")
      groups[group]["#"] += 1
      for c in stalls:
        groups[group][c[6:]] += _int(r, ix, c)
    loop_samples = sum(sum(v for k, v in g.items() if k != "#") for g in groups.values()) or 1
    print(f" the {loop_count}-times loop body:")
    for group, g in groups.items():
      s = sum(v for k, v in g.items() if k != "#") or 1
      print(f"   {group:20s} {g['#']:4d} instructions, {s / loop_samples:6.1%} of the loop's samples: "
            + ", ".join(f"{k}={v / s:.0%}" for k, v in g.most_common(7) if k != "#"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("csv", help="ncu --page source --csv output (optionally .gz)")
  parser.add_argument("--top", type=int, default=20)
  parser.add_argument("--loop_count", type=int, default=None)
  args = parser.parse_args()
  for name, ix, rows in kernels(args.csv):
    summarize(name, ix, rows, args.top, args.loop_count)


if __name__ == "__main__":
  main()
