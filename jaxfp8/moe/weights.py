"""An MoE block's weights as the layer holds them, and their Hugging Face FP8 checkpoint form (docs/CONTRACT.md §4,
§8): `MoeWeights`, `load_hf_moe`, `save_hf_moe`.

In a checkpoint each expert e of the block at `prefix` (e.g. "model.layers.3.mlp") is three block-FP8 linears,
`{prefix}.experts.{e}.{gate_proj,up_proj,down_proj}` (`weight` + `weight_scale_inv`); the router is the float
`{prefix}.gate.weight` (E, H), with DeepSeek-V3's `{prefix}.gate.e_score_correction_bias` (E,); DeepSeek-V3's shared
experts are `{prefix}.shared_experts.{gate_proj,up_proj,down_proj}`. The layer stacks the experts once, at load time:
w13 (E, 2I, H) = [gate_proj | up_proj] per expert, w2 (E, H, I).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np

from jaxfp8 import _checks, checkpoints
from jaxfp8.weights import Fp8LinearWeight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class MoeWeights:
  """An MoE block's arrays: the stacked experts, the router, and optional shared experts (gate_up stacked the same
  way, down)."""
  w13_q: jax.Array | np.ndarray          # (E, 2I, H) float8_e4m3fn
  w13_s: jax.Array | np.ndarray          # (E, ceil(2I/gn), ceil(H/gk)) float32
  w2_q: jax.Array | np.ndarray           # (E, H, I)
  w2_s: jax.Array | np.ndarray           # (E, ceil(H/gn), ceil(I/gk))
  gate_weight: jax.Array | np.ndarray    # (E_all, H) float, the router (every expert, whichever are held)
  block_size: tuple[int, int] = (128, 128)
  correction_bias: jax.Array | np.ndarray | None = None     # (E,) DeepSeek-V3's e_score_correction_bias
  shared_gate_up: Fp8LinearWeight | None = None             # (2I_s, H)
  shared_down: Fp8LinearWeight | None = None                # (H, I_s)
  first_expert: int = 0   # the global id of w13_q[0]: a contiguous share [first, first + E) of the router's experts

  @property
  def num_experts(self) -> int:
    return self.w13_q.shape[0]

  @property
  def holds_every_expert(self) -> bool:
    return self.first_expert == 0 and self.num_experts == self.gate_weight.shape[0]


def stack_gate_up(gate: Fp8LinearWeight, up: Fp8LinearWeight, name: str) -> tuple[np.ndarray, np.ndarray]:
  """[gate | up] codes (2I, H) and scales; the scales stack only when I is whole weight-scale blocks."""
  gn = gate.block_size[0]
  if gate.shape != up.shape:
    raise ValueError(f"{name}: gate_proj {gate.shape} and up_proj {up.shape} must have the same shape")
  if gate.shape[0] % gn:
    raise ValueError(f"{name}: the intermediate size I={gate.shape[0]} must be a multiple of gn={gn} to stack "
                     "gate_proj and up_proj (their block scales would otherwise share a block)")
  return (np.concatenate([np.asarray(gate.w_q), np.asarray(up.w_q)]),
          np.concatenate([np.asarray(gate.w_s), np.asarray(up.w_s)]))


def load_hf_moe(path: str | os.PathLike | Sequence[str | os.PathLike], prefix: str, *,
                experts: Sequence[int] | None = None, block_size: tuple[int, int] | None = None,
                as_numpy: bool = False) -> MoeWeights:
  """The MoE block at `prefix` of a Hugging Face FP8 checkpoint (module docstring), stacked.

  experts: the expert indices to load (default all, found from the file names), e.g. one device's share under
  expert parallelism; as_numpy: keep NumPy arrays instead of putting them on the default device."""
  if not isinstance(prefix, str) or not prefix:
    raise TypeError(f"prefix must be a non-empty str (e.g. 'model.layers.3.mlp'), got {prefix!r}")
  expert_prefix = f"{prefix}.experts."
  linears = checkpoints.load_hf_fp8_linears(
      path, block_size=block_size, as_numpy=True,
      select=lambda name: name.startswith(expert_prefix) or name.startswith(f"{prefix}.shared_experts."))
  found = sorted({int(name[len(expert_prefix):].split(".")[0]) for name in linears if name.startswith(expert_prefix)})
  if not found:
    raise ValueError(f"no block-FP8 experts {expert_prefix}<e>.{{{','.join(PROJECTIONS)}}} in {path!r}")
  indices = found if experts is None else [int(e) for e in experts]
  if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
    raise ValueError(f"experts must be a non-empty ascending run of consecutive ids (one device's share), got "
                     f"{list(experts) if experts is not None else indices}")
  w13, w2 = [], []
  for e in indices:
    names = {proj: f"{expert_prefix}{e}.{proj}" for proj in PROJECTIONS}
    if missing := [n for n in names.values() if n not in linears]:
      raise ValueError(f"expert {e} of {prefix!r} lacks {missing} (experts found: {found[0]}..{found[-1]})")
    w13.append(stack_gate_up(linears[names["gate_proj"]], linears[names["up_proj"]], f"{prefix} expert {e}"))
    w2.append((np.asarray(linears[names["down_proj"]].w_q), np.asarray(linears[names["down_proj"]].w_s)))
  block = linears[f"{expert_prefix}{indices[0]}.down_proj"].block_size
  router = checkpoints.read_tensors(path, [f"{prefix}.gate.weight"],
                                    optional=[f"{prefix}.gate.e_score_correction_bias"])
  shared = {proj: linears.get(f"{prefix}.shared_experts.{proj}") for proj in PROJECTIONS}
  shared_gate_up = shared_down = None
  if any(shared.values()):
    if not all(shared.values()):
      raise ValueError(f"{prefix}.shared_experts must have all of {PROJECTIONS}, found "
                       f"{[p for p, w in shared.items() if w is not None]}")
    q, s = stack_gate_up(shared["gate_proj"], shared["up_proj"], f"{prefix}.shared_experts")
    shared_gate_up, shared_down = Fp8LinearWeight(q, s, None, block), shared["down_proj"]
  bias = router.get(f"{prefix}.gate.e_score_correction_bias")
  gate_weight = router[f"{prefix}.gate.weight"]
  if gate_weight.dtype not in _checks.FLOAT_DTYPES:  # e.g. a router stored in FP8 beside its own scales
    raise ValueError(f"{prefix}.gate.weight must be a bf16, f16 or f32 router, got dtype {gate_weight.dtype}")
  hidden = w13[0][0].shape[1]
  # (E, H) over every expert of the block; a checkpoint of one device's share holds fewer experts than that.
  if gate_weight.ndim != 2 or gate_weight.shape[1] != hidden or gate_weight.shape[0] <= found[-1]:
    raise ValueError(f"{prefix}.gate.weight must have shape (E, H) with H={hidden} and E above every expert id "
                     f"(up to {found[-1]}), got {gate_weight.shape}")
  if bias is not None and bias.shape != gate_weight.shape[:1]:
    raise ValueError(f"{prefix}.gate.e_score_correction_bias must have shape (E,) = {gate_weight.shape[:1]}, got "
                     f"{bias.shape}")
  # The router always covers every expert: routing is global, whichever experts this process holds.
  weights = MoeWeights(np.stack([q for q, _ in w13]), np.stack([s for _, s in w13]), np.stack([q for q, _ in w2]),
                       np.stack([s for _, s in w2]), gate_weight, block, bias, shared_gate_up, shared_down,
                       first_expert=indices[0])
  if as_numpy:
    return weights
  put = lambda a: a if a is None or isinstance(a, Fp8LinearWeight) else jax.device_put(a)
  return MoeWeights(**{f.name: put(getattr(weights, f.name)) if f.name not in ("block_size", "first_expert")
                       else getattr(weights, f.name) for f in dataclasses.fields(MoeWeights)})


def save_hf_moe(path: str | os.PathLike, prefix: str, weights: MoeWeights) -> None:
  """Writes the block in the Hugging Face naming (module docstring) to one safetensors file (a directory gets
  `model.safetensors`), with config.json's quantization_config, as `jaxfp8.save_hf_fp8_linears` does."""
  if not isinstance(weights, MoeWeights):
    raise TypeError(f"weights must be MoeWeights, got {type(weights).__name__}")
  block = _checks.block_size(weights.block_size)
  w13_q, w13_s = np.asarray(weights.w13_q), np.asarray(weights.w13_s)
  half_q, half_s = w13_q.shape[1] // 2, w13_s.shape[1] // 2
  if w13_q.shape[1] % 2 or half_q % block[0]:
    raise ValueError(f"w13_q's 2I={w13_q.shape[1]} rows must split into gate_proj and up_proj of whole gn={block[0]} "
                     "blocks")
  linears = {}
  for e in range(weights.num_experts):
    base = f"{prefix}.experts.{weights.first_expert + e}"  # the global ids, as the checkpoint numbered them
    linears[f"{base}.gate_proj"] = Fp8LinearWeight(w13_q[e, :half_q], w13_s[e, :half_s], None, block)
    linears[f"{base}.up_proj"] = Fp8LinearWeight(w13_q[e, half_q:], w13_s[e, half_s:], None, block)
    linears[f"{base}.down_proj"] = Fp8LinearWeight(np.asarray(weights.w2_q[e]), np.asarray(weights.w2_s[e]), None,
                                                   block)
  if weights.shared_gate_up is not None:
    q, s = np.asarray(weights.shared_gate_up.w_q), np.asarray(weights.shared_gate_up.w_s)
    hq, hs = q.shape[0] // 2, s.shape[0] // 2
    linears[f"{prefix}.shared_experts.gate_proj"] = Fp8LinearWeight(q[:hq], s[:hs], None, block)
    linears[f"{prefix}.shared_experts.up_proj"] = Fp8LinearWeight(q[hq:], s[hs:], None, block)
    linears[f"{prefix}.shared_experts.down_proj"] = weights.shared_down
  extra = {f"{prefix}.gate.weight": np.asarray(weights.gate_weight)}
  if weights.correction_bias is not None:
    extra[f"{prefix}.gate.e_score_correction_bias"] = np.asarray(weights.correction_bias)
  checkpoints.save_hf_fp8_linears(path, linears, extra=extra)
