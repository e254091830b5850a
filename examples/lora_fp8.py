"""Train a LoRA adapter beside a frozen block-FP8 linear (Flax NNX + optax).

A two-layer MLP of `Fp8Linear`s (their codes and scales are frozen `Fp8Weight`s: no gradient, no optimizer state),
each with an adapter adding `x @ A @ B * (alpha / rank)` in bfloat16; only the adapters are trained. The first
layer's adapter gets its gradient through the second FP8 layer's backward (docs/CONTRACT.md §6: dy quantized per
1 x 128 group, the block-FP8 GEMM against W^T, whose codes the layers hold with transposed_weight=True). The task:
match a teacher MLP whose weights differ from the base's by low-rank updates, which rank-`rank` adapters can close.

    python examples/lora_fp8.py --steps 200

prints the loss every few steps; it runs on CPU (the XLA path) in about a minute, on a GPU through the kernels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxfp8 import quantize_weight_blockwise
from jaxfp8.nn import Fp8Linear


class LoRAParam(nnx.Param):
  """The adapter's parameters: the only ones the optimizer sees."""


class LoRAFp8Linear(nnx.Module):
  def __init__(self, base: Fp8Linear, rank: int, alpha: float, rngs: nnx.Rngs):
    self.base = base
    self.a = LoRAParam(jax.random.normal(rngs.params(), (base.in_features, rank), jnp.float32) / base.in_features**0.5)
    self.b = LoRAParam(jnp.zeros((rank, base.out_features), jnp.float32))  # starts as the base layer exactly
    self.scale = alpha / rank

  def __call__(self, x):
    update = (x.astype(jnp.bfloat16) @ self.a[...].astype(jnp.bfloat16)) @ self.b[...].astype(jnp.bfloat16)
    return self.base(x) + (self.scale * update).astype(x.dtype)


class Mlp(nnx.Module):
  def __init__(self, first, second):
    self.first, self.second = first, second

  def __call__(self, x):
    return self.second(jax.nn.gelu(self.first(x)))


def make_problem(seed: int, width: int = 512, rank: int = 8, tokens: int = 256):
  """Frozen FP8 base layers, and inputs/targets from the teacher: the same MLP with rank-`rank` weight updates."""
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  weights = [jax.random.normal(next(keys), (width, width), jnp.float32) / width**0.5 for _ in range(2)]
  updates = [(jax.random.normal(next(keys), (width, rank)) @ jax.random.normal(next(keys), (rank, width)))
             / (4 * width**0.5) for _ in range(2)]
  bases = [Fp8Linear.from_weights(*quantize_weight_blockwise(w, (128, 128)), param_dtype=jnp.bfloat16,
                                  transposed_weight=True) for w in weights]
  x = jax.random.normal(next(keys), (tokens, width), jnp.float32).astype(jnp.bfloat16)
  hidden = jax.nn.gelu(x.astype(jnp.float32) @ (weights[0] + updates[0]).T)
  y = (hidden @ (weights[1] + updates[1]).T).astype(jnp.bfloat16)
  return bases, x, y, next(keys)


def train(steps: int = 200, seed: int = 0, rank: int = 8, learning_rate: float = 1e-2, log_every: int = 20,
          log=print) -> tuple[list[float], Mlp]:
  """Trains the adapters; returns the loss at every step and the model."""
  bases, x, y, key = make_problem(seed, rank=rank)
  rngs = nnx.Rngs(key)
  model = Mlp(*(LoRAFp8Linear(base, rank, alpha=2.0 * rank, rngs=rngs) for base in bases))
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=LoRAParam)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LoRAParam))(model)
    optimizer.update(model, grads)
    return loss

  losses = []
  for i in range(steps):
    losses.append(float(step(model, optimizer, x, y)))
    if log_every and (i % log_every == 0 or i == steps - 1):
      log(f"step {i:4d}  loss {losses[-1]:.5f}")
  return losses, model


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--rank", type=int, default=8)
  args = parser.parse_args()
  losses, _ = train(args.steps, args.seed, args.rank)
  print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} ({losses[-1] / losses[0]:.3f}x)")


if __name__ == "__main__":
  main()
