"""GPU: which kernels one quantizer call launches, and their CUPTI times (checks that a timed call is one kernel).

  python scripts/quant_kernel_names.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxfp8 import quant
from jaxfp8.tools import timing


def main() -> None:
  for implementation in ("triton", "xla", "mosaic"):
    for m, k in ((1, 7168), (64, 7168), (4096, 7168)):
      x = jnp.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
      fn = jax.jit(lambda v: quant.per_token_group_quant_fp8_row_padded(v, 128, implementation=implementation))
      try:
        times = timing.cupti_times_us(lambda i: fn(x), iterations=5)
        print(implementation, m, k, timing.kernel_names(fn, (x,)), f"{np.median(times):.2f} us", flush=True)
      except Exception as e:
        print(implementation, m, k, "ERROR", type(e).__name__, str(e)[:200], flush=True)


if __name__ == "__main__":
  main()
