"""The Triton GEMM backend (any sm >= 8.9 GPU): its shipped per-shape table of tuned configs, its heuristic for
everything else, and its launch.

The table (`configs/triton_gemm_h200.json`, written by `python -m jaxfp8.tune`) is keyed by weight shape, scale block and
M bucket:  "N,K,gn,gk,bucket" -> {"config": {...TritonGemmConfig fields...}, "us": median kernel time, ...}.
A run picks the entry of the smallest bucket >= M (the largest bucket for bigger M); where the shape was tuned at
other buckets only, the nearest tuned bucket above M (else the largest below) stands in. The table only describes the device it
was measured on (its "device" field); on other GPUs, and for shapes it lacks, `heuristic_config` decides.
Entries are only ever measured numbers: the shipped file says "tuned": false until a tuning run has filled it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxfp8 import _platform
from jaxfp8.gemm import tables
from pallas_kernels import gemm_triton
from pallas_kernels.gemm_triton import TritonGemmConfig, config_problems, pow2_ceil

KERNEL_MODULE = "pallas_kernels.gemm_triton"
CONFIG_CLASS = "TritonGemmConfig"

H200_TABLE = "triton_gemm_h200.json"
# Token counts the table is tuned for (the decode and prefill M of shapes.json).
M_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def m_bucket(m: int) -> int:
  """Smallest bucket >= m; the largest bucket for anything bigger."""
  for bucket in M_BUCKETS:
    if m <= bucket:
      return bucket
  return M_BUCKETS[-1]


def table_key(n: int, k: int, block_size: tuple[int, int], bucket: int) -> str:
  gn, gk = block_size
  return f"{n},{k},{gn},{gk},{bucket}"


def load_table(name: str = H200_TABLE) -> Mapping[str, Any]:
  """The shipped table as a dict ({"device", "tuned", "entries"}); an empty table if the file is missing."""
  return tables.load(name) or {"device": None, "tuned": False, "entries": {}}


def _block_k_for(gk: int) -> int:
  """A K step for scale groups of gk: 128 when it divides gk or gk divides it, else gk's largest power-of-two divisor.

  (The result may still be too narrow for an 8-bit dot; `config_problems` says so.)
  """
  if gk % 128 == 0 or 128 % gk == 0:
    return 128
  return min(gk & -gk, 128)


def heuristic_config(m: int, n: int, k: int, block_size: tuple[int, int], *, num_sms: int = 132) -> TritonGemmConfig | None:
  """A reasonable untuned config for an sm_90-class GPU, or None when no Triton config can serve `block_size`.

  Decode (M <= 64) streams the weight: the weight tile is the MMA's M side (swap_ab), K is split until there are about
  two programs per SM. Larger M uses 64x128 tiles, one group deep, 4 warps, 3 stages, in grouped order for L2 reuse.
  """
  _, gk = block_size
  block_k = _block_k_for(gk)
  k_tiles = -(-k // block_k)
  if m <= 64:
    block_m = max(16, pow2_ceil(m))
    # 3 stages: the depth of 22 of the 24 tuned decode entries (M = 1-64).
    config = TritonGemmConfig(
        block_m=block_m, block_n=64, block_k=block_k, group_m=1, num_warps=4, num_stages=3, swap_ab=True)
    programs_wanted = 2 * num_sms
  else:
    # H200 tunes on six weights: 3 stages (three programs per SM) and 16 row tiles
    # per column sweep fastest at M=1024 and 4096 on 11 of the 12 pairs, 2-19% less time than the 4 stages and 8 row
    # tiles tuned earlier; 8 row tiles at M=256 (fastest on 4 of 6).
    config = TritonGemmConfig(block_m=64, block_n=128, block_k=block_k, group_m=8 if m <= 256 else 16, num_warps=4,
                              num_stages=3)
    programs_wanted = num_sms
  tiles = -(-m // config.block_m) * -(-n // config.block_n)
  # An empty output (M or N = 0) has no tiles to split K over (and the split count below would divide by zero).
  if 0 < tiles < programs_wanted and k_tiles >= 8:
    # Each split keeps at least 4 K steps so that the pipeline has something to overlap.
    split_k = min(-(-programs_wanted // tiles), k_tiles // 4, 16)
    if split_k > 1:
      config = TritonGemmConfig(**{**config.to_dict(), "split_k": split_k})
  if config_problems(config, block_size):
    return None
  return config


def _nearest_entry(entries: Mapping[str, Any], n: int, k: int, block_size: tuple[int, int], m: int):
  """The entry of M's bucket; else, of the same shape, the nearest tuned bucket above M, else the largest below."""
  tuned = [b for b in M_BUCKETS if table_key(n, k, block_size, b) in entries]
  if not tuned:
    return None
  bucket = m_bucket(m)
  above = [b for b in tuned if b >= bucket]
  return entries[table_key(n, k, block_size, above[0] if above else tuned[-1])]


def get_config(
    m: int, n: int, k: int, block_size: tuple[int, int], *, device_kind: str | None = None, num_sms: int = 132,
    table: Mapping[str, Any] | None = None,
) -> TritonGemmConfig | None:
  """The tuned config for this shape on this device if the table has one, else `heuristic_config`."""
  table = load_table() if table is None else table
  if tables.applies(device_kind, table):
    config = entry_config(_nearest_entry(table.get("entries", {}), n, k, tuple(block_size), m), block_size)
    if config is not None:
      return config
  return heuristic_config(m, n, k, block_size, num_sms=num_sms)


def entry_config(entry: Mapping[str, Any] | None, block_size: tuple[int, int]) -> TritonGemmConfig | None:
  """The config of a table entry, or None for no entry or one whose config cannot run with block_size (or cannot
  build a kernel at all: the config refuses itself)."""
  if entry is None:
    return None
  try:
    config = TritonGemmConfig.from_dict(entry["config"])
  except ValueError:
    return None
  return None if config_problems(config, block_size) else config


# ---- the backend interface the planner asks -------------------------------------------------------------------------

# With valid_rows, the Triton kernel computes every row; the planner zeroes the rows past it.
SKIPS_DEAD_ROWS = False


def config_class():
  return TritonGemmConfig


def unavailable(device: _platform.Device, interpret: bool) -> str | None:
  return _platform.unavailable_reason("the Triton GEMM", device, interpret, hopper=False, module=KERNEL_MODULE)


def unsupported(problem) -> str | None:
  if heuristic_config(max(problem.m, 1), problem.n, problem.k, problem.block_size) is None:
    return (f"no Triton config can serve block_size={tuple(problem.block_size)}: gk={problem.block_size[1]} is not "
            f"a multiple of {gemm_triton.MIN_DOT_K} (the narrowest fp8 dot)")
  return None


def row_alignment(m: int) -> tuple[int, str]:
  del m
  return 1, "the Triton GEMM masks partial tiles: no padding"


def default_config_for(problem, device: _platform.Device):
  """The tuned table's entry for this device and shape (by the live rows' bucket), else the heuristic."""
  table = load_table()
  m = problem.m
  if tables.applies(device.kind, table):
    entry = _nearest_entry(table.get("entries", {}), problem.n, problem.k, tuple(problem.block_size), m)
    config = entry_config(entry, problem.block_size)
    if config is not None:
      return config, f"tuned for {table.get('device')} (table {H200_TABLE}, M bucket {m_bucket(m)})"
  config = heuristic_config(m, problem.n, problem.k, problem.block_size, num_sms=device.num_sms)
  why = "no tuned entry for this device and shape" if device.capability is not None else "no GPU to look up"
  return config, f"the heuristic ({why})"


def config_problem(problem, config) -> str | None:
  return "; ".join(config_problems(config, problem.block_size)) or None


def launch(a_q, b_q, a_s, b_s, bias, problem, config, interpret: bool, device: _platform.Device):
  del device
  return gemm_triton.block_fp8_matmul(
      a_q, b_q, a_s, b_s, bias, block_size=tuple(problem.block_size), a_s_column_major=problem.a_s_column_major,
      out_dtype=problem.out_dtype, config=config, interpret=interpret,
      out_rows=problem.m if problem.m != problem.rows else None)


__all__ = ["M_BUCKETS", "H200_TABLE", "m_bucket", "table_key", "load_table", "heuristic_config", "get_config",
           "entry_config", "TritonGemmConfig"]
