"""A/B on the GPU of the MoE layer's ragged decode GEMMs on a persistent grid over the work-item table's live items
(`jaxfp8.grouped.mosaic.DECODE_LIVE_GRID["ragged"]`) against a CTA per item (today's default), off / on / off in one
process (the two off runs bracket the on run: their spread is the noise), CUPTI kernel time of the whole layer
(`jaxfp8.tools.bench_moe.run`, each output checked against the float64 reference first), both GPU layers at decode.
At one DeepSeek-V3 EP8 token no row is local, yet each GEMM launches a wave of CTAs that only exit.
`python3 scripts/ab_moe_live_grid.py [OUT.json] [T,T,...]`"""
import json
import sys

from jaxfp8.grouped import mosaic
from jaxfp8.tools import bench_moe

TOKENS = (1, 8, 64)


def main(out: str | None = None, tokens=TOKENS) -> None:
  rows = []
  shipped = mosaic.DECODE_LIVE_GRID["ragged"]
  try:
    for live_grid in (False, True, False):
      mosaic.DECODE_LIVE_GRID["ragged"] = live_grid
      for name in bench_moe.GPU_LAYERS:
        for r in bench_moe.run(name, tokens, ["layer"], log=lambda *a: None):
          if r.get("contender") != "layer":
            continue
          row = dict(layer=name, tokens=r["tokens"], live_grid=live_grid, us=r.get("us"), error=r.get("error"),
                     rel_err=r.get("rel_err"), within_bound=r.get("within_bound"))
          rows.append(row)
          print(row, flush=True)
  finally:
    mosaic.DECODE_LIVE_GRID["ragged"] = shipped
  print("layer, tokens: a CTA per item (first run / last run) against the live grid, us")
  for name in bench_moe.GPU_LAYERS:
    for t in tokens:
      def us(flag, which):  # which: the first (0) or last (-1) run of that flag; nan where it failed
        found = [r["us"] for r in rows if (r["layer"], r["tokens"], r["live_grid"]) == (name, t, flag)]
        return found[which] if found and found[which] is not None else float("nan")
      print(f"{name} {t}: {us(False, 0):.2f} / {us(False, -1):.2f} against {us(True, 0):.2f}")
  if out:
    with open(out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else None,
       tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else TOKENS)
