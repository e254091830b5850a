"""A/B on the GPU of the MoE routers' three implementations (jaxfp8/moe/routing.py): the Mosaic router kernel, XLA's
compare-and-count top-k and XLA's merged form, on the same logits, one process, CUPTI kernel time, at T = 1 .. 4096
tokens, both families (DeepSeek-V3: 256 float32 logits with a correction bias; Qwen3-30B-A3B: 128 bfloat16 logits):
the data behind `routing.XLA_DEFAULT` and `MOSAIC_MIN_TOKENS`. Each case first checks that the others choose the
Mosaic kernel's ids (and the largest weight difference).
`python3 scripts/ab_router_kernel.py OUT.json [T,T,...]`"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8.moe import routing
from jaxfp8.tools import timing

TOKENS = (1, 3, 8, 16, 32, 64, 100, 512, 4096)


def main(out: str, tokens=TOKENS) -> None:
  rows = []
  for name, router, e, dtype in (("deepseek_v3", routing.DeepSeekV3Router(), 256, jnp.float32),
                                 ("qwen3", routing.Qwen3MoeRouter(), 128, jnp.bfloat16)):
    bias = jax.random.normal(jax.random.key(99), (e,), jnp.float32) * 0.1 if router.uses_correction_bias else None
    for t in tokens:
      sets = [((jax.random.normal(jax.random.key(i + t), (t, e), jnp.float32) * 2).astype(dtype), bias)
              for i in range(4)]
      fns = {impl: jax.jit(lambda l, b, impl=impl: router(l, b, implementation=impl))
             for impl in ("mosaic", "xla", "xla_merge")}
      outs = [[np.asarray(a) for a in fn(*sets[0])] for fn in fns.values()]
      row = dict(router=name, tokens=t, same_ids=all(np.array_equal(outs[0][0], o[0]) for o in outs[1:]),
                 weights_max_diff=max(float(np.abs(outs[0][1] - o[1]).max()) for o in outs[1:]),
                 planned=router.explain(sets[0][0]).implementation)
      for impl, fn in fns.items():
        us, kernels = timing.median_kernel_us_and_kernels(fn, sets)
        row[f"{impl}_us"], row[f"{impl}_kernels"] = round(us, 2), len(kernels)
      print(row, flush=True)
      rows.append(row)
  with open(out, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1], tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else TOKENS)
