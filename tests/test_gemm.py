"""Block-scaled FP8 GEMM (docs/CONTRACT.md §2): every implementation against the float64 reference.

On CPU the Triton kernel runs in interpret mode, where out-of-bounds reads come back as NaN and unwritten outputs stay
NaN: a missing mask or an unwritten tile shows up as NaN in the result. GPU tests (full shapes.json sizes) are marked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
import helpers

from jaxfp8 import _platform, gemm
from jaxfp8.tools import baselines
from jaxfp8 import reference as ref
from jaxfp8 import shapes
from jaxfp8.gemm import TritonGemmConfig, w8a8_block_fp8_matmul
from pallas_kernels import gemm_triton

SHAPES = shapes.load()
# docs/CONTRACT.md §2 tolerances (relative Frobenius error vs float64); fp16 output is held to the bf16 bound.
TOLERANCE = {jnp.dtype(jnp.float32): 2e-4, jnp.dtype(jnp.bfloat16): 5e-3, jnp.dtype(jnp.float16): 5e-3}
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _cfg(bm, bn, bk, *, group_m=2, num_warps=4, num_stages=2, split_k=1, swap_ab=False) -> TritonGemmConfig:
  return TritonGemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=group_m, num_warps=num_warps,
                          num_stages=num_stages, split_k=split_k, swap_ab=swap_ab)


@dataclasses.dataclass(frozen=True)
class Problem:
  a_q: np.ndarray
  b_q: np.ndarray
  a_s: np.ndarray  # row-major (M, G): what the reference takes
  b_s: np.ndarray
  bias: np.ndarray | None
  block_size: tuple[int, int]
  a_s_arg: np.ndarray  # what the call gets: a_s, or the column-major (G, M') array with NaN in its pad columns
  column_major: bool

  def reference(self) -> np.ndarray:
    return ref.block_fp8_matmul(self.a_q, self.b_q, self.a_s, self.b_s, self.block_size, bias=self.bias)

  def call(self, **kwargs):
    return w8a8_block_fp8_matmul(self.a_q, self.b_q, self.a_s_arg, self.b_s, self.block_size,
                                 a_s_column_major=self.column_major, bias=self.bias, **kwargs)


def make_problem(rng, m, n, k, block_size, *, column_major=False, bias=False, exact=False) -> Problem:
  """Fresh inputs: fp8 codes from quantizing random normal data with the reference, random positive scales.

  exact=True: the exactness check of docs/CONTRACT.md §2 (integer codes in [-4, 4], power-of-two scales in [1/4, 4]).
  """
  gn, gk = block_size
  groups, n_blocks = ref.ceil_div(k, gk), ref.ceil_div(n, gn)
  if exact:
    a_q = rng.integers(-4, 5, (m, k)).astype(np.float32).astype(ref.FP8)
    b_q = rng.integers(-4, 5, (n, k)).astype(np.float32).astype(ref.FP8)
    a_s = np.exp2(rng.integers(-2, 3, (m, groups))).astype(np.float32)
    b_s = np.exp2(rng.integers(-2, 3, (n_blocks, groups))).astype(np.float32)
    bias_arr = rng.integers(-8, 9, n).astype(np.float32) if bias else None
  else:
    x = rng.standard_normal((m, groups * gk)).astype(np.float32)
    a_q, a_s = ref.per_token_group_quant_fp8(x, gk)
    a_q = a_q[:, :k]
    b_q, b_s = ref.quantize_weight_blockwise(rng.standard_normal((n, k)).astype(np.float32), block_size)
    # The quantizers' scales times random factors in 2^-3 .. 2^3, so that a group read with the wrong scale is visible
    # while outputs stay in float16 range.
    a_s = (a_s * np.exp2(rng.uniform(-3, 3, a_s.shape))).astype(np.float32)
    b_s = (b_s * np.exp2(rng.uniform(-3, 3, b_s.shape))).astype(np.float32)
    bias_arr = (rng.standard_normal(n) * 100).astype(np.float32) if bias else None
  if column_major:
    # The quantizer's padded layout: M' = round_up(M, 4) + 4 columns; pad columns are poison and must be ignored.
    a_s_arg = np.full((groups, ref.round_up(m, 4) + 4), np.nan, np.float32)
    a_s_arg[:, :m] = a_s.T
  else:
    a_s_arg = a_s
  return Problem(a_q, b_q, a_s, b_s, bias_arr, tuple(block_size), a_s_arg, column_major)


def assert_close(out, problem: Problem, out_dtype):
  out_dtype = jnp.dtype(out_dtype)
  m, n = problem.a_q.shape[0], problem.b_q.shape[0]
  assert out.shape == (m, n), out.shape
  assert out.dtype == out_dtype, out.dtype
  out = np.asarray(out)
  assert not np.isnan(out.astype(np.float32)).any(), "NaN leaked into the output (unmasked read or unwritten tile)"
  err = ref.relative_error(out, problem.reference())
  assert err <= TOLERANCE[out_dtype], f"relative error {err:.3g} > {TOLERANCE[out_dtype]} for {out_dtype}"


def _scaled(name: str, model: str, factor: int) -> tuple[int, int]:
  n, k = SHAPES[model][name] if SHAPES else (1536, 7168)
  return max(1, n // factor), max(1, k // factor)


# (M, (N, K), block_size, config, out_dtype, bias, column-major a_s). Sampled rather than a full product (CPU time):
# every M of {1, 2, 3, 5, 7, 13, 64, 257}, every block size, BK < gk / == gk / > gk, BN < gn / == gn / > gn / gn not a
# multiple of BN, K and N tails, split-K, swap_ab, every out dtype, bias, both a_s layouts.
TRITON_CASES = [
    (1, _scaled("q_a_proj", "deepseek_v3", 16), (128, 128), _cfg(16, 64, 128, split_k=2, swap_ab=True), BF16, True, True),
    (2, _scaled("kv_a_proj_with_mqa", "deepseek_v3", 16), (128, 128), _cfg(16, 32, 128), F32, False, False),
    (3, (200, 300), (64, 64), _cfg(16, 64, 32), F32, True, True),
    (5, (1088, 512), (128, 128), _cfg(16, 128, 128, split_k=4, swap_ab=True), BF16, False, False),
    (7, _scaled("n_and_k_tail", "unaligned_for_fallback_tests", 16), (128, 128), _cfg(16, 64, 64), F16, True, True),
    (13, _scaled("n_and_k_tail", "unaligned_for_fallback_tests", 16), (32, 32), _cfg(16, 64, 128), F32, True, False),
    (64, (200, 300), (128, 64), _cfg(64, 64, 128), F32, False, True),
    (257, (200, 300), (64, 128), _cfg(128, 128, 64), BF16, True, False),
    (257, _scaled("o_proj", "deepseek_v3", 32), (128, 128), _cfg(64, 256, 256, group_m=2), F32, False, True),
    (13, (100, 300), (100, 64), _cfg(16, 64, 128, swap_ab=True), F32, True, False),
    (5, _scaled("q_a_proj", "deepseek_v3", 16), (128, 128), _cfg(16, 16, 32), F32, False, True),
    (7, (64, 300), (32, 96), _cfg(16, 32, 32), F32, False, False),
    (3, _scaled("n_and_k_tail", "unaligned_for_fallback_tests", 16), (64, 64), _cfg(16, 64, 64, split_k=3), F32, True,
     True),
    (13, _scaled("qkv_proj", "qwen3_4b", 32), (64, 128), _cfg(32, 128, 128, swap_ab=True), BF16, False, True),
    (64, (130, 260), (128, 128), _cfg(32, 64, 128, split_k=2), F32, True, False),
]


@pytest.mark.parametrize("m, nk, block_size, config, out_dtype, bias, column_major", TRITON_CASES)
def test_triton_matches_reference(rng, m, nk, block_size, config, out_dtype, bias, column_major):
  problem = make_problem(rng, m, *nk, block_size, column_major=column_major, bias=bias)
  out = problem.call(out_dtype=out_dtype, implementation="triton", config=config, interpret=True)
  assert_close(out, problem, out_dtype)


# Cases whose column tiles lie inside one weight-scale block (the kernel then holds the tile's row of b_s), with
# split-K and swap_ab among them, run with the per-K-step b_s load that rows of more than _MAX_HOISTED_GROUPS groups
# get. The kernel is called directly: the jitted public entry point could serve a cached trace of the other path.
@pytest.mark.parametrize("case", [0, 3, 6, 12, 14])
def test_triton_per_step_weight_scale_loads(rng, monkeypatch, case):
  m, (n, k), block_size, config, out_dtype, bias, column_major = TRITON_CASES[case]
  problem = make_problem(rng, m, n, k, block_size, column_major=column_major, bias=bias)
  monkeypatch.setattr(gemm_triton, "_MAX_HOISTED_GROUPS", 1)
  out = gemm_triton.block_fp8_matmul(
      jnp.asarray(problem.a_q), jnp.asarray(problem.b_q), jnp.asarray(problem.a_s_arg), jnp.asarray(problem.b_s),
      None if problem.bias is None else jnp.asarray(problem.bias), block_size=block_size,
      a_s_column_major=column_major, out_dtype=out_dtype, config=config, interpret=True)
  assert_close(out, problem, out_dtype)


@pytest.mark.parametrize("m, n, k, block_size", [
    (64, *_scaled("q_b_proj", "deepseek_v3", 16), (128, 128)),       # heuristic decode config (swap_ab, split-K)
    (257, *_scaled("shared_expert_down", "deepseek_v3", 16), (128, 128)),  # heuristic 128x128 tiles
    (3, *_scaled("o_proj", "qwen3_4b", 16), (64, 64)),
])
def test_triton_heuristic_config_matches_reference(rng, m, n, k, block_size):
  config = gemm.triton.heuristic_config(m, n, k, block_size)
  assert config is not None
  problem = make_problem(rng, m, n, k, block_size, column_major=True, bias=True)
  out = problem.call(out_dtype=F32, implementation="triton", interpret=True)
  assert_close(out, problem, F32)


@pytest.mark.parametrize("m, nk, block_size, config, out_dtype, bias, column_major", TRITON_CASES)
def test_xla_matches_reference(rng, m, nk, block_size, config, out_dtype, bias, column_major):
  del config
  problem = make_problem(rng, m, *nk, block_size, column_major=column_major, bias=bias)
  out = problem.call(out_dtype=out_dtype, implementation="xla")
  assert_close(out, problem, out_dtype)


EXACT_CONFIGS = [
    _cfg(16, 64, 64),                              # BK < gk
    _cfg(32, 32, 128, swap_ab=True),               # BK == gk
    _cfg(16, 128, 256, split_k=3),                 # BK > gk, BN > gn, split-K
]


@pytest.mark.parametrize("implementation, config", [("xla", None)] + [("triton", c) for c in EXACT_CONFIGS])
def test_exactness_check_is_bit_exact(rng, implementation, config):
  # docs/CONTRACT.md §2: integer codes in [-4, 4], power-of-two scales in [1/4, 4], K <= 2048 -> bit-exact float32 output.
  problem = make_problem(rng, 13, 200, 2000, (64, 128), column_major=True, bias=True, exact=True)
  kwargs = dict(interpret=True, config=config) if implementation == "triton" else {}
  out = np.asarray(problem.call(out_dtype=F32, implementation=implementation, **kwargs))
  expected = ref.cast_output(problem.reference(), np.float32)
  mismatches = np.argwhere(out != expected)
  assert mismatches.size == 0, f"{len(mismatches)} elements differ, first at {mismatches[0]}"


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_nan_scales_and_codes_propagate_only_where_the_reference_has_them(rng, implementation):
  m, n, k, block_size = 13, 200, 300, (64, 128)
  problem = make_problem(rng, m, n, k, block_size, column_major=True)
  a_q, a_s_arg, b_s = problem.a_q.copy(), problem.a_s_arg.copy(), problem.b_s.copy()
  a_s_arg[1, 4] = np.nan          # a_s[4, group 1]: row 4
  b_s[2, 2] = np.nan              # columns 128..191, last (partial) K group
  a_q[9, 299] = np.float32(np.nan).astype(ref.FP8)  # the last K column: row 9
  a_s = a_s_arg[:, :m].T
  problem = dataclasses.replace(problem, a_q=a_q, a_s_arg=a_s_arg, a_s=a_s, b_s=b_s)
  kwargs = dict(interpret=True, config=_cfg(16, 64, 64)) if implementation == "triton" else {}
  out = np.asarray(problem.call(out_dtype=F32, implementation=implementation, **kwargs))
  expected = problem.reference()
  nan_expected = np.isnan(expected)
  assert nan_expected[4].all() and nan_expected[9].all() and nan_expected[:, 128:192].all()
  np.testing.assert_array_equal(np.isnan(out), nan_expected)
  live = ~nan_expected
  assert ref.relative_error(out[live], expected[live]) <= 2e-4


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="pallas_kernels.gemm_mosaic not importable")
@pytest.mark.parametrize("column_major", [False, True])
def test_mosaic_dispatch_passes_the_column_major_scales(rng, column_major):
  # The dispatch glue only (transpose of row-major a_s, slicing of a non-TMA-aligned M'); the kernel has its own tests.
  problem = make_problem(rng, 8, 256, 256, (128, 128), column_major=column_major, bias=True)
  if column_major:  # an M' that is not a multiple of 4
    problem = dataclasses.replace(problem, a_s_arg=problem.a_s_arg[:, :9])
  out = problem.call(out_dtype=F32, implementation="mosaic", interpret=True)
  assert_close(out, problem, F32)


def _padded_with_poison(problem: Problem, rows: int) -> tuple[np.ndarray, np.ndarray]:
  """a_q and the call's a_s with padding rows appended up to `rows`: NaN codes and NaN scales, which may reach only
  the rows past out_rows (the Mosaic kernel computes them in its tile; nothing may store them)."""
  m, k = problem.a_q.shape
  a_q = np.concatenate([problem.a_q, np.full((rows - m, k), np.nan, np.float32).astype(ref.FP8)])
  if problem.column_major:
    pad = np.full((problem.a_s_arg.shape[0], rows - problem.a_s_arg.shape[1]), np.nan, np.float32)
    return a_q, np.concatenate([problem.a_s_arg, pad], axis=1)
  return a_q, np.concatenate([problem.a_s_arg, np.full((rows - m, problem.a_s_arg.shape[1]), np.nan, np.float32)])


@pytest.mark.parametrize("implementation, m, rows, column_major, config", [
    ("xla", 5, 16, False, None),
    ("xla", 3, 64, True, None),
    ("triton", 5, 64, True, _cfg(16, 64, 128)),
    ("triton", 13, 24, False, _cfg(16, 64, 128, split_k=2, swap_ab=True)),
    ("mosaic", 1, 64, True, None),     # the decode tile the quantizer pads to (M=1: no M % 4 needed of out_rows)
    ("mosaic", 13, 64, True, None),
    ("mosaic", 60, 136, False, None),  # padding rows in a second row tile
])
def test_out_rows_computes_the_live_rows_of_padded_buffers(rng, implementation, m, rows, column_major, config):
  n, k = (256, 384) if implementation == "mosaic" else (200, 300)
  if implementation == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic not importable")
  problem = make_problem(rng, m, n, k, (128, 128), column_major=column_major, bias=True)
  a_q, a_s = _padded_with_poison(problem, rows)
  out = w8a8_block_fp8_matmul(a_q, problem.b_q, a_s, problem.b_s, (128, 128), a_s_column_major=column_major,
                              bias=problem.bias, out_dtype=F32, implementation=implementation, config=config,
                              out_rows=m, interpret=True)
  assert_close(out, problem, F32)


@pytest.mark.parametrize("out_rows", [0, 6, -1, True, 2.0])
def test_out_rows_is_validated(out_rows):
  args = _valid_args()
  with pytest.raises(ValueError, match=rf"out_rows must be an int in \[1, M=5\].*got {out_rows!r}"):
    w8a8_block_fp8_matmul(args.pop("a_q"), args.pop("b_q"), args.pop("a_s"), args.pop("b_s"), args.pop("block_size"),
                          out_rows=out_rows, implementation="xla")


# ---- valid_rows: a traced live-row count ---------------------------------------------------------------------------

@pytest.mark.parametrize("implementation, m, rows, column_major, bias, block_size", [
    ("xla", 150, 150, False, True, (128, 128)),
    ("xla", 37, 64, True, False, (128, 128)),
    ("triton", 70, 70, True, True, (128, 128)),
    ("mosaic", 150, 160, True, True, (128, 128)),   # padding rows past out_rows, a bias (added to the live rows only)
    ("mosaic", 130, 130, False, False, (128, 128)),
    ("mosaic", 130, 130, True, True, (64, 64)),     # the kernel's blocks of 64
])
def test_valid_rows_zeroes_the_rows_past_it_with_one_compile(rng, implementation, m, rows, column_major, bias,
                                                             block_size):
  """One jitted call for every count: live rows match the reference, the rest are exactly 0 although their codes and
  scales are NaN (poison a skipped tile would leak; the bias must not reach them either)."""
  if implementation == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic not importable")
  n, k = (256, 384) if implementation == "mosaic" else (200, 300)
  config = {"triton": _cfg(16, 64, 128), "mosaic": helpers.mosaic_interpret_config()}.get(implementation)
  problem = make_problem(rng, m, n, k, block_size, column_major=column_major, bias=bias)
  expected = problem.reference()
  a_q, a_s = _padded_with_poison(problem, rows) if rows > m else (problem.a_q, problem.a_s_arg)
  a_q, a_s = np.array(a_q), np.array(a_s)
  traces = []

  @jax.jit
  def f(a_q, a_s, valid_rows):
    traces.append(1)
    return w8a8_block_fp8_matmul(a_q, problem.b_q, a_s, problem.b_s, block_size, a_s_column_major=column_major,
                                 bias=problem.bias, out_dtype=F32, implementation=implementation, config=config,
                                 out_rows=m if rows > m else None, valid_rows=valid_rows, interpret=True)

  # Two warm-up calls: the process's first lowering of a Pallas backend may register JAX config options, which
  # changes the tracing context and retraces the next call once.
  f(a_q, a_s, jnp.int32(m))
  f(a_q, a_s, jnp.int32(m))
  traces.clear()
  for valid in sorted({0, 1, int(rng.integers(2, m)), 64, m}):
    codes, scales = a_q.copy(), a_s.copy()
    codes[valid:m] = np.float32(np.nan).astype(ref.FP8)  # rows past the count are poison too
    if column_major:
      scales[:, valid:m] = np.nan
    else:
      scales[valid:m] = np.nan
    out = np.asarray(f(codes, scales, jnp.int32(valid)))
    assert out.shape == (m, n)
    assert (out[valid:] == 0).all(), f"valid_rows={valid}: a row past it is not 0"
    if valid:
      assert not np.isnan(out[:valid]).any(), f"valid_rows={valid}: NaN in a live row"
      err = ref.relative_error(out[:valid], expected[:valid])
      assert err <= TOLERANCE[jnp.dtype(F32)], (valid, err)
  assert not traces, "a new count recompiled"


@pytest.mark.parametrize("valid", [-5, 1000])
def test_traced_valid_rows_outside_the_rows_are_clipped(rng, valid):
  problem = make_problem(rng, 20, 200, 300, (128, 128))
  f = jax.jit(lambda v: problem.call(out_dtype=F32, implementation="xla", valid_rows=v))
  out = np.asarray(f(jnp.int32(valid)))
  expected = np.asarray(problem.call(out_dtype=F32, implementation="xla"))
  np.testing.assert_array_equal(out, expected if valid > 0 else np.zeros_like(expected))


@pytest.mark.parametrize("valid_rows, error, match", [
    (-1, ValueError, r"valid_rows must be in \[0, 5\].*got -1"),
    (6, ValueError, r"valid_rows must be in \[0, 5\].*got 6"),
    (True, TypeError, "valid_rows must be an int or an integer scalar array, got True"),
    (2.0, TypeError, "valid_rows must be an int or an integer scalar array, got float"),
    (np.float32(2), TypeError, "of dtype float32"),
    (np.array([2], np.int32), ValueError, r"valid_rows must be a scalar \(shape \(\)\), got shape \(1,\)"),
])
def test_valid_rows_is_validated(valid_rows, error, match):
  args = _valid_args()
  with pytest.raises(error, match=match):
    w8a8_block_fp8_matmul(args.pop("a_q"), args.pop("b_q"), args.pop("a_s"), args.pop("b_s"), args.pop("block_size"),
                          valid_rows=valid_rows, implementation="xla")


def test_valid_rows_under_vmap_counts_each_entry_s_own_rows(rng):
  """docs/CONTRACT.md §5: the vmapped call is the call on the folded rows (B*M of them), bit for bit, with each entry's
  rows past its count zeroed; an entry against the call on its own M rows (another plan where the row count picks
  it: XLA's GPU dot does) is within §2's tolerance."""
  for _ in range(3):
    batch, m = int(rng.integers(2, 5)), int(rng.integers(1, 40))
    problem = make_problem(rng, m, 200, 300, (128, 128), bias=True)
    a_q = np.stack([problem.a_q[rng.permutation(m)] for _ in range(batch)])
    a_s = np.stack([problem.a_s * np.float32(2.0 ** rng.integers(-2, 3)) for _ in range(batch)])
    counts = rng.integers(0, m + 1, batch).astype(np.int32)
    call = functools.partial(w8a8_block_fp8_matmul, b_q=problem.b_q, b_s=problem.b_s, block_size=(128, 128),
                             bias=problem.bias, out_dtype=F32, implementation="xla")
    out = np.asarray(jax.vmap(lambda q, s, v: call(q, a_s=s, valid_rows=v))(a_q, a_s, jnp.asarray(counts)))
    folded = np.asarray(call(a_q.reshape(batch * m, -1), a_s=a_s.reshape(batch * m, -1))).reshape(batch, m, -1)
    live = np.arange(m)[None, :] < counts[:, None]
    np.testing.assert_array_equal(out, np.where(live[..., None], folded, 0.0))
    for b, count in enumerate(counts):
      alone = np.asarray(call(a_q[b], a_s=a_s[b]))
      if count:
        assert ref.relative_error(out[b, :count], alone[:count]) <= TOLERANCE[jnp.dtype(F32)]


def test_live_row_schedules_follow_the_exact_counts_schedule():
  """A traced count runs the schedule its whole 64-row tiles would get as a call of their own; each distinct
  schedule is compiled once."""
  from jaxfp8.gemm import mosaic as mosaic_backend
  if not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic not importable")
  for rows, n, k in ((4096, 24576, 7168), (1024, 24576, 7168), (256, 7168, 18432), (300, 10240, 5120),
                     (40, 1536, 7168), (8192, 7168, 2048)):
    schedules = mosaic_backend.live_row_schedules(rows, n, k, jnp.bfloat16, 132)
    assert len(set(schedules.configs)) == len(schedules.configs), "each schedule once"
    assert len(schedules.table) == -(-rows // 64)
    for count in range(1, rows + 1, 7):
      chosen = schedules.configs[schedules.table[(count - 1) // 64]]
      exact = min(-(-count // 64) * 64, rows)
      assert chosen == mosaic_backend.default_config(exact, n, k, jnp.bfloat16, num_sms=132), (rows, count)
    runs = schedules.ranges()
    assert runs[0][0] == 1 and runs[-1][1] >= rows and all(a[2] != b[2] for a, b in zip(runs, runs[1:]))


def test_plan_says_whether_dead_row_tiles_are_skipped():
  a_q, b_q = jax.ShapeDtypeStruct((512, 1024), ref.FP8), jax.ShapeDtypeStruct((2048, 1024), ref.FP8)
  hopper = helpers.fake_device((9, 0))
  if not helpers.MOSAIC_GEMM_IMPORTABLE:
    pytest.skip("pallas_kernels.gemm_mosaic not importable")
  mosaic_plan = gemm.plan(gemm.problem(512, 2048, 1024, (128, 128), masked=True), device=hopper, interpret=False)
  assert mosaic_plan.implementation == "mosaic" and mosaic_plan.skips_dead_rows
  assert "row tiles past it are skipped" in str(mosaic_plan)
  assert "the row tiles past valid_rows are skipped" in mosaic_plan.config_reason
  xla_plan = gemm.plan_for(a_q, b_q, (128, 128), valid_rows=True, implementation="xla")
  assert not xla_plan.skips_dead_rows and "every row is computed" in str(xla_plan)
  assert "valid_rows" not in str(gemm.plan_for(a_q, b_q, (128, 128), implementation="xla"))


def test_usable_inside_jit(rng):
  problem = make_problem(rng, 5, 200, 300, (128, 128), column_major=True, bias=True)
  f = jax.jit(functools.partial(w8a8_block_fp8_matmul, block_size=(128, 128), a_s_column_major=True,
                                out_dtype=F32, implementation="triton", config=_cfg(16, 64, 128), interpret=True))
  assert_close(f(problem.a_q, problem.b_q, problem.a_s_arg, problem.b_s, bias=problem.bias), problem, F32)
  g = jax.jit(w8a8_block_fp8_matmul, static_argnames=("block_size", "a_s_column_major", "out_dtype", "implementation"))
  out = g(problem.a_q, problem.b_q, problem.a_s_arg, problem.b_s, (128, 128), a_s_column_major=True, out_dtype=F32,
          bias=problem.bias, implementation="xla")
  assert_close(out, problem, F32)


def _plan(m, n, k, block_size, capability, **kwargs):
  return gemm.plan(gemm.problem(m, n, k, block_size), device=helpers.fake_device(capability), **kwargs)


def test_default_implementation_on_cpu_is_xla():
  plan = _plan(8, 256, 256, (128, 128), None)
  assert plan.implementation == "xla" and plan.config is None and "no NVIDIA GPU" in plan.reason
  assert _plan(8, 256, 256, (128, 128), (9, 0), interpret=True).implementation == "xla"


@pytest.mark.parametrize("capability, m, n, k, block_size, expected", [
    ((9, 0), 4, 256, 256, (128, 128), "triton"),     # decode (M <= TRITON_DECODE_MAX_M): the tuned Triton kernel
    ((9, 0), 8, 256, 256, (128, 128), "mosaic"),
    ((9, 0), 16, 256, 256, (128, 128), "mosaic"),
    ((9, 0), 20, 256, 256, (128, 128), "mosaic"),
    ((9, 0), 4096, 256, 256, (128, 128), "mosaic"),
    ((9, 0), 23, 256, 256, (128, 128), "mosaic"),    # any M (the launcher pads a_q's TMA view, the scales' columns)
    ((9, 0), 20, 200, 256, (128, 128), "triton"),    # N tail on 2 tiles: Triton measured faster there
    ((9, 0), 4096, 200, 256, (128, 128), "mosaic"),  # N tail on 64 tiles
    ((9, 0), 20, 196, 256, (128, 128), "triton"),    # N % 8 != 0: no Mosaic kernel
    ((9, 0), 20, 256, 256, (64, 64), "mosaic"),
    ((9, 0), 20, 256, 256, (64, 128), "triton"),      # blocks not yet timed against Triton: not by default
    ((8, 9), 8, 256, 256, (128, 128), "triton"),
    ((9, 0), 8, 256, 256, (128, 16), "xla"),         # gk = 16: no Triton dot is narrow enough
    ((8, 0), 8, 256, 256, (128, 128), "xla"),        # no FP8 conversions
])
def test_default_implementation_choice(capability, m, n, k, block_size, expected):
  if expected == "mosaic" and not helpers.MOSAIC_GEMM_IMPORTABLE:
    expected = "triton"
  plan = _plan(m, n, k, block_size, capability, interpret=False)
  assert plan.implementation == expected, plan
  # The plan names the kernel config that runs (None only for XLA) and why.
  assert (plan.config is None) == (expected == "xla") and plan.config_reason


def test_zero_sized_dimensions(rng):
  for m, n, k in ((0, 64, 256), (4, 0, 256)):
    p = make_problem(rng, max(m, 1), max(n, 1), k, (128, 128))
    a_q, b_q = p.a_q[:m], p.b_q[:n]
    out = w8a8_block_fp8_matmul(a_q, b_q, p.a_s[:m], p.b_s[:ref.ceil_div(n, 128)], (128, 128), out_dtype=F32)
    assert out.shape == (m, n)
  bias = rng.standard_normal(64).astype(np.float32)
  out = w8a8_block_fp8_matmul(np.zeros((3, 0), ref.FP8), np.zeros((64, 0), ref.FP8), np.zeros((3, 0), np.float32),
                              np.zeros((1, 0), np.float32), (128, 128), bias=bias, out_dtype=F32)
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(bias, (3, 64)))


@pytest.mark.parametrize("m, n", [(0, 64), (4, 0)])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 64)])
def test_zero_sized_output_with_long_k_picks_a_config(rng, m, n, block_size):
  # K >= 8 K steps is where the heuristic considers split-K; with no output tiles it divided by zero (found by the GPU
  # fuzz profile at M=0, K in 897..1100, before any kernel ran).
  k = 1024
  config = gemm.triton.heuristic_config(m, n, k, block_size)
  assert config is not None and config.split_k == 1, config
  p = make_problem(rng, max(m, 1), max(n, 1), k, block_size, bias=True)
  out = w8a8_block_fp8_matmul(p.a_q[:m], p.b_q[:n], p.a_s[:m], p.b_s[:ref.ceil_div(n, block_size[0])], block_size,
                              bias=p.bias[:n], out_dtype=F32, implementation="triton", interpret=True)
  assert out.shape == (m, n) and out.dtype == F32


# ---- validation ----------------------------------------------------------------------------------------------------

def _valid_args(m=5, n=200, k=300, block_size=(128, 128)):
  groups, n_blocks = ref.ceil_div(k, block_size[1]), ref.ceil_div(n, block_size[0])
  return dict(a_q=np.ones((m, k), ref.FP8), b_q=np.ones((n, k), ref.FP8), a_s=np.ones((m, groups), np.float32),
              b_s=np.ones((n_blocks, groups), np.float32), block_size=block_size)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_k=96), "block_k=96 is not a power"), (dict(block_m=24), "block_m=24"),
    (dict(block_m=8), "need both >= 16"), (dict(num_warps=3), "num_warps=3"), (dict(split_k=0), "split_k=0"),
    (dict(group_m=0), "group_m=0"), (dict(swap_ab="yes"), "swap_ab"), (dict(block_m=2.0), "block_m=2.0"),
    (dict(num_stages=8, block_m=256, block_n=256), "shared memory"),
    (dict(block_m=128, block_n=256, block_k=256, num_stages=3), "294912 bytes of pipelined FP8 tiles"),
])
def test_a_triton_config_no_kernel_can_build_is_refused_when_made(kwargs, match):
  """TritonGemmConfig checks itself on construction (and on dataclasses.replace): the block-size-free rules; what
  depends on the scale block stays in config_problems (test below)."""
  with pytest.raises(ValueError, match=match):
    TritonGemmConfig(**{**dict(block_m=16, block_n=64, block_k=128), **kwargs})
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(TritonGemmConfig(block_m=16, block_n=64, block_k=128), **kwargs)


@pytest.mark.parametrize("change, error, match", [
    (dict(a_q=np.ones((5, 300), np.float32)), TypeError, "a_q must have dtype float8_e4m3fn"),
    (dict(b_q=np.ones((200, 300), jnp.bfloat16)), TypeError, "b_q must have dtype"),
    (dict(a_q=[[1.0]]), TypeError, "a_q must be an array"),
    (dict(a_q=np.ones((300,), ref.FP8)), ValueError, "a_q must be 2-D"),
    (dict(b_q=np.ones((2, 200, 300), ref.FP8)), ValueError, "b_q must be 2-D"),
    (dict(b_q=np.ones((200, 301), ref.FP8)), ValueError, "must share K"),
    (dict(a_s=np.ones((5, 3), jnp.bfloat16)), TypeError, "a_s must have dtype float32"),
    (dict(a_s=np.ones((5, 2), np.float32)), ValueError, r"a_s must have shape \(M, ceil\(K/gk\)\) = \(5, 3\)"),
    (dict(a_s=np.ones((3, 5), np.float32)), ValueError, "a_s_column_major=True"),
    (dict(a_s=np.ones((3, 4), np.float32), a_s_column_major=True), ValueError, r"M'\) = \(3, >= 5\)"),
    (dict(a_s=np.ones((2, 8), np.float32), a_s_column_major=True), ValueError, "column-major a_s"),
    (dict(b_s=np.ones((3, 3), np.float32)), ValueError, r"b_s must have shape \(ceil\(N/gn\), ceil\(K/gk\)\) = \(2, 3\)"),
    (dict(b_s=np.ones((2, 2), np.float32)), ValueError, r"b_s must have shape"),
    (dict(b_s=np.ones((2, 3), np.float16)), TypeError, "b_s must have dtype float32"),
    (dict(block_size=(128,)), ValueError, "block_size must be a pair"),
    (dict(block_size=(0, 128)), ValueError, "block_size must be positive, got gn=0"),
    (dict(block_size=(128, -1)), ValueError, "gk=-1"),
    (dict(block_size=(128.0, 128)), TypeError, "gn=128.0"),
    (dict(block_size=(True, 128)), TypeError, "gn=True"),
    (dict(block_size="ab"), TypeError, "block_size must be a pair"),
    (dict(out_dtype=jnp.int8), ValueError, "out_dtype must be bfloat16, float16 or float32, got int8"),
    (dict(out_dtype="not a dtype"), TypeError, "out_dtype must be a floating dtype"),
    (dict(bias=np.ones((201,), np.float32)), ValueError, r"bias must have shape \(N,\) = \(200,\)"),
    (dict(bias=np.ones((1, 200), np.float32)), ValueError, "bias must have shape"),
    (dict(bias=np.ones((200,), np.int32)), TypeError, "bias must have dtype"),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
    (dict(implementation="xla", config=_cfg(16, 64, 128)), ValueError, "config applies to"),
    (dict(implementation="triton", config=dict(block_m=16)), TypeError, "must be a TritonGemmConfig"),
    (dict(implementation="triton", config=_cfg(16, 64, 16), interpret=True), ValueError, "8-bit MMAs need"),
    (dict(implementation="mosaic", interpret=True), ValueError, "K=300 must be a positive multiple of 128"),
    (dict(b_q=np.ones((196, 300), ref.FP8), implementation="mosaic", interpret=True), ValueError,
     "N=196 must be a positive multiple of 8"),
])
def test_validation_errors(change, error, match):
  args = {**_valid_args(), **change}
  with pytest.raises(error, match=match):
    w8a8_block_fp8_matmul(args.pop("a_q"), args.pop("b_q"), args.pop("a_s"), args.pop("b_s"), args.pop("block_size"),
                          **args)


@pytest.mark.parametrize("block_size, config, match", [
    ((128, 96), _cfg(16, 64, 64), "neither a divisor nor a multiple of the scale group gk=96"),
    ((128, 96), _cfg(16, 64, 128), "neither a divisor nor a multiple"),
    ((128, 48), _cfg(16, 64, 16), "8-bit MMAs need at least 32"),
    ((128, 16), _cfg(16, 64, 128), "8-bit MMAs need at least 32"),
    ((128, 256), _cfg(16, 64, 256), "promoted into the f32 accumulator at least every 128"),
])
def test_configs_that_cannot_run_are_rejected(block_size, config, match):
  args = _valid_args(block_size=block_size)
  with pytest.raises(ValueError, match=match):
    w8a8_block_fp8_matmul(args["a_q"], args["b_q"], args["a_s"], args["b_s"], block_size, implementation="triton",
                          config=config, interpret=True)


def test_triton_without_a_config_for_the_block_size_is_rejected():
  args = _valid_args(block_size=(128, 48))
  with pytest.raises(ValueError, match="no Triton config can serve block_size"):
    w8a8_block_fp8_matmul(args["a_q"], args["b_q"], args["a_s"], args["b_s"], (128, 48), implementation="triton",
                          interpret=True)


@pytest.mark.skipif(_platform.gpu_compute_capability() is not None, reason="CPU-only expectation")
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_gpu_implementations_without_interpret_on_cpu_are_rejected(implementation):
  args = _valid_args(m=8, n=256, k=256)
  with pytest.raises(ValueError, match=f"implementation='{implementation}' needs"):
    w8a8_block_fp8_matmul(args["a_q"], args["b_q"], args["a_s"], args["b_s"], (128, 128),
                          implementation=implementation, interpret=False)


@pytest.mark.skipif(not helpers.MOSAIC_GEMM_IMPORTABLE, reason="pallas_kernels.gemm_mosaic not importable")
@pytest.mark.parametrize("m, column_major", [(7, False), (13, True), (23, False)])
def test_mosaic_takes_any_m(rng, m, column_major):
  """Rows that are no multiple of 4 or 8: the launcher pads a_q's TMA view and the scales' columns itself."""
  problem = make_problem(rng, m, 256, 256, (128, 128), column_major=column_major, bias=True)
  assert_close(problem.call(out_dtype=F32, implementation="mosaic", interpret=True), problem, F32)


# ---- configs -------------------------------------------------------------------------------------------------------

def _all_weight_shapes():
  if SHAPES is None:
    return [(1536, 7168), (200, 300)]
  return sorted({tuple(v) for key, group in SHAPES.items() if isinstance(group, dict) for v in group.values()})


def test_heuristic_serves_every_model_shape_and_block_size():
  ms = (SHAPES["m_decode"] + SHAPES["m_prefill"]) if SHAPES else [1, 64, 4096]
  blocks = [tuple(b) for b in SHAPES["block_sizes"]] if SHAPES else [(128, 128)]
  for n, k in _all_weight_shapes():
    for block_size in blocks + [(64, 128)]:
      for m in ms + [3, 13, 257]:
        config = gemm.triton.heuristic_config(m, n, k, block_size)
        assert config is not None, (m, n, k, block_size)
        assert not gemm_triton.config_problems(config, block_size), (m, n, k, block_size, config)
  assert gemm.triton.heuristic_config(8, 256, 256, (128, 16)) is None


def test_table_lookup_by_device_and_m_bucket():
  tuned = _cfg(32, 64, 128, split_k=4, swap_ab=True)
  table = {"device": "NVIDIA H200", "tuned": True, "entries": {
      gemm.triton.table_key(576, 7168, (128, 128), 32): {"config": tuned.to_dict(), "us": 3.0},
      gemm.triton.table_key(576, 7168, (128, 128), 64): {"config": {**tuned.to_dict(), "block_k": 96}, "us": 1.0},
  }}
  get = functools.partial(gemm.triton.get_config, n=576, k=7168, block_size=(128, 128), table=table)
  assert get(17, device_kind="NVIDIA H200") == tuned            # bucket 32
  assert get(2, device_kind="NVIDIA H200") == tuned             # bucket 2 untuned: the nearest tuned bucket above
  assert get(17, device_kind="NVIDIA H100 80GB HBM3") == gemm.triton.heuristic_config(17, 576, 7168, (128, 128))
  assert get(64, device_kind="NVIDIA H200") == gemm.triton.heuristic_config(64, 576, 7168, (128, 128))  # invalid entry
  assert get(9000, device_kind="NVIDIA H200") == gemm.triton.heuristic_config(9000, 576, 7168, (128, 128))
  assert gemm.triton.m_bucket(1) == 1 and gemm.triton.m_bucket(65) == 128 and gemm.triton.m_bucket(10**6) == 8192


def test_shipped_table_loads_and_holds_valid_configs():
  table = gemm.triton.load_table()
  assert table["device"] == "NVIDIA H200" and isinstance(table["entries"], dict)
  for key, entry in table["entries"].items():
    n, k, gn, gk, _ = (int(v) for v in key.split(","))
    assert not gemm_triton.config_problems(TritonGemmConfig.from_dict(entry["config"]), (gn, gk)), key


def test_config_dict_round_trip():
  config = _cfg(32, 64, 256, split_k=4, swap_ab=True)
  assert TritonGemmConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# ---- lowering to Triton IR on CPU (as for an H200) -------------------------------------------------------------------

def _lowering_cases():
  cases = []
  for n, k in [(1536, 7168), (576, 7168), (24576, 1536), (7748, 3884), (200, 300), (5120, 25600)]:
    for m in (1, 64, 257, 4096):
      cases.append((m, n, k, (128, 128), None))
  cases += [(13, 200, 300, (64, 128), _cfg(64, 256, 64, swap_ab=True)), (13, 200, 300, (32, 32), _cfg(16, 128, 128)),
            (13, 200, 300, (100, 64), _cfg(32, 64, 256, split_k=2))]
  return cases


@pytest.mark.parametrize("m, n, k, block_size, config", _lowering_cases())
def test_triton_kernel_lowers_for_h200(m, n, k, block_size, config):
  from jax.experimental.pallas import triton as plt
  groups = ref.ceil_div(k, block_size[1])
  args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((groups, ref.round_up(m, 4)), jnp.float32),
          jax.ShapeDtypeStruct((ref.ceil_div(n, block_size[0]), groups), jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.float32))
  f = functools.partial(w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True, implementation="triton",
                        config=config)
  with _platform.abstract_h200():
    config = gemm.plan_for(args[0], args[1], block_size, a_s_column_major=True, has_bias=True,
                           implementation="triton", config=config).config
    exported = jax.export.export(
        jax.jit(lambda a, b, sa, sb, bias: f(a, b, sa, sb, bias=bias)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)])(*args)
  # One kernel, the codes reaching it as they are (no pad, transpose or cast of a_q or b_q outside it); its output
  # is the result, but with split-K, whose float32 slices are summed (and cast) after it.
  text = exported.mlir_module()
  assert helpers.kernel_calls(text) == [plt.CUSTOM_CALL_TARGET_NAME], helpers.kernel_calls(text)
  ops = helpers.lowered_ops(text)
  free = {"custom_call", "broadcast_in_dim", "reshape"}
  assert ops["f8E4M3FN"] <= free, ops
  if config.split_k > 1:
    assert re.search(rf"-> tensor<\d+x{m}x{n}xf32>", text) and "reduce" in ops["f32"], (config, ops)
  else:
    assert ops.get("bf16", set()) <= free and "reduce" not in ops.get("f32", set()), (config, ops)


def _shipped_entries():
  return [tuple(int(v) for v in key.split(",")) for key in gemm.triton.load_table()["entries"]]


@pytest.mark.parametrize("n, k, gn, gk, m", _shipped_entries())
def test_every_shipped_triton_config_lowers_for_h200(n, k, gn, gk, m):
  """Each entry of the shipped table, at its own shape and bucket M, as dispatch would pick it on an H200."""
  entry = gemm.triton.load_table()["entries"][gemm.triton.table_key(n, k, (gn, gk), m)]
  config = TritonGemmConfig.from_dict(entry["config"])
  with _platform.abstract_h200():
    plan = gemm.plan(gemm.problem(m, n, k, (gn, gk)), implementation="triton")
    assert plan.config == config and "tuned" in plan.config_reason
  test_triton_kernel_lowers_for_h200(m, n, k, (gn, gk), config)


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_triton_dots_chain_fp8_accumulation_unless_f32_out(monkeypatch, capsys, out_dtype):
  """bf16 output: every tt.dot of the kernel carries maxNumImpreciseAcc above its K (128); without it Triton adds each
  32-wide FP8 wgmma into f32 separately and the GEMM runs about 2x slower on an H200. f32 output keeps that precise mode
  (no attribute): the tensor cores' own accumulation costs about 1.3e-4 of the contract's 2e-4 there."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt
  monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
  m, n, k = 64, 256, 512
  args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((k // 128, m), jnp.float32), jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32))
  for config in (_cfg(64, 128, 128), _cfg(16, 64, 256, swap_ab=True)):
    f = functools.partial(w8a8_block_fp8_matmul, block_size=(128, 128), a_s_column_major=True,
                          implementation="triton", config=config, out_dtype=out_dtype)
    with _platform.abstract_h200():
      jax.export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)])(*args)
    dots = [line for line in capsys.readouterr().out.splitlines() if "tt.dot " in line]
    assert len(dots) == config.block_k // 128, (config, dots)
    if out_dtype == F32:
      assert not any("maxNumImpreciseAcc" in line for line in dots), dots
    else:
      assert all("maxNumImpreciseAcc = 1073741824" in line for line in dots), dots


def test_triton_promotion_is_one_fma_per_element(monkeypatch, capsys):
  """Each dot's `acc + part * scale` is the inline-asm fused multiply-add (one instruction per element on the GPU,
  where Triton would emit an FMUL and an FADD), for both weight-scale layouts."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt
  monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
  m, n, k = 64, 256, 512
  for block_size, config in (((128, 128), _cfg(64, 128, 256)), ((64, 128), _cfg(16, 128, 128, swap_ab=True))):
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((k // 128, m), jnp.float32),
            jax.ShapeDtypeStruct((n // block_size[0], k // 128), jnp.float32))
    f = functools.partial(w8a8_block_fp8_matmul, block_size=block_size, a_s_column_major=True,
                          implementation="triton", config=config)
    with _platform.abstract_h200():
      jax.export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(plt.CUSTOM_CALL_TARGET_NAME)])(*args)
    fmas = [line for line in capsys.readouterr().out.splitlines()
            if "tt.elementwise_inline_asm" in line and "fma.rn.f32" in line]
    assert len(fmas) == config.block_k // min(config.block_k, block_size[1]), (config, fmas)


# ---- GPU: full shapes.json sizes -----------------------------------------------------------------------------------

GPU_SHAPES = [("deepseek_v3", "q_a_proj"), ("deepseek_v3", "kv_a_proj_with_mqa"), ("deepseek_v3", "q_b_proj"),
              ("deepseek_v3", "o_proj"), ("qwen3_32b", "qkv_proj"), ("unaligned_for_fallback_tests", "n_and_k_tail")]


@functools.cache
def _gpu_problem(model: str, name: str) -> tuple[Problem, np.ndarray]:
  """257 rows of one full-size problem and its reference (generated once: the weights are large)."""
  n, k = SHAPES[model][name]
  problem = make_problem(conftest.seeded_rng(f"{model}.{name}"), 257, n, k, (128, 128), bias=True)
  return problem, problem.reference()


def _rows(problem: Problem, m: int, column_major: bool) -> Problem:
  """The first m rows, with a_s as given or as the quantizer's column-major (G, round_up(m, 4)) array."""
  a_s = problem.a_s[:m]
  if column_major:
    a_s_arg = np.ones((a_s.shape[1], ref.round_up(m, 4)), np.float32)
    a_s_arg[:, :m] = a_s.T
  else:
    a_s_arg = a_s
  return dataclasses.replace(problem, a_q=problem.a_q[:m], a_s=a_s, a_s_arg=a_s_arg, column_major=column_major)


@pytest.mark.gpu
@pytest.mark.parametrize("model, name", GPU_SHAPES)
@pytest.mark.parametrize("implementation", ["triton", None])
def test_gpu_full_size_matches_reference(model, name, implementation):
  for m, out_dtype, column_major in ((1, BF16, True), (13, F32, False), (64, F32, True), (257, BF16, False)):
    problem, expected = _gpu_problem(model, name)
    problem = _rows(problem, m, column_major)
    out = np.asarray(problem.call(out_dtype=out_dtype, implementation=implementation))
    assert out.shape == (m, problem.b_q.shape[0])
    assert not np.isnan(out.astype(np.float32)).any()
    err = ref.relative_error(out, expected[:m])
    assert err <= TOLERANCE[jnp.dtype(out_dtype)], (model, name, m, out_dtype, err)


@pytest.mark.gpu
@pytest.mark.parametrize("model, name", GPU_SHAPES)
@pytest.mark.parametrize("implementation", ["triton", None])
def test_gpu_out_rows_of_padded_decode_buffers(model, name, implementation):
  # The quantizer's decode buffers (64 rows, the padding poisoned here) with out_rows = M, as jaxfp8.linear calls it.
  problem, expected = _gpu_problem(model, name)
  for m in (1, 4, 16, 40):
    live = _rows(problem, m, True)
    a_q, a_s = _padded_with_poison(live, 64)
    out = np.asarray(w8a8_block_fp8_matmul(a_q, live.b_q, a_s, live.b_s, (128, 128), a_s_column_major=True,
                                           bias=live.bias, out_dtype=BF16, implementation=implementation, out_rows=m))
    assert out.shape == (m, live.b_q.shape[0])
    assert not np.isnan(out.astype(np.float32)).any()
    err = ref.relative_error(out, expected[:m])
    assert err <= TOLERANCE[jnp.dtype(BF16)], (model, name, m, err)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("m", [13, 130, 4096])
def test_gpu_valid_rows_on_the_dense_kernel(m, rng):
  """valid_rows on the Mosaic GEMM (the dense kernel's live-row count): the default config, a persistent grid of two
  CTAs, the two-warpgroup prefill tile and CTA pairs along M and N, every count kind (int32 counts outside [0, M]
  too, which only the kernel clips), a bias in bf16 and f32."""
  if not _platform.is_hopper():
    pytest.skip("the Mosaic kernel needs a Hopper GPU")
  from pallas_kernels.gemm_mosaic import Dim, MosaicGemmConfig
  problem = make_problem(rng, m, 1536, 7168, (128, 128), column_major=True, bias=True)
  expected = problem.reference()
  two_ctas = MosaicGemmConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, num_compute_wgs=1, grid_size=2)
  prefill = MosaicGemmConfig(tile_m=128, tile_n=256, num_compute_wgs=2, wg_split=Dim.N)
  pairs_m = MosaicGemmConfig(tile_m=128, tile_n=128, num_compute_wgs=2, cluster_dim=Dim.M)
  pairs_n = MosaicGemmConfig(tile_m=192, tile_n=128, num_compute_wgs=3, cluster_dim=Dim.N, grid_tile_width=16)
  for config, out_dtype in ((None, F32), (two_ctas, F32), (prefill, BF16), (pairs_m, F32), (pairs_n, BF16)):
    f = jax.jit(lambda v: problem.call(out_dtype=out_dtype, implementation="mosaic", config=config, valid_rows=v))
    for count in sorted({-3, 0, 1, 5, m // 2 + 3, m - 1, m, 2**31 - 1}):
      valid = min(max(count, 0), m)
      out = np.asarray(f(jnp.int32(count))).astype(np.float32)
      assert (out[valid:] == 0).all(), (config, valid)
      if valid:
        err = ref.relative_error(out[:valid], expected[:valid])
        assert err <= TOLERANCE[jnp.dtype(out_dtype)], (config, valid, err)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "xla", None])
def test_gpu_exactness_check_is_bit_exact(implementation, rng):
  problem = make_problem(rng, 64, 1088, 2048, (128, 128), column_major=True, bias=True, exact=True)
  out = np.asarray(problem.call(out_dtype=F32, implementation=implementation))
  np.testing.assert_array_equal(out, ref.cast_output(problem.reference(), np.float32))


@pytest.mark.gpu
def test_gpu_large_m_prefill_matches_reference(rng):
  problem = make_problem(rng, 4096, 1536, 7168, (128, 128), column_major=True, bias=True)
  out = problem.call(out_dtype=F32, implementation="triton")
  assert_close(out, problem, F32)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [_cfg(128, 128, 128, group_m=8, num_warps=8, num_stages=3),
                                    _cfg(64, 128, 64, num_warps=4, num_stages=4),
                                    _cfg(128, 256, 256, num_warps=8, num_stages=2),
                                    _cfg(16, 64, 128, split_k=4, swap_ab=True, num_stages=4),
                                    _cfg(64, 64, 128, split_k=2, swap_ab=True)])
def test_gpu_triton_configs_compile_and_match(config, rng):
  problem = make_problem(rng, 130, 7748, 3884, (128, 128), column_major=True, bias=True)
  out = problem.call(out_dtype=F32, implementation="triton", config=config)
  assert_close(out, problem, F32)


def test_dequant_bf16_baseline_is_a_baseline(rng):
  # The baseline is what users do today; it is close (bf16 tolerance) but not an implementation.
  problem = make_problem(rng, 13, 200, 300, (128, 128))
  out = baselines.dequant_bf16_matmul_baseline(problem.a_q, problem.b_q, problem.a_s, problem.b_s,
                                              block_size=(128, 128), out_dtype=F32)
  assert ref.relative_error(out, problem.reference()) <= 2e-2


# ---- benchmark and tuner plumbing on CPU (a fake timer; the real numbers come from the GPU) -------------------------

def _fake_median_kernel_us(fn, arg_sets, *, iterations=30, sync=jax.block_until_ready):
  del iterations
  sync(fn(*arg_sets[0]))
  return 1.0


def test_per_tensor_baseline_is_the_scaled_product(rng):
  # The bench's ceiling computes a different (coarser) quantization, so the bench never checks it: this does.
  a = rng.standard_normal((5, 256)).astype(np.float32)
  b = rng.standard_normal((24, 256)).astype(np.float32)
  # Clipped: a draw beyond 4.64 sigma would cast to NaN (e4m3fn has no infinity), which no check below can pass.
  a_q, b_q = (jnp.asarray(np.clip(v * 100, -448, 448), jnp.float8_e4m3fn) for v in (a, b))
  a_scale, b_scale = np.float32(0.01), np.float32(0.03)
  out = baselines.per_tensor_fp8_matmul_baseline(a_q, b_q, jnp.float32(a_scale), jnp.float32(b_scale))
  exact = np.asarray(a_q, np.float64) @ np.asarray(b_q, np.float64).T * (float(a_scale) * float(b_scale))
  assert out.dtype == jnp.bfloat16 and out.shape == (5, 24)
  # Three bf16 roundings (the product, the scale product, the scaled product), each off by at most the unit roundoff
  # u = 2**-8 relative (30 seeds reached 2.15u).
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= 3 * 2.0 ** -8 * np.abs(exact))


def test_bench_gemm_plumbing(monkeypatch, tmp_path):
  from jaxfp8.tools import bench_gemm, timing
  monkeypatch.setattr(timing, "median_kernel_us", _fake_median_kernel_us)
  out = tmp_path / "gemm.json"
  result = bench_gemm.run([("small", 200, 384)], [3, 8], ["xla", "dequant_bf16", "fp8_per_tensor", "torch_scaled_mm"],
                          str(out), iterations=2, log=lambda *_: None)
  rows = {(r["m"], r["contender"]): r for r in result["rows"]}
  for m in (3, 8):
    assert rows[(m, "xla")]["within_bf16_bound"] and rows[(m, "xla")]["rel_err"] <= 2e-3
    assert rows[(m, "dequant_bf16")]["rel_err"] <= 2e-2
    assert "rel_err" not in rows[(m, "fp8_per_tensor")]
    assert rows[(m, "xla")]["x_weight_floor"] > 0
  assert json.loads(out.read_text())["rows"] and (tmp_path / "gemm.md").read_text().count("| small |") == 2


def test_tune_plumbing_writes_a_table_get_config_uses(monkeypatch, tmp_path):
  from jaxfp8.tools import timing, tune
  monkeypatch.setattr(timing, "median_kernel_us", _fake_median_kernel_us)
  out = tmp_path / "table.json"
  table = tune.tune([(200, 384)], [8], (128, 128), str(out), max_configs=2, iterations=2, interpret=True,
                    log=lambda *_: None)
  assert json.loads(out.read_text()) == json.loads(json.dumps(table))
  [(key, entry)] = table["entries"].items()
  assert key == gemm.triton.table_key(200, 384, (128, 128), 8) and entry["candidates"] == 2
  config = gemm.triton.get_config(5, 200, 384, (128, 128), device_kind=table["device"], table=table)
  assert config == TritonGemmConfig.from_dict(entry["config"])


def test_tune_times_the_entry_it_would_replace(monkeypatch, tmp_path):
  from jaxfp8.tools import timing, tune
  monkeypatch.setattr(timing, "median_kernel_us", _fake_median_kernel_us)
  key = gemm.triton.table_key(200, 384, (128, 128), 8)
  previous = TritonGemmConfig(16, 32, 64, 1, 4, 2, 1, False)
  assert previous not in tune.candidate_configs(8, 200, 384, (128, 128), max_configs=2)
  out = tmp_path / "table.json"
  out.write_text(json.dumps({"device": "cpu", "tuned": True, "entries": {key: {"config": previous.to_dict()}}}))
  lines = []
  table = tune.tune([(200, 384)], [8], (128, 128), str(out), max_configs=2, iterations=2, interpret=True,
                    log=lines.append)
  assert table["entries"][key]["candidates"] == 3
  assert any(line.startswith("[N=200 K=384 M=8 2/3] 16x32x64 g1 w4 s2 split1:") for line in lines), lines
  assert "previous entry" in lines[-2], lines


def test_tune_candidates_can_all_run():
  for m in (1, 16, 64, 128, 256, 4096):
    for block_size in ((128, 128), (64, 64), (128, 64)):
      candidates = tune_module().candidate_configs(m, 7168, 2048, block_size)
      assert candidates and candidates[0] == gemm.triton.heuristic_config(m, 7168, 2048, block_size)
      assert all(not gemm_triton.config_problems(c, block_size) for c in candidates)


def test_tune_candidates_are_distinct_as_launched():
  """Split counts the kernel launches alike (12 K steps asked of 4 or of 5 splits: 4 splits of 3 steps) are timed
  once."""
  assert gemm_triton.split_k_steps(12 * 128, _cfg(64, 64, 128, split_k=5)) == (3, 4)
  assert gemm_triton.split_k_steps(12 * 128, _cfg(64, 64, 128, split_k=16)) == (1, 12)
  candidates = tune_module().candidate_configs(64, 24576, 1536, (128, 128), max_configs=500)
  launched = [dataclasses.replace(c, split_k=gemm_triton.split_k_steps(1536, c)[1]) for c in candidates]
  assert len(set(launched)) == len(candidates) > 20


def tune_module():
  from jaxfp8.tools import tune
  return tune
