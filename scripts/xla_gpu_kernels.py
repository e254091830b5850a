"""The kernels XLA's GPU compiler launches for the MoE layer's steps, compiled for an H100 or H200 on a machine
without a GPU: JAX's compile-only topology of the CUDA plugin, given the device description XLA embeds in that
plugin (its GpuTargetConfig text). At decode a step's time is mostly its kernel count (about a microsecond each), so
this answers on CPU what a GPU round would: which kernels a step launches and which arrays XLA materializes between
them. Autotuned choices (cuBLAS or Triton tiles for a dot) may differ from a compile on the GPU; the fusion of
elementwise and reduction code, all the routers and the dispatch hold, does not depend on them.

  make .venv-gpu-offline/.installed
  .venv-gpu-offline/bin/python scripts/xla_gpu_kernels.py CASE [CASE ...] [--device=h100|h200] [--hlo]

CASE is STEP:LAYER:T: STEP route (the gate's logits and the router's XLA choice), dispatch (what the layer reads of
it: the order, the rows, the live count, the work-item tables) or layer (the layer after the router, the Mosaic
kernels as custom calls); LAYER one of jaxfp8.tools.bench_moe.LAYERS; T the tokens. Prints each case's launches.
"""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never open a CUDA client: the topology is compile-only
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from jaxfp8 import _platform, moe  # noqa: E402
from jaxfp8.moe import layer as moe_layer  # noqa: E402
from jaxfp8.tools import bench_moe  # noqa: E402

DEVICES = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e"}
F8 = jnp.float8_e4m3fn
LAUNCH = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? (fusion|custom-call|copy|sort|scatter|gather|reduce|dot)\(")


def target_config(device: str) -> str:
  """XLA's GpuTargetConfig text for `device`, as the CUDA plugin embeds it (jax-cuda13-pjrt >= 0.12)."""
  import jax_plugins.xla_cuda13 as plugin
  binary = open(os.path.join(os.path.dirname(plugin.__file__), "xla_cuda_plugin.so"), "rb").read()
  at = binary.find(b'device_description_str: "%s"\n' % DEVICES[device].encode())
  if at < 0:
    raise SystemExit(f"this CUDA plugin embeds no description of {DEVICES[device]}: install jax-cuda13-pjrt >= 0.12")
  start = binary.rfind(b"\0", 0, binary.rfind(b"gpu_device_info {", 0, at)) + 1
  return binary[start:binary.find(b"\0", at)].decode()


def compiled(fn, structs, device: str):
  """fn compiled by XLA's GPU compiler for `device`, on structs placed on its compile-only topology."""
  topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(device), topology="1x1x1")
  single = getattr(jax.sharding, "make_single_device_sharding", jax.sharding.SingleDeviceSharding)
  sharding = single(topology.devices[0])
  placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in structs]
  return jax.jit(fn).trace(*placed).lower(lowering_platforms=("cuda",)).compile()


def launches(hlo: str) -> list[tuple[str, str]]:
  """(name, op and kind) of each launching instruction of the optimized module's entry computation."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  out = []
  for line in entry.splitlines():
    if m := LAUNCH.match(line):
      kind = re.search(r'kind=(\w+)|custom_call_target="([^"]+)"', line)
      out.append((m.group(1), f"{m.group(2)} {next(g for g in kind.groups() if g) if kind else ''}".strip()))
  return out


def case(step: str, layer_name: str, tokens: int):
  """(fn, structs) of one case."""
  layer = bench_moe.LAYERS[layer_name]
  router = bench_moe._router(layer)
  s = jax.ShapeDtypeStruct
  e, h, i = layer.experts, layer.hidden, layer.intermediate
  if step == "route":
    bias = (s((layer.total_experts,), jnp.float32),) if router.uses_correction_bias else ()
    return (lambda x, w, *b: router.choose(router.logits(x, w), *b),
            (s((tokens, h), jnp.bfloat16), s((layer.total_experts, h), jnp.bfloat16), *bias))
  with _platform.abstract_h200():
    plan = moe.explain(s((tokens, h), jnp.bfloat16), s((e, 2 * i, h), F8), s((e, h, i), F8), layer.top_k)
  ids = s((tokens, layer.top_k), jnp.int32)
  if step == "dispatch":
    def reads(ids):
      d = moe_layer.dispatch(ids, e, plan)
      return d.order, d.rank, moe_layer._masked_m(d), d.tables  # the live count as the layer's quantizers read it
    return reads, (ids,)
  weights = (s((e, 2 * i, h), F8), s((e, 2 * i // 128, h // 128), jnp.float32), s((e, h, i), F8),
             s((e, h // 128, i // 128), jnp.float32))
  return (lambda x, ids, w, *ws: moe_layer.forward(x, ids, w, *ws, plan),
          (s((tokens, h), jnp.bfloat16), ids, s((tokens, layer.top_k), jnp.float32), *weights))


def main(argv: list[str]) -> None:
  device = next((a.split("=", 1)[1] for a in argv if a.startswith("--device=")), "h100")
  for name in (a for a in argv if not a.startswith("--")):
    step, layer_name, tokens = name.split(":")
    fn, structs = case(step, layer_name, int(tokens))
    with _platform.abstract_h200():
      hlo = compiled(fn, structs, device).as_text()
    if "--hlo" in argv:
      print(hlo)
    found = launches(hlo)
    print(f"{name} on {DEVICES[device]} (jax {jax.__version__}): {len(found)} launches")
    for launch_name, what in found:
      print(f"  {launch_name:32} {what}")


if __name__ == "__main__":
  main(sys.argv[1:])
