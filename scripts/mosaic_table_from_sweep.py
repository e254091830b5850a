"""A Mosaic GEMM measured table (jaxfp8/gemm/configs/mosaic_gemm_<device>.json) from a schedule sweep's bench JSON.

  python scripts/mosaic_table_from_sweep.py SWEEP.json "NVIDIA H100" jaxfp8/gemm/configs/mosaic_gemm_h100.json

The sweep is `python -m jaxfp8 bench --ops=gemm --shapes="M,N,K;..." --implementations=mosaic,torch_scaled_mm
--gemm_configs="mosaic:...;..."` on the device: every (M, N, K) whose fastest config ran more than 2% faster than
the planner's own ("mosaic") becomes an entry keyed "N,K,M" with that config's fields and the three times (the
config, the heuristic, cuBLAS). `jaxfp8.gemm.mosaic.MEASURED_TABLES` maps the device name to the file.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from jaxfp8.tools import bench_gemm

FIELDS = ("tile_m", "tile_n", "max_concurrent_steps", "k_blocks_per_step", "num_compute_wgs", "wg_split",
          "grid_minor_dim", "grid_tile_width", "epi_tile_n", "persistent", "cluster_dim", "weight_scales_ahead",
          "sub_tile_n")
MARGIN = 0.98


def table(sweep: dict, device: str) -> dict:
  times: dict = defaultdict(dict)
  for row in sweep["rows"]:
    if row.get("us"):
      times[row["m"], row["n"], row["k"]][row["implementation"]] = row["us"]
  entries = {}
  for (m, n, k), by_name in sorted(times.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
    configs = {name: us for name, us in by_name.items() if name.startswith("mosaic[")}
    if "mosaic" not in by_name or not configs:
      continue
    best = min(configs, key=configs.get)
    if configs[best] >= MARGIN * by_name["mosaic"]:
      continue
    config = bench_gemm.config_contender("mosaic:" + best[len("mosaic["):-1])[1]
    fields = {f: getattr(config, f) for f in FIELDS}
    entries[f"{n},{k},{m}"] = dict(
        config={f: getattr(v, "name", v) for f, v in fields.items()}, us=round(configs[best], 2),
        heuristic_us=round(by_name["mosaic"], 2), cublas_us=round(by_name.get("torch_scaled_mm", 0.0), 2))
  return dict(device=device, source=f"{sweep['command']} ({sweep['device']}, jax {sweep['jax_version']})",
              note=f"per (N, K, M): the schedule measured fastest where it beat the heuristic's by more than "
                   f"{round((1 - MARGIN) * 100)}%, taken for every M with as many 64-row tiles",
              entries=entries)


if __name__ == "__main__":
  sweep_path, device, out_path = sys.argv[1:4]
  with open(sweep_path) as f:
    result = table(json.load(f), device)
  with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(f"{len(result['entries'])} entries -> {out_path}")
