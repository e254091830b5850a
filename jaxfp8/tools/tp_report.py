"""What `python -m jaxfp8 tp` reports: the kernel classifier (collective or compute), speedups, the tables, and
re-deriving a saved result with the current classifier (`--rerender`).

--rerender re-derives a saved JSON with the current kernel classifier (the collective / compute split and the
speedups, from the per-kernel records it holds; every measurement and check stays) and records that in the JSON.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import math
import re

from jaxfp8.tools import results as results_io

# Kernel names of collectives: NCCL's (ncclDevKernel_AllReduce_Sum_f32_RING_LL...), and XLA's own all-reduce kernels
# and collective fusions, named after the HLO op (all-reduce-start, stream_executor's AllReduceKernelImpl) or after the
# JAX primitive behind it (psum_7_0_fusion_1: XLA's small all-reduce of a psum). A name token counts only where no
# lowercase letter touches it on either side (camel case and digits may), so "small_reduce", a local gather
# ("loop_gather_fusion"), a scatter ("input_scatter_fusion") or "cumsum" stay compute.
_COLLECTIVE_TOKENS = (r"all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|collective[-_]?permute|"
                      r"collective[-_]?broadcast|cross[-_]?replica[-_]?sum|psum|pmax|pmin|ppermute|pbroadcast")
COLLECTIVE_KERNEL = re.compile(rf"(?i:nccl|nvshmem)|(?<![a-z])(?i:{_COLLECTIVE_TOKENS})(?![a-z])")
TIMING_NOTES = {
    "wall_us": "median wall-clock time of one jitted call + jax.block_until_ready, after a warm-up call, inputs "
               "rotated: includes Python dispatch, launches on every device, collectives and the wait for the "
               "slowest device",
    "kernel_us_per_device": "CUPTI kernel time per call: the sum over all kernels of all devices and all calls, / "
                            "calls / devices (1 for single): the mean per device; CUPTI does not say which GPU ran "
                            "a kernel",
    "collective_us_per_device": "the part of kernel_us_per_device spent in kernels whose name looks like a collective "
                                f"(/{COLLECTIVE_KERNEL.pattern}/); includes each device's wait for the others",
    "compute_us_per_device": "kernel_us_per_device - collective_us_per_device: quantizer, GEMM, casts, copies",
    "kernels": "per kernel name: launches per call and us per call, summed over all devices; collective: whether it "
               "counts in collective_us_per_device",
    "speedup_wall, speedup_kernel, speedup_compute": "single-device time / sharded time (the ideal is the device "
                                                     "count): wall clock, all kernels, kernels without collectives",
}


def is_collective_kernel(name: str) -> bool:
  """Whether a CUPTI kernel name is a collective's (see COLLECTIVE_KERNEL)."""
  return COLLECTIVE_KERNEL.search(name) is not None


def add_speedups(row: dict, single: dict) -> None:
  if "wall_us" in row and "wall_us" in single:
    row["speedup_wall"] = single["wall_us"] / row["wall_us"]
  if "kernel_us_per_device" in row and "kernel_us_per_device" in single:
    row["speedup_kernel"] = single["kernel_us_per_device"] / row["kernel_us_per_device"]
    if row["compute_us_per_device"] > 0:
      row["speedup_compute"] = single["compute_us_per_device"] / row["compute_us_per_device"]


# ---- re-deriving a saved result ----------------------------------------------------------------------------------

RECOMPUTED = ("kernels[].collective", "collective_us_per_device", "compute_us_per_device", "speedup_wall",
              "speedup_kernel", "speedup_compute", "timing_notes")


def rederive(result: dict) -> tuple[dict, dict[str, bool]]:
  """A copy of `result` (a saved JSON of `run`) with every per-kernel record reclassified by `is_collective_kernel`,
  and the fields of RECOMPUTED derived again from the records; what was measured (wall_us, kernel_us_per_device, the
  records' launches and times) and the checks are left as they are. Also returns the kernel names whose class
  changed, with their new class."""
  out = copy.deepcopy(result)
  reclassified: dict[str, bool] = {}
  for row in out["rows"]:
    if "kernels" not in row:
      continue
    devices = row["devices"]
    total = sum(k["us_per_call_all_devices"] for k in row["kernels"]) / devices
    if not math.isclose(total, row["kernel_us_per_device"], rel_tol=1e-9, abs_tol=1e-9):
      raise ValueError(f"{row['shape']} M={row['m']} {row['mode']}: its kernel records sum to {total} us per device, "
                       f"not its kernel_us_per_device={row['kernel_us_per_device']}: the records are incomplete")
    for kernel in row["kernels"]:
      collective = is_collective_kernel(kernel["name"])
      if kernel.get("collective") != collective:
        reclassified[kernel["name"]] = collective
      kernel["collective"] = collective
    row["collective_us_per_device"] = sum(
        k["us_per_call_all_devices"] for k in row["kernels"] if k["collective"]) / devices
    row["compute_us_per_device"] = row["kernel_us_per_device"] - row["collective_us_per_device"]
  singles = {(r["shape"], r["m"]): r for r in out["rows"] if r["mode"] == "single" and r["timed"]}
  for row in out["rows"]:
    if row["mode"] != "single" and row["timed"]:
      for key in ("speedup_wall", "speedup_kernel", "speedup_compute"):
        row.pop(key, None)
      add_speedups(row, singles.get((row["shape"], row["m"]), {}))
  out["timing_notes"] = dict(TIMING_NOTES)
  return out, reclassified


def rerender(in_json: str, out_json: str, *, command: str, log=print) -> dict:
  """Re-derives the results saved in `in_json` (`rederive`) and writes them to `out_json` and its markdown table; the
  JSON's "rederived" list gains a record of this: the source file and its sha256, when, the command, the classifier,
  what was reclassified and what was recomputed. The run's own command, date and measurements stay."""
  with open(in_json, "rb") as f:
    raw = f.read()
  result, reclassified = rederive(json.loads(raw))
  result.setdefault("rederived", []).append(dict(
      source=in_json, source_sha256=hashlib.sha256(raw).hexdigest(),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(), command=command,
      collective_kernel_pattern=COLLECTIVE_KERNEL.pattern,
      reclassified=[dict(name=name, collective=collective) for name, collective in sorted(reclassified.items())],
      recomputed=list(RECOMPUTED),
      measurements="unchanged: every wall-clock and kernel time, per-kernel record and check is the source's"))
  results_io.write_results(result, out_json, markdown_table)
  log(markdown_table(result))
  log(f"re-derived {in_json} ({len(reclassified)} kernel names reclassified: "
      f"{', '.join(f'{n} -> {"collective" if c else "compute"}' for n, c in sorted(reclassified.items())) or '-'}); "
      f"wrote {out_json} and {out_json.removesuffix('.json')}.md")
  return result


# ---- tables ------------------------------------------------------------------------------------------------------

def _us(value: float | None) -> str:
  return "-" if value is None else f"{value:.1f}"


def _checks_cell(row: dict) -> str:
  if "error" in row:
    return "**ERROR**"
  failed = [c["name"] for c in row["checks"] if not c["passed"]]
  if failed:
    return "**FAIL** " + ", ".join(failed)
  if row["mode"] == "single":
    return "ok"
  if row["mode"] == "row":
    return f"ok ({row['rel_err_vs_single']:.1e} vs 1 dev)"
  return "ok (bit-identical)"


def format_row(row: dict) -> str:
  head = f"{row['shape']:<34} M={row['m']:<5} {row['mode'] + (' +bias' if row['bias'] else ''):<19}"
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  err = next((c["value"] for c in row["checks"] if c["name"] == "rel_err_vs_reference"), float("nan"))
  timed = ""
  if "wall_us" in row:
    timed = f" wall {row['wall_us']:9.1f} us"
    if "kernel_us_per_device" in row:
      timed += (f"  kernel/dev {row['kernel_us_per_device']:8.1f} us (collective "
                f"{row['collective_us_per_device']:.1f})")
    if "speedup_wall" in row:
      timed += f"  speedup wall x{row['speedup_wall']:.2f}"
    if "speedup_kernel" in row:
      timed += f" kernel x{row['speedup_kernel']:.2f}"
    if "speedup_compute" in row:
      timed += f" compute x{row['speedup_compute']:.2f}"
  return f"{head} {_checks_cell(row):<28} ref err {err:8.1e}{timed}"


def _wall_note(result: dict) -> str:
  """What the wall-clock columns measure; with kernel times, how much of them is the GPUs' work (the fastest call)."""
  p = result["device_count"]
  note = ("Wall-clock columns are host-side: the median of one jitted call + block_until_ready, Python dispatch and "
          f"the launch of the {p}-device program included.")
  timed = [r for r in result["rows"] if r["timed"] and "kernel_us_per_device" in r]
  fastest = [min(rows, key=lambda r: r["wall_us"]) for rows in ([r for r in timed if r["mode"] == "single"],
                                                                [r for r in timed if r["mode"] != "single"]) if rows]
  if fastest:
    note += (" At these sizes that overhead dominates (fastest call: " + "; ".join(
        f"{r['devices']} dev {r['wall_us']:.1f} us wall for {r['kernel_us_per_device']:.1f} us of kernels"
        f"{' per device' if r['devices'] > 1 else ''}" for r in fastest) +
        "), so the kernel columns (CUPTI) are the ones that compare the GPUs' work.")
  return note


def markdown_table(result: dict) -> str:
  p = result["device_count"]
  lines = [f"Tensor-parallel block-FP8 linears on {p} x {result['device']} vs one, jax {result['jax_version']}, "
           f"{result['date'][:10]}{'' if result['complete'] else ' (INCOMPLETE run: time budget)'}; "
           f"{result['timing']}. Checks: {'all passed' if result['checks_passed'] else '**FAILURES**'}.", "",
           _wall_note(result), "",
           f"Speedup = 1 device / {p} devices (ideal {p}). Kernel time per device = CUPTI sum over all devices / "
           f"{p}; 'coll.' = its collective kernels (NCCL's and XLA's own all-reduce / all-gather; they include "
           "waiting for the other devices); compute speedup = the same without them.", "",
           f"Command: `{result['command']}`", ""]
  for entry in result.get("rederived", [])[-1:]:
    changed = ", ".join(f"`{k['name']}` -> {'collective' if k['collective'] else 'compute'}"
                        for k in entry["reclassified"]) or "none"
    lines += [f"Re-derived {entry['date'][:10]} from `{entry['source']}` (`{entry['command']}`): kernels reclassified "
              f"by the current collective classifier (changed: {changed}), times per device and speedups "
              "recomputed; the measurements are the original run's.", ""]
  if result.get("cpu_warning"):
    lines += [f"**{result['cpu_warning']}**", ""]
  lines += ["| shape | M | N | K | mode | path per device | wall us, 1 dev | wall us, "
            f"{p} dev | wall speedup | kernel us, 1 dev | kernel us per dev (coll.) | kernel speedup | "
            "compute speedup | checks |",
            "|" + "---|" * 14]
  singles = {(r["shape"], r["m"]): r for r in result["rows"] if r["mode"] == "single" and not r["bias"]}
  for r in result["rows"]:
    if r["mode"] == "single" and not r["bias"]:
      continue  # its times are in the sharded rows' 1-device columns
    single = singles.get((r["shape"], r["m"]), {}) if r["timed"] else {}
    mode = r["mode"] + (" +bias (check only)" if r["bias"] else "")
    path = f"{r.get('quant_implementation', '?')}+{r.get('implementation', '?')}"
    kernel = "-"
    if "kernel_us_per_device" in r:
      kernel = f"{r['kernel_us_per_device']:.1f} ({r['collective_us_per_device']:.1f})"
    lines.append(
        f"| {r['shape']} | {r['m']} | {r['n']} | {r['k']} | {mode} | {path} | {_us(single.get('wall_us'))} | "
        f"{_us(r.get('wall_us'))} | {f'{r['speedup_wall']:.2f}x' if 'speedup_wall' in r else '-'} | "
        f"{_us(single.get('kernel_us_per_device'))} | {kernel} | "
        f"{f'{r['speedup_kernel']:.2f}x' if 'speedup_kernel' in r else '-'} | "
        f"{f'{r['speedup_compute']:.2f}x' if 'speedup_compute' in r else '-'} | {_checks_cell(r)} |")
  if result["skipped"]:
    lines += ["", "Skipped: " + "; ".join(f"{s['shape']} {s['parallel'] or ''} ({s['reason']})"
                                          for s in result["skipped"])]
  return "\n".join(lines) + "\n"
