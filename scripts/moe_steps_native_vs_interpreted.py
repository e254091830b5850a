"""Each step of the MoE layer natively on the GPU against the same step interpreted on the CPU backend, each fed the
native run's own inputs: where a native miss of the layer against the float64 reference comes from. The case is
tests/test_moe.py's `test_every_id_local_changes_the_plan_not_the_result` (H=256, I=128, 6 experts, 20 tokens of
top-4) and the same at H=512, I=256, under that file's seeding:

  JAXFP8_TEST_SEED=3617471692 PYTHONPATH=$PWD python3 scripts/moe_steps_native_vs_interpreted.py

Prints, per step, how many elements differ (on the rows that hold a routed slot) and the first of them.
PROBE_NATIVE_INTERPRET=1 interprets the "native" side too (a dry run on a machine without a GPU).
"""
import importlib
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import moe
from jaxfp8 import reference as ref
from jaxfp8.moe import layer as L

NATIVE_INTERPRET = bool(int(os.environ.get("PROBE_NATIVE_INTERPRET", "0")))  # 1: a CPU dry run
CASE = "tests/test_moe.py::test_every_id_local_changes_the_plan_not_the_result"


def _tests():
  """The test file's case builders and the suite's seeding (imported when run: importing them starts JAX's
  backends)."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
  return importlib.import_module("test_moe"), importlib.import_module("conftest").seeded_rng


def on(dev, tree):
  return jax.tree.map(lambda a: jax.device_put(a, dev) if isinstance(a, jax.Array) else a, tree)


def np32(a):
  return np.asarray(jax.device_get(a)).astype(np.float32)


def rows_of(d, ids, e):
  """The buffer rows that hold a routed slot of an expert."""
  rank = np.asarray(jax.device_get(d.rank))
  flat = ids.reshape(-1)
  return np.sort(rank[(flat >= 0) & (flat < e)])


def compare(name, a, b, rows=None, axis=0):
  a, b = np32(a), np32(b)
  if rows is not None:
    a, b = np.take(a, rows, axis), np.take(b, rows, axis)
  diff = a != b
  both_nan = np.isnan(a) & np.isnan(b)
  diff &= ~both_nan
  print(f"  {name:22s} shape {a.shape} differ {int(diff.sum())} rel {ref.relative_error(a, b):.3g}", flush=True)
  if diff.any():
    where = np.argwhere(diff)
    print("    first:", where[:8].tolist(), "native", a[diff][:4], "cpu", b[diff][:4], flush=True)
    if a.ndim == 2:
      rows_hit = np.unique(where[:, 0])
      print("    rows with a difference (index into the compared rows):", rows_hit[:40].tolist(),
            "columns per row:", [int(diff[r].sum()) for r in rows_hit[:40]], flush=True)
      cols_hit = np.unique(where[:, 1])
      print("    columns:", cols_hit.min(), "..", cols_hit.max(), "count", cols_hit.size, flush=True)


def scales_rows(s, b_rows):
  """Axis of the row index in a scale array (column-major (G, B') or row-major (B, G))."""
  return 1 if s.ndim == 2 and s.shape[0] != b_rows and s.shape[1] >= b_rows else 0


def probe(h, i, seed_name, local):
  T, seeded_rng = _tests()
  cpu = jax.devices("cpu")[0]
  rng = seeded_rng(seed_name)
  experts = tuple(map(jnp.asarray, T._experts(rng, e=6, h=h, i=i)))
  x = jnp.asarray(rng.standard_normal((20, h)), jnp.bfloat16)
  ids, weights = T._routing(rng, 20, 6, 4, empty=[2])
  want = T._expected(x, ids, weights, experts)
  kw = dict(implementation="mosaic", every_id_local=local)
  pn = moe.explain(x, experts[0], experts[2], 4, interpret=NATIVE_INTERPRET, **kw)
  pi = moe.explain(x, experts[0], experts[2], 4, interpret=True, **kw)
  print(f"== h={h} i={i} {seed_name[-14:]} local={local} same plan text: "
        f"{str(pn).replace('interpret', '') == str(pi).replace('interpret', '')}", flush=True)
  if local and h == 256:
    print(str(pn), flush=True)
  whole = np32(moe.fp8_moe(x, jnp.asarray(ids), jnp.asarray(weights), *experts, interpret=NATIVE_INTERPRET, **kw))
  print(f"  whole layer native rel err {ref.relative_error(whole, want):.4f}", flush=True)
  ids_j, w_j = jnp.asarray(ids), jnp.asarray(weights)
  d = L.dispatch(ids_j, 6, pn)
  dc = L.dispatch(on(cpu, ids_j), 6, pi)
  for f in ("order", "rank", "group_sizes", "live"):
    compare("dispatch." + f, getattr(d, f), getattr(dc, f))
  live_rows = rows_of(d, ids, 6)
  print("  live", int(d.live), "rows", live_rows.size, "group sizes", np.asarray(d.group_sizes).tolist(),
        "live rows", live_rows.tolist())
  dcn = on(cpu, d)  # the native dispatch, on the CPU, for the CPU steps
  if pn.permute_in_quantize:
    a = L.quantize_permute(x, d, pn)
    ac = L.quantize_permute(on(cpu, x), dcn, pi)
  else:
    xq, xs = L.quantize(x, pn)
    xqc, xsc = L.quantize(on(cpu, x), pi)
    compare("quantize.codes", xq, xqc)
    compare("quantize.scales", xs, xsc)
    a = L.permute(xq, xs, 4, d, pn)
    ac = L.permute(on(cpu, xq), on(cpu, xs), 4, dcn, pi)
  compare("a.codes", a[0], ac[0], live_rows)
  compare("a.scales", a[1], ac[1], live_rows, scales_rows(a[1], a[0].shape[0]))
  a_cpu = on(cpu, a)
  if pn.fused_silu_quant:
    hq, hs = L.gate_up_silu_quant(*a, d, *experts[:2], pn)
    hqc, hsc = L.gate_up_silu_quant(*a_cpu, dcn, *on(cpu, experts[:2]), pi)
  else:
    hh = L.gate_up(*a, d, *experts[:2], pn)
    hhc = L.gate_up(*a_cpu, dcn, *on(cpu, experts[:2]), pi)
    compare("gate_up.h", hh, hhc, live_rows)
    hq, hs = L.silu_quant(hh, d, pn)
    hqc, hsc = L.silu_quant(on(cpu, hh), dcn, pi)
  compare("h.codes", hq, hqc, live_rows)
  compare("h.scales", hs, hsc, live_rows, scales_rows(hs, hq.shape[0]))
  y = L.down(hq, hs, d, *experts[2:], pn)
  yc = L.down(*on(cpu, (hq, hs)), dcn, *on(cpu, experts[2:]), pi)
  compare("down.y", y, yc, live_rows)
  valid = (ids_j >= 0) & (ids_j < 6)
  out = L.combine(y, d, w_j, valid, x.dtype, pn)
  outc = L.combine(on(cpu, y), dcn, on(cpu, w_j), on(cpu, valid), x.dtype, pi)
  compare("combine.out", out, outc)
  print(f"  steps native rel err {ref.relative_error(np32(out), want):.4f}, whole vs steps differ "
        f"{int((np32(out) != whole).sum())}", flush=True)


def main():
  for h, i in ((256, 128), (512, 256)):
    for local in (True, False):
      try:
        probe(h, i, CASE, local)
      except Exception as e:  # noqa: BLE001 - keep going: the next case may say more
        print("  FAILED", type(e).__name__, str(e)[:400], flush=True)


if __name__ == "__main__":
  main()
