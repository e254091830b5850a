"""A/B on the GPU of the ragged grouped GEMM's work-item table built by one Mosaic kernel
(`jaxfp8.grouped.mosaic.TABLE_KERNEL_BY_DEFAULT`, pallas_kernels/ragged_items_mosaic.py) against XLA's prologue
kernels, off / on / off in one process (the two off runs bracket the on run: their spread is the noise): the bench's
ragged Mosaic contender (`jaxfp8.tools.bench_grouped.run`, each output checked against the float64 reference first),
CUPTI kernel time of the whole call, issue 36's expert shapes at R = 8 and 64 routed rows.
`python3 scripts/ab_grouped_table.py [OUT.json] [R,R,...]`"""
import json
import sys

from jaxfp8.grouped import mosaic
from jaxfp8.tools import bench_grouped

ROWS = (8, 64)


def main(out: str | None = None, rows=ROWS) -> None:
  shipped = mosaic.TABLE_KERNEL_BY_DEFAULT
  results = []
  try:
    for on in (False, True, False):
      mosaic.TABLE_KERNEL_BY_DEFAULT = on
      for r in bench_grouped.run(bench_grouped.DEFAULT_SHAPES, {name: rows for name, *_ in bench_grouped.DEFAULT_SHAPES},
                                 ["mosaic"], log=lambda *a: None):
        row = dict(shape=r["shape"], rows=r["m"], on=on, us=r.get("us"), error=r.get("error"),
                   rel_err=r.get("rel_err"), floor_us=r.get("floor_us"))
        results.append(row)
        print(row, flush=True)
  finally:
    mosaic.TABLE_KERNEL_BY_DEFAULT = shipped
  print("shape, R: XLA's prologue (first run / last run) against the table kernel, us (the floor)")
  for name, *_ in bench_grouped.DEFAULT_SHAPES:
    for r in rows:
      def us(flag, which):  # which: the first (0) or last (-1) run of that flag; nan where it failed
        found = [x["us"] for x in results if x["shape"].startswith(name + "/") and (x["rows"], x["on"]) == (r, flag)]
        return found[which] if found and found[which] is not None else float("nan")
      floor = next((x["floor_us"] for x in results if x["shape"].startswith(name + "/") and x["rows"] == r), None)
      print(f"{name} R={r}: {us(False, 0):.2f} / {us(False, -1):.2f} against {us(True, 0):.2f} ({floor or 0:.2f})")
  if out:
    with open(out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else None,
       tuple(int(r) for r in sys.argv[2].split(",")) if len(sys.argv) > 2 else ROWS)
