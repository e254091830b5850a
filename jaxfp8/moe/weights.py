"""An MoE block's weights as the layer holds them, and their Hugging Face FP8 checkpoint form (docs/CONTRACT.md §4,
§8): `MoeWeights`, `check_moe_weights`, `load_hf_moe`, `save_hf_moe`.

In a checkpoint each expert e of the block at `prefix` (e.g. "model.layers.3.mlp") is three block-FP8 linears,
`{prefix}.experts.{e}.{gate_proj,up_proj,down_proj}` (`weight` + `weight_scale_inv`); the router is the float
`{prefix}.gate.weight` (E, H), with DeepSeek-V3's `{prefix}.gate.e_score_correction_bias` (E,); DeepSeek-V3's shared
experts are `{prefix}.shared_experts.{gate_proj,up_proj,down_proj}`. The layer stacks the experts once, at load time:
w13 (E, 2I, H) = [gate_proj | up_proj] per expert, w2 (E, H, I).

`check_moe_weights` is the one check of a block: the loader runs it on what it read, the saver before it writes (so
that what is saved loads back), `Fp8MoE` on what it is given.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxfp8 import _checks, checkpoints
from jaxfp8.weights import FP8, Fp8LinearWeight, _check_scale_shape

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
F32 = np.dtype(np.float32)


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
  correction_bias: jax.Array | np.ndarray | None = None     # (E_all,) DeepSeek-V3's e_score_correction_bias
  shared_gate_up: Fp8LinearWeight | None = None             # (2I_s, H)
  shared_down: Fp8LinearWeight | None = None                # (H, I_s)
  first_expert: int = 0   # the global id of w13_q[0]: a contiguous share [first, first + E) of the router's experts

  @property
  def num_experts(self) -> int:
    return self.w13_q.shape[0]

  @property
  def holds_every_expert(self) -> bool:
    return self.first_expert == 0 and self.num_experts == self.gate_weight.shape[0]


def _labels(prefix: str | None) -> dict[str, str]:
  """How errors name each field: `weights.<field>`, or with a checkpoint prefix the tensors it is stored as."""
  if prefix is None:
    return {f.name: f"weights.{f.name}" for f in dataclasses.fields(MoeWeights)}
  experts = f"{prefix}.experts.<e>"
  return {"w13_q": f"{experts}.{{gate_proj,up_proj}}.weight (stacked)",
          "w13_s": f"{experts}.{{gate_proj,up_proj}}.weight_scale_inv (stacked)",
          "w2_q": f"{experts}.down_proj.weight (stacked)", "w2_s": f"{experts}.down_proj.weight_scale_inv (stacked)",
          "gate_weight": f"{prefix}.gate.weight", "correction_bias": f"{prefix}.gate.e_score_correction_bias",
          "shared_gate_up": f"{prefix}.shared_experts.{{gate_proj,up_proj}} (stacked)",
          "shared_down": f"{prefix}.shared_experts.down_proj", "block_size": "block_size",
          "first_expert": "first_expert"}


def check_moe_weights(weights: MoeWeights, prefix: str | None = None, *, router_experts: int | None = None) -> None:
  """Checks a block's arrays against each other (docs/CONTRACT.md §4, §8): the stacked experts (E, 2I, H) and
  (E, H, I) with their block scales, I whole gn blocks (gate_proj and up_proj split there); the float router
  (E_all, H) covering experts [0, router_experts) (default first_expert + E); the correction bias (E_all,); the
  shared experts (2I_s, H) and (H, I_s). Errors name `weights.<field>`, or with `prefix` the checkpoint's tensors."""
  if not isinstance(weights, MoeWeights):
    raise TypeError(f"weights must be MoeWeights, got {type(weights).__name__}")
  name = _labels(prefix)
  gn, gk = _checks.block_size(weights.block_size)
  first = weights.first_expert
  if isinstance(first, bool) or not isinstance(first, numbers.Integral) or first < 0:
    raise ValueError(f"{name['first_expert']} must be a non-negative int (the global id of the first expert), got "
                     f"{first!r}")
  for field, dtype in (("w13_q", FP8), ("w13_s", F32), ("w2_q", FP8), ("w2_s", F32)):
    _checks.array(name[field], getattr(weights, field), (dtype,), ndim=3)
  e, two_i, h = weights.w13_q.shape
  i = two_i // 2
  if e == 0 or two_i % 2 or i % gn:
    raise ValueError(f"{name['w13_q']} must be (E, 2I, H) with E >= 1 and I a multiple of gn={gn} (gate_proj and "
                     f"up_proj split between weight-scale blocks), got {tuple(weights.w13_q.shape)}")
  for field, want in (("w13_s", (e, two_i // gn, -(-h // gk))), ("w2_q", (e, h, i)),
                      ("w2_s", (e, -(-h // gn), -(-i // gk)))):
    if tuple(getattr(weights, field).shape) != want:
      raise ValueError(f"{name[field]} must have shape {want} for {name['w13_q']} of shape "
                       f"{tuple(weights.w13_q.shape)} and block_size={(gn, gk)}, got "
                       f"{tuple(getattr(weights, field).shape)}")
  _check_router(weights, name, h, first + e if router_experts is None else router_experts)
  _check_shared(weights, name, h, (gn, gk))


def _check_router(weights: MoeWeights, name: dict[str, str], hidden: int, router_experts: int) -> None:
  gate = weights.gate_weight
  _checks.array(name["gate_weight"], gate, _checks.FLOAT_DTYPES, ndim=None)  # a router stays in float
  if len(gate.shape) != 2 or gate.shape[1] != hidden or gate.shape[0] < router_experts:
    raise ValueError(f"{name['gate_weight']} must have shape (E, H) with H={hidden} and E >= {router_experts} (a "
                     f"router covers every expert, experts [0, {router_experts}) here), got {tuple(gate.shape)}")
  bias = weights.correction_bias
  if bias is not None:
    _checks.array(name["correction_bias"], bias, _checks.FLOAT_DTYPES, ndim=None)
    if tuple(bias.shape) != (gate.shape[0],):
      raise ValueError(f"{name['correction_bias']} must have shape (E,) = ({gate.shape[0]},), one per expert of "
                       f"the router, got {tuple(bias.shape)}")


def _check_shared(weights: MoeWeights, name: dict[str, str], hidden: int, block: tuple[int, int]) -> None:
  gate_up, down = weights.shared_gate_up, weights.shared_down
  if gate_up is None and down is None:
    return
  for field, w in (("shared_gate_up", gate_up), ("shared_down", down)):
    if not isinstance(w, Fp8LinearWeight):
      raise TypeError(f"{name[field]} must be an Fp8LinearWeight (shared experts have both gate_up and down), got "
                      f"{type(w).__name__}")
    _checks.array(f"{name[field]}.w_q", w.w_q, (FP8,), ndim=2)
    _checks.array(f"{name[field]}.w_s", w.w_s, (F32,), ndim=2)
    if tuple(w.block_size) != block:
      raise ValueError(f"{name[field]} has block_size {tuple(w.block_size)}, the experts {block}: a block has one")
    _check_scale_shape(tuple(w.w_q.shape), tuple(w.w_s.shape), block, f"{name[field]}.w_s")
    if w.bias is not None:
      raise ValueError(f"{name[field]} has a bias: shared experts have none (DeepSeek-V3's MLP is bias-free)")
  two_i = gate_up.shape[0]
  if gate_up.shape[1] != hidden or two_i % 2 or (two_i // 2) % block[0]:
    raise ValueError(f"{name['shared_gate_up']} must be (2I_s, H) with H={hidden} and I_s a multiple of "
                     f"gn={block[0]}, got {tuple(gate_up.shape)}")
  if tuple(down.shape) != (hidden, two_i // 2):
    raise ValueError(f"{name['shared_down']} must be (H, I_s) = {(hidden, two_i // 2)}, got {tuple(down.shape)}")


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


def _found_experts(path, prefix: str) -> list[int]:
  """The expert ids with tensors under `{prefix}.experts.`, a consecutive run; a tensor there that is not an
  expert's (a fused `experts.gate_up_proj`) or a gap in the run is refused, naming it."""
  expert_prefix = f"{prefix}.experts."
  found = set()
  for tensor in checkpoints.tensor_names(path):
    if tensor.startswith(expert_prefix):
      head = tensor[len(expert_prefix):].split(".")[0]
      if not head.isdigit():
        raise ValueError(f"{tensor!r} is not one expert's tensor ({expert_prefix}<e>.{{{','.join(PROJECTIONS)}}}): "
                         "fused expert tensors (transformers' experts.gate_up_proj layout) are not supported")
      found.add(int(head))
  found = sorted(found)
  if not found:
    raise ValueError(f"no block-FP8 experts {expert_prefix}<e>.{{{','.join(PROJECTIONS)}}} in {path!r}")
  if gaps := sorted(set(range(found[0], found[-1] + 1)) - set(found)):
    raise ValueError(f"{prefix!r} lacks expert(s) {gaps}: it holds experts {found[0]}..{found[-1]} otherwise (a "
                     "block's experts are a consecutive run)")
  return found


def _expert_ids(experts, found: list[int], prefix: str) -> list[int]:
  """`load_hf_moe`'s experts argument, checked: int ids, a non-empty ascending consecutive run, all in the file."""
  if experts is None:
    return found
  if isinstance(experts, (str, bytes)) or not isinstance(experts, Iterable):
    raise TypeError(f"experts must be a sequence of int expert ids (one device's share), got {experts!r}")
  ids = list(experts)
  for e in ids:
    if isinstance(e, (bool, np.bool_)) or not isinstance(e, numbers.Integral):
      raise TypeError(f"experts must hold int expert ids, got {e!r} ({type(e).__name__}) in {ids!r}")
  ids = [int(e) for e in ids]
  if not ids or ids != list(range(ids[0], ids[0] + len(ids))):
    raise ValueError(f"experts must be a non-empty ascending run of consecutive ids (one device's share), got {ids}")
  if ids[0] < found[0] or ids[-1] > found[-1]:
    raise ValueError(f"experts={ids} reaches outside the experts {found[0]}..{found[-1]} of {prefix!r}")
  return ids


def _expert_tensors(linears, prefix: str, indices: list[int]) -> tuple[list, list]:
  """[(w13 codes, scales)] and [(w2 codes, scales)] of the experts, each checked against the first one's shapes."""
  w13, w2, want = [], [], None
  for e in indices:
    names = {proj: f"{prefix}.experts.{e}.{proj}" for proj in PROJECTIONS}
    if missing := [n for n in names.values() if n not in linears]:
      raise ValueError(f"expert {e} of {prefix!r} lacks the block-FP8 linears {missing}")
    if want is None:  # the first expert's gate_proj sets (I, H)
      i, h = linears[names["gate_proj"]].shape
      want = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for proj, name in names.items():
      if tuple(linears[name].shape) != want[proj]:
        raise ValueError(f"{name}.weight of expert {e} has shape {tuple(linears[name].shape)}, but must be "
                         f"{want[proj]} ((I, H) = {want['gate_proj']} from {prefix}.experts.{indices[0]}.gate_proj): "
                         "every expert of a block has the same shapes")
    w13.append(stack_gate_up(linears[names["gate_proj"]], linears[names["up_proj"]], f"{prefix} expert {e}"))
    w2.append((np.asarray(linears[names["down_proj"]].w_q), np.asarray(linears[names["down_proj"]].w_s)))
  return w13, w2


def load_hf_moe(path: str | os.PathLike | Sequence[str | os.PathLike], prefix: str, *,
                experts: Sequence[int] | None = None, block_size: tuple[int, int] | None = None,
                as_numpy: bool = False) -> MoeWeights:
  """The MoE block at `prefix` of a Hugging Face FP8 checkpoint (module docstring), stacked and checked
  (`check_moe_weights`).

  experts: the expert ids to load, a consecutive ascending run (default all, found from the tensor names), e.g. one
  device's share under expert parallelism; as_numpy: keep NumPy arrays instead of putting them on the default
  device. A malformed block (an expert of other shapes, a missing expert or projection, fused expert tensors) is
  refused, naming the tensor and the expert."""
  if not isinstance(prefix, str) or not prefix:
    raise TypeError(f"prefix must be a non-empty str (e.g. 'model.layers.3.mlp'), got {prefix!r}")
  found = _found_experts(path, prefix)
  indices = _expert_ids(experts, found, prefix)
  expert_prefix = f"{prefix}.experts."
  linears = checkpoints.load_hf_fp8_linears(
      path, block_size=block_size, as_numpy=True,
      select=lambda name: name.startswith(expert_prefix) or name.startswith(f"{prefix}.shared_experts."))
  w13, w2 = _expert_tensors(linears, prefix, indices)
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
  # The router always covers every expert: routing is global, whichever experts this process holds.
  weights = MoeWeights(np.stack([q for q, _ in w13]), np.stack([s for _, s in w13]), np.stack([q for q, _ in w2]),
                       np.stack([s for _, s in w2]), router[f"{prefix}.gate.weight"], block,
                       router.get(f"{prefix}.gate.e_score_correction_bias"), shared_gate_up, shared_down,
                       first_expert=indices[0])
  check_moe_weights(weights, prefix, router_experts=found[-1] + 1)
  if as_numpy:
    return weights
  put = lambda a: a if a is None or isinstance(a, Fp8LinearWeight) else jax.device_put(a)
  return MoeWeights(**{f.name: put(getattr(weights, f.name)) if f.name not in ("block_size", "first_expert")
                       else getattr(weights, f.name) for f in dataclasses.fields(MoeWeights)})


def save_hf_moe(path: str | os.PathLike, prefix: str, weights: MoeWeights) -> None:
  """Writes the block in the Hugging Face naming (module docstring) to one safetensors file (a directory gets
  `model.safetensors`), with config.json's quantization_config, as `jaxfp8.save_hf_fp8_linears` does. The block is
  checked first as `load_hf_moe` checks what it reads (`check_moe_weights`): on an error nothing is written."""
  if not isinstance(prefix, str) or not prefix:
    raise TypeError(f"prefix must be a non-empty str (e.g. 'model.layers.3.mlp'), got {prefix!r}")
  check_moe_weights(weights, prefix)
  block = tuple(weights.block_size)
  w13_q, w13_s = np.asarray(weights.w13_q), np.asarray(weights.w13_s)
  half_q, half_s = w13_q.shape[1] // 2, w13_s.shape[1] // 2
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
