"""A/B on the GPU of one planner choice inside the MoE layer, off / on / off in one process (the two off runs bracket
the on run: their spread is the noise), CUPTI kernel time of the whole layer (`jaxfp8.tools.bench_moe.run`, each
output checked against the float64 reference first). Knobs:

  live_grid      the ragged decode GEMMs on a persistent grid over the work-item table's live items
                 (`jaxfp8.grouped.mosaic.DECODE_LIVE_GRID["ragged"]`) against a CTA per item (the default), both GPU
                 layers at 1, 8, 64 tokens. At one DeepSeek-V3 EP8 token no row is local, yet each GEMM launches a
                 wave of CTAs that only exit.
  fused_permute  the permute inside the tokens' quantizer at any extra read (`jaxfp8.moe.planner.
                 FUSED_PERMUTE_EXTRA_BYTES_MAX` unbounded) against the planner's edge (16 MiB), Qwen3-30B-A3B (every
                 id local) at 1024, 2048, 4096 tokens: the points the edge splits.
  mosaic_dispatch  the decode dispatch as one Mosaic kernel (`jaxfp8.moe.sort.MOSAIC_BY_DEFAULT`) against XLA's
                 three reductions, both GPU layers at 1, 2, 8 tokens.

`python3 scripts/ab_moe_plan.py KNOB [OUT.json] [T,T,...]`"""
import json
import sys

from jaxfp8.grouped import mosaic
from jaxfp8.moe import planner, sort
from jaxfp8.tools import bench_moe


def _live_grid(on: bool) -> None:
  mosaic.DECODE_LIVE_GRID["ragged"] = on


def _fused_permute(on: bool, shipped=planner.FUSED_PERMUTE_EXTRA_BYTES_MAX) -> None:
  planner.FUSED_PERMUTE_EXTRA_BYTES_MAX = 1 << 62 if on else shipped


def _mosaic_dispatch(on: bool) -> None:
  sort.MOSAIC_BY_DEFAULT = on


# knob: (set(on), the shipped value's restore, layers, default tokens)
KNOBS = {
    "live_grid": (_live_grid, lambda shipped=mosaic.DECODE_LIVE_GRID["ragged"]: _live_grid(shipped),
                  bench_moe.GPU_LAYERS, (1, 8, 64)),
    "fused_permute": (_fused_permute, lambda: _fused_permute(False), ("qwen3_30b_a3b",), (1024, 2048, 4096)),
    "mosaic_dispatch": (_mosaic_dispatch, lambda shipped=sort.MOSAIC_BY_DEFAULT: _mosaic_dispatch(shipped),
                        bench_moe.GPU_LAYERS, (1, 2, 8)),
}


def main(knob: str, out: str | None = None, tokens=None) -> None:
  set_on, restore, layers, default_tokens = KNOBS[knob]
  tokens = tokens or default_tokens
  rows = []
  try:
    for on in (False, True, False):
      set_on(on)
      for name in layers:
        for r in bench_moe.run(name, tokens, ["layer"], log=lambda *a: None):
          if r.get("contender") != "layer":
            continue
          row = dict(knob=knob, layer=name, tokens=r["tokens"], on=on, us=r.get("us"), error=r.get("error"),
                     rel_err=r.get("rel_err"), within_bound=r.get("within_bound"))
          rows.append(row)
          print(row, flush=True)
  finally:
    restore()
  print(f"layer, tokens: {knob} off (first run / last run) against on, us")
  for name in layers:
    for t in tokens:
      def us(flag, which):  # which: the first (0) or last (-1) run of that flag; nan where it failed
        found = [r["us"] for r in rows if (r["layer"], r["tokens"], r["on"]) == (name, t, flag)]
        return found[which] if found and found[which] is not None else float("nan")
      print(f"{name} {t}: {us(False, 0):.2f} / {us(False, -1):.2f} against {us(True, 0):.2f}")
  if out:
    with open(out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  if len(sys.argv) < 2 or sys.argv[1] not in KNOBS:
    sys.exit(f"usage: python3 scripts/ab_moe_plan.py {{{','.join(KNOBS)}}} [OUT.json] [T,T,...]")
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None,
       tuple(int(t) for t in sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
