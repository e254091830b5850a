"""The Mosaic GPU decode dispatch (pallas_kernels/dispatch_mosaic.py) behind the MoE layer's
dispatch_implementation="mosaic": interpreted on CPU against XLA's counting sort (jaxfp8/moe/layer.py `dispatch`)
and the grouped GEMM's table from the sorted rows, on fresh random ids (ids outside the experts, one expert for every
slot, no expert at all), both row tiles; the layer on it bit for bit the layer on XLA's; the planner's choice and its
errors; lowered for an H200 as one kernel; natively on a Hopper GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfp8 import _platform, moe
from jaxfp8.grouped import mosaic as grouped_mosaic
from jaxfp8.moe import layer, sort
from jaxfp8.tools import bench_moe
from helpers import backend_importable, fake_device, kernel_calls

IMPORTABLE = backend_importable(sort.KERNEL_MODULE)
pytestmark = pytest.mark.skipif(not IMPORTABLE, reason=f"{sort.KERNEL_MODULE} does not import here")


def _kernels():
  from pallas_kernels import dispatch_mosaic, grouped_gemm_mosaic
  return dispatch_mosaic, grouped_gemm_mosaic


def _ids(rng, r, e):
  kind = rng.integers(4)
  if kind == 0:  # one expert for every slot
    return np.full(r, rng.integers(0, e), np.int32)
  if kind == 1:  # no slot of any expert here
    return rng.choice([-1, e, e + 5], r).astype(np.int32)
  return rng.integers(-2, e + 2, r).astype(np.int32)


def _check(ids: np.ndarray, e: int, tile_m: int, interpret: bool = True) -> None:
  """The kernel's outputs against XLA's dispatch and the table from the rows; the padding items all zero."""
  dm, ggm = _kernels()
  r = ids.shape[0]
  width = grouped_mosaic.table_columns(r, e, tile_m)
  rows, order, live, table = (np.asarray(a) for a in dm.decode_dispatch(
      jnp.asarray(ids), experts=e, num_items=width, config=dm.DispatchConfig(tile_m), interpret=interpret))
  d = layer.dispatch(jnp.asarray(ids), e)
  key = np.where((ids >= 0) & (ids < e), ids, e).astype(np.int32)
  within = np.array([np.sum(key[:i] == key[i]) for i in range(r)], np.int32)
  want = np.asarray(ggm.ragged_items_from_rows(jnp.asarray(key), d.rank, jnp.asarray(within), e, tile_m))
  case = f"ids={ids.tolist()} E={e} tile_m={tile_m}"
  np.testing.assert_array_equal(rows, np.asarray(d.rank), err_msg=case)
  np.testing.assert_array_equal(order, np.asarray(d.order), err_msg=case)
  np.testing.assert_array_equal(live, np.full(r, int(d.live)), err_msg=case)
  np.testing.assert_array_equal(table[:, :want.shape[1]], want, err_msg=case)
  assert (table[:, want.shape[1]:] == 0).all(), case


@pytest.mark.parametrize("tile_m", [64, 4])
def test_matches_xla_counting_sort_and_the_table_from_rows(rng, tile_m):
  done = 0
  while done < 5:
    r, e = int(rng.choice([4, 8, 12, 24, 64])), int(rng.choice([1, 3, 32, 128, 256]))
    if grouped_mosaic.table_columns(r, e, tile_m) > 64:  # tile_m=4 at 64 slots: more items than one tile's rows
      continue
    _check(_ids(rng, r, e), e, tile_m)
    done += 1


def test_layer_on_it_is_the_layer_on_xla_bit_for_bit(rng):
  """Both tiny layers (the expert-parallel share's ids mostly outside its experts), interpreted."""
  # tiny at 2 tokens (a few slots), the share at 32 (all 64 slots of the kernel's tile)
  for name, tokens in (("tiny", (2,)), ("tiny_ep4", (32,))):
    lay = bench_moe.LAYERS[name]
    w = bench_moe._layer_values(lay, jax.random.key(0))
    for t in tokens:
      x = jnp.asarray(rng.standard_normal((t, lay.hidden)).astype(np.float32)).astype(jnp.bfloat16)
      ids = jnp.asarray(rng.integers(-1, lay.experts + 3, (t, lay.top_k)).astype(np.int32))
      weights = jnp.asarray(rng.random((t, lay.top_k)).astype(np.float32))
      args = (x, ids, weights, w["w13_q"], w["w13_s"], w["w2_q"], w["w2_s"])
      plan = moe.explain(x, w["w13_q"], w["w2_q"], lay.top_k, implementation="mosaic", interpret=True,
                         dispatch_implementation="mosaic")
      assert plan.sort.implementation == "mosaic", str(plan)
      out = [np.asarray(moe.fp8_moe(*args, implementation="mosaic", interpret=True, dispatch_implementation=which))
             for which in ("mosaic", "xla")]
      assert out[0].view(np.uint16).tobytes() == out[1].view(np.uint16).tobytes(), (name, t)


def _plan(t, top_k=8, e=128, h=2048, i=768, device=None, **options):
  """Qwen3-30B-A3B's layer by default, its GEMMs the Mosaic ones (interpreted here, unless asked otherwise)."""
  options.setdefault("implementation", "mosaic")
  x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
  return moe.explain(x, jax.ShapeDtypeStruct((e, 2 * i, h), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((e, h, i), jnp.float8_e4m3fn), top_k,
                     device=device or fake_device((9, 0)), **options)


def test_the_plan_says_which_runs_and_why(monkeypatch):
  assert not sort.MOSAIC_BY_DEFAULT or _plan(1).sort.implementation == "mosaic"
  monkeypatch.setattr(sort, "MOSAIC_BY_DEFAULT", False)
  default = _plan(1).sort
  assert default.implementation == "xla" and "MOSAIC_BY_DEFAULT" in default.reason
  monkeypatch.setattr(sort, "MOSAIC_BY_DEFAULT", True)
  for t in (1, 8):  # 8 and 64 slots
    chosen = _plan(t).sort
    assert chosen.implementation == "mosaic" and "one kernel" in chosen.reason and chosen.config.tile_m == 64
    assert "dispatch: mosaic" in str(_plan(t))
  past = _plan(9).sort  # 72 slots
  assert past.implementation == "xla" and "up to 64" in past.reason
  assert _plan(1, implementation="xla").sort.implementation == "xla"  # the XLA GEMMs read no such table
  assert _plan(1, device=fake_device(None), interpret=False, implementation=None).sort.implementation == "xla"


def test_asking_for_what_cannot_run_says_why():
  with pytest.raises(ValueError, match="dispatch_implementation='mosaic' cannot run here: R=6 routed slots"):
    _plan(1, top_k=6, dispatch_implementation="mosaic")
  with pytest.raises(ValueError, match="dispatch_implementation"):
    _plan(1, dispatch_implementation="triton")
  assert _plan(1, dispatch_implementation="xla").sort.implementation == "xla"


@pytest.mark.parametrize("name,tokens", [("deepseek_v3_ep8", 1), ("deepseek_v3_ep8", 8), ("qwen3_30b_a3b", 1)])
def test_lowers_for_an_h200_as_one_kernel(name, tokens):
  lay = bench_moe.LAYERS[name]
  with _platform.abstract_h200():
    plan = _plan(tokens, lay.top_k, lay.experts, lay.hidden, lay.intermediate, device=_platform.device(),
                 dispatch_implementation="mosaic")
    fn = jax.jit(lambda ids: (lambda d: (d.order, d.rank, d.live_counts, d.tables))(
        layer.dispatch(ids, lay.experts, plan)))
    text = jax.export.export(fn, platforms=["cuda"])(
        jax.ShapeDtypeStruct((tokens, lay.top_k), jnp.int32)).mlir_module()
  assert kernel_calls(text).count("mosaic_gpu_v2") == 1, kernel_calls(text)


@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_matches_xla(rng):
  if not _platform.is_hopper():
    pytest.skip("needs a Hopper GPU")
  for _ in range(20):
    r, e = int(rng.choice([8, 16, 24, 64])), int(rng.choice([1, 32, 128, 256]))
    _check(_ids(rng, r, e), e, 64, interpret=False)
