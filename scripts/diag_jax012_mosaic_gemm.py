"""Issue 38 on the H200: why the Mosaic GEMM's prefill schedules run slower under JAX 0.12.0.1 than under 0.11.2.

On CPU both JAX versions lower the shipped configs to the same device code: the kernels' PTX (through each
version's own CUDA plugin) differs only in how TMA copies and their barrier arrivals are spelled, and ptxas 12.9,
13.0, 13.2 and 13.5 give both the same registers and spills. So this script looks at what only a GPU run shows,
once per JAX version, in one process each:

  python3 scripts/diag_jax012_mosaic_gemm.py $OUT/diag_$(python3 -c 'import jax; print(jax.__version__)')

1. the environment the kernels are compiled in: JAX, jaxlib and plugin versions and paths, the device's
   core_count (the planner's num_sms), the ptxas on PATH and beside the plugin (a plugin installed with
   `pip --target` has no nvidia/ packages beside it), the persistent compilation cache setting;
2. each case's kernels under CUPTI, one line per kernel name (median us), so that a slower Mosaic kernel is told
   apart from extra kernels around it;
3. which PTX compiler Mosaic GPU used (its decision log on stderr; whether libnvJitLink is mapped);
4. the PTX and ptxas reports Mosaic GPU writes (MOSAIC_GPU_DUMP_TO / _PTX / _PTXAS, the same names in both
   versions; the compilation cache is switched off, which would skip the compile and so the dumps), packed into
   OUT/dumps.tar.gz.

Cases (`cases`): per prefill shape the shipped config (192x128 tiles on three consumer warpgroups in CTA pairs;
128x256 tiles on two), variants whose registers fit without `setmaxnreg`, and the decode config (the control).
"""

from __future__ import annotations

import os
import pathlib
import sys

OUT = pathlib.Path(sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "diag_out")
DUMPS = OUT / "dumps"
if __name__ == "__main__":
  DUMPS.mkdir(parents=True, exist_ok=True)
  # Read by the CUDA plugin when it compiles a Mosaic GPU kernel: set before JAX starts.
  os.environ.update(MOSAIC_GPU_DUMP_TO=str(DUMPS), MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
  # The PTX-to-cubin compiler Mosaic GPU picks (XLA's assemble_compilation_provider logs its decision at VLOG 3-4):
  # ptxas, or libnvJitLink, which compiles relocatable code and so ignores `setmaxnreg` (ptxas C7504).
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
  os.environ.setdefault("TF_CPP_VMODULE", "assemble_compilation_provider=4,nvjitlink_compilation_provider=3")

import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxfp8.gemm import mosaic as gemm_mosaic  # noqa: E402
from jaxfp8.tools import timing  # noqa: E402
from pallas_kernels import gemm_mosaic as kernel  # noqa: E402

NUM_SMS = 132
ITERATIONS = 20


def log(line: str = "") -> None:
  print(line, flush=True)
  with open(OUT / "report.txt", "a") as f:
    f.write(line + "\n")


def ptxas_version(path: str | None) -> str:
  if not path:
    return "-"
  try:
    text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
  except OSError as e:
    return f"({e})"
  return text.strip().splitlines()[-1] if text.strip() else "?"


def environment() -> None:
  log(f"jax {jax.__version__} at {pathlib.Path(jax.__file__).parent}")
  for dist in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
               "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12"):
    try:
      log(f"  {dist} {importlib.metadata.version(dist)}")
    except importlib.metadata.PackageNotFoundError:
      pass
  device = jax.devices()[0]
  log(f"device {device.device_kind}, compute_capability {getattr(device, 'compute_capability', None)}, "
      f"core_count {getattr(device, 'core_count', None)}")
  try:
    import jax_plugins
    for folder in jax_plugins.__path__:
      log(f"jax_plugins at {folder}")
      for ptxas in pathlib.Path(folder).parent.glob("nvidia/cu1*/bin/ptxas"):
        log(f"  ptxas beside the plugin: {ptxas} ({ptxas_version(str(ptxas))})")
  except ImportError:
    log("no jax_plugins package")
  on_path = shutil.which("ptxas")
  log(f"ptxas on PATH: {on_path} ({ptxas_version(on_path)})")
  for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"):
    log(f"{name}={os.environ.get(name, '')}")
  log(f"jax_compilation_cache_dir={jax.config.jax_compilation_cache_dir!r} (switched off below)")
  jax.config.update("jax_enable_compilation_cache", False)


PREFILL_SHAPES = ((4096, 24576, 7168), (4096, 7168, 18432), (1024, 24576, 7168))


def cases() -> list[tuple[str, tuple[int, int, int], kernel.MosaicGemmConfig]]:
  """Per prefill shape: the shipped config, it without its cluster, and schedules whose registers fit without
  `setmaxnreg`: two consumer warpgroups of 64x128 (168 registers a thread at launch hold their accumulators) and the
  one-warpgroup kernel with no producer (no register split at all); then the decode config (the control)."""
  M = kernel.Dim.M
  two_small = kernel.MosaicGemmConfig(tile_m=128, tile_n=128, num_compute_wgs=2, wg_split=M, grid_tile_width=16)
  found = []
  for shape in PREFILL_SHAPES:
    shipped = gemm_mosaic.default_config(*shape, num_sms=NUM_SMS)
    found += [("shipped", shape, shipped)]
    if shipped.cluster_dim is not None:
      found += [("shipped, no cluster", shape, dataclasses.replace(shipped, cluster_dim=None))]
    found += [("2 WGs 128x128", shape, two_small),
              ("2 WGs 128x128, CTA pairs along N", shape, dataclasses.replace(two_small, cluster_dim=kernel.Dim.N)),
              ("1 WG 128x256, no producer", shape,
               kernel.MosaicGemmConfig(tile_m=128, tile_n=256, warp_specialized=False, num_compute_wgs=1))]
  found.append(("decode (shipped)", (64, 24576, 7168), gemm_mosaic.default_config(64, 24576, 7168, num_sms=NUM_SMS)))
  return found


def operands(m: int, n: int, k: int):
  keys = jax.random.split(jax.random.key(38), 4)
  a_q = jax.random.normal(keys[0], (m, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
  b_q = jax.random.normal(keys[1], (n, k), jnp.bfloat16).astype(jnp.float8_e4m3fn)
  a_s = jax.random.uniform(keys[2], (k // 128, -(-m // 4) * 4), jnp.float32, 0.5, 2.0)
  b_s = jax.random.uniform(keys[3], (n // 128, k // 128), jnp.float32, 0.5, 2.0)
  return a_q, b_q, a_s, b_s


def time_case(name: str, shape: tuple[int, int, int], config: kernel.MosaicGemmConfig) -> None:
  m, n, k = shape
  config = kernel.fit_smem(config, k, lambda c: c.smem_bytes(jnp.bfloat16))
  fn = jax.jit(lambda a, b, c, d: kernel.block_fp8_matmul(a, b, c, d, config=config, num_sms=NUM_SMS))
  args = operands(m, n, k)
  total, by_name = timing.median_kernel_us_by_name(fn, [args], iterations=ITERATIONS)
  tflops = 2 * m * n * k / total / 1e6
  log(f"{name}: M={m} N={n} K={k}: {total:.1f} us per call ({tflops:.0f} TFLOP/s)")
  for kernel_name, us in by_name.items():
    log(f"    {kernel_name}: {us:.1f} us")
  log(f"    config {config}")


def main() -> int:
  (OUT / "report.txt").unlink(missing_ok=True)
  environment()
  for name, shape, config in cases():
    try:
      time_case(name, shape, config)
    except Exception as e:  # one failing case must not hide the others' numbers
      log(f"{name} {shape}: FAILED {type(e).__name__}: {str(e)[:300]}")
  with open("/proc/self/maps") as maps:
    jitlink = sorted({line.split()[-1] for line in maps if "nvJitLink" in line})
  log(f"libnvJitLink mapped in this process: {jitlink or 'no'}")
  reports = sorted(DUMPS.glob("*.ptxas"))
  log(f"{len(reports)} ptxas reports, {len(list(DUMPS.glob('*.ptx')))} PTX files in {DUMPS}")
  for report in reports:
    log(f"--- {report.name}\n{report.read_text().strip()}")
  with tarfile.open(OUT / "dumps.tar.gz", "w:gz") as tar:
    for path in sorted(DUMPS.iterdir()):
      if path.suffix in (".ptx", ".ptxas"):
        tar.add(path, arcname=path.name)
  shutil.rmtree(DUMPS)
  return 0


if __name__ == "__main__":
  sys.exit(main())
