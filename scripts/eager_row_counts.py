"""Eager `w8a8_block_fp8_linear` over new row counts: compilations and the time of the first call of each new M in
warm row buckets, then repeated eager calls beside the jitted call. Wall clock (it measures host work: compiles,
dispatch, the pad and the slice around the cached executable).

  PYTHONPATH=. python3 scripts/eager_row_counts.py [MAX_M]        (default 300; N=512, K=256)
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import linear
from jaxfp8 import reference as ref

N, K = 512, 256


def _ms(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main(max_m: int) -> None:
  compiles = []

  def listener(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(str(kwargs.get("fun_name")))

  rng = np.random.default_rng(0)
  w_q, w_s = (jnp.asarray(a) for a in ref.quantize_weight_blockwise(
      rng.standard_normal((N, K)).astype(np.float32), (128, 128)))
  xs = [jax.device_put(rng.standard_normal((m, K)).astype(np.float32)) for m in range(1, max_m + 1)]
  call = lambda x: linear.w8a8_block_fp8_linear(x, w_q, w_s, (128, 128))
  for bucket in sorted(set(linear.get_row_buckets().buckets_for(range(1, max_m + 1)))):  # warm every bucket
    jax.block_until_ready(call(jax.device_put(np.zeros((bucket, K), np.float32))))
  jax.monitoring.register_event_duration_secs_listener(listener)
  first = [_ms(lambda x=x: call(x), 1) for x in xs]
  jax.monitoring.unregister_event_duration_listener(listener)
  print(f"{jax.default_backend()}, jax {jax.__version__}: M=1..{max_m} into warm buckets: {len(compiles)} "
        f"compilations; first call of a new M: median {np.median(first):.2f} ms, max {max(first):.1f} ms")
  for m in sorted({5, 8, 100, max_m} & set(range(1, max_m + 1))):
    jitted = jax.jit(call)
    jax.block_until_ready(jitted(xs[m - 1]))
    print(f"  M={m}: cached eager {_ms(lambda: call(xs[m - 1]), 300) * 1e3:.0f} us, "
          f"jitted {_ms(lambda: jitted(xs[m - 1]), 300) * 1e3:.0f} us")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
