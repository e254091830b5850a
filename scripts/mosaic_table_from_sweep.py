"""A Mosaic GEMM measured table (jaxfp8/gemm/configs/mosaic_gemm_<device>.json) from a schedule sweep's bench JSON.

  python scripts/mosaic_table_from_sweep.py SWEEP.json "NVIDIA H100" jaxfp8/gemm/configs/mosaic_gemm_h100.json [SMS]

The sweep is `python -m jaxfp8 bench --ops=gemm --shapes="M,N,K;..." --implementations=mosaic,torch_scaled_mm
--gemm_configs="mosaic:...;..."` on the device, run with no table for it in `MEASURED_TABLES` (its "mosaic" rows
are then the heuristic's). An entry, keyed "N,K,M", is a config that ran more than 2% faster than the heuristic's
at every M the sweep measured in one bucket (`jaxfp8.gemm.mosaic.m_bucket`: as many 64-row tiles), with all its
fields and the times (the config's, the heuristic's, cuBLAS's) at the bucket's largest M measured. SMS: the
device's SM count (default 132), which the table serves only.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import defaultdict

from jaxfp8.gemm import mosaic
from jaxfp8.tools import bench_gemm

MARGIN = 0.98


def table(sweep: dict, device: str, num_sms: int = 132) -> dict:
  times: dict = defaultdict(dict)
  for row in sweep["rows"]:
    if row.get("us"):
      times[row["m"], row["n"], row["k"]][row["implementation"]] = row["us"]
  buckets: dict = defaultdict(list)  # (N, K, bucket) -> [(M, times)]
  for (m, n, k), by_name in times.items():
    if "mosaic" in by_name:
      buckets[n, k, mosaic.m_bucket(m)].append((m, by_name))
  entries = {}
  for (n, k, _), points in sorted(buckets.items()):
    # a config that wins at every M of the bucket, by its worst ratio to the heuristic's
    names = set.intersection(*({name for name in t if name.startswith("mosaic[")} for _, t in points))
    ratio = {name: max(t[name] / t["mosaic"] for _, t in points) for name in names}
    if not ratio or min(ratio.values()) >= MARGIN:
      continue
    best = min(ratio, key=ratio.get)
    m, by_name = max(points, key=lambda point: point[0])
    config = bench_gemm.config_contender("mosaic:" + best[len("mosaic["):-1])[1]
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    entries[f"{n},{k},{m}"] = dict(
        config={name: getattr(value, "name", value) for name, value in fields.items()}, us=round(by_name[best], 2),
        heuristic_us=round(by_name["mosaic"], 2), cublas_us=round(by_name.get("torch_scaled_mm", 0.0), 2))
  return dict(device=device, num_sms=num_sms,
              source=f"{sweep['command']} ({sweep['device']}, jax {sweep['jax_version']})",
              note=f"per (N, K, M): the schedule measured fastest where it beat the heuristic's by more than "
                   f"{round((1 - MARGIN) * 100)}% at every M measured with as many 64-row tiles, taken for those M",
              entries=entries)


if __name__ == "__main__":
  sweep_path, device, out_path = sys.argv[1:4]
  with open(sweep_path) as f:
    result = table(json.load(f), device, int(sys.argv[4]) if len(sys.argv) > 4 else 132)
  with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(f"{len(result['entries'])} entries -> {out_path}")
