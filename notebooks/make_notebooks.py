"""Writes quickstart.ipynb, benchmarks.ipynb and moe.ipynb (outputs stripped) from the cells below: edit here, then run
`.venv/bin/python notebooks/make_notebooks.py`. tests/test_notebooks.py executes every notebook."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

QUICKSTART = [
    new_markdown_cell("""# jaxfp8 quick start

Block-scaled FP8 the way DeepSeek-V3 and Qwen3-FP8 checkpoints store it: weights quantized per 128x128 block,
activations per group of 128 values of a row, and a GEMM that applies both scales. This notebook

1. quantizes a layer's bf16 weight,
2. runs `w8a8_block_fp8_linear` on random activations and compares it with bf16 and with the float64 reference,
3. shows which path dispatch picks and why, and the eager compile cache,
4. plots the error by row.

It runs unchanged on CPU (XLA code path) and on a GPU (Pallas kernels: Mosaic GPU on Hopper, Triton on sm >= 8.9)."""),
    new_code_cell("""import jax
import jax.numpy as jnp
import numpy as np
import matplotlib.pyplot as plt

import jaxfp8
from jaxfp8 import reference

print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")"""),
    new_markdown_cell("""## 1. Quantize a layer's weights

A bf16 weight (N, K) becomes e4m3fn codes (N, K) and one float32 scale per 128x128 block (the Hugging Face
`weight` / `weight_scale_inv` pair). The blocks get different magnitudes here, as in a trained layer."""),
    new_code_cell("""N, K, M = 1024, 2048, 24
block_size = (128, 128)
key_w, key_x, key_s = jax.random.split(jax.random.key(0), 3)
block_magnitudes = jnp.exp2(jax.random.uniform(key_s, (N // 128, K // 128), minval=-4, maxval=2))
w = (jax.random.normal(key_w, (N, K)) * jnp.repeat(jnp.repeat(block_magnitudes, 128, 0), 128, 1)).astype(jnp.bfloat16)

w_q, w_s = jaxfp8.quantize_weight_blockwise(w, block_size=block_size)
print("w_q", w_q.shape, w_q.dtype, "| w_s", w_s.shape, w_s.dtype)
w_back = jaxfp8.dequantize_weight_blockwise(w_q, w_s, block_size)
print(f"weight round trip: relative error {reference.relative_error(np.asarray(w_back), np.asarray(w, np.float32)):.2e}")"""),
    new_markdown_cell("""## 2. Run the linear and compare with bf16

`w8a8_block_fp8_linear(x, w_q, w_s, block_size)` quantizes x per token group, runs the block-scaled GEMM and returns
`x.dtype`. Two comparisons: with the bf16 layer `x @ w.T` (what the model computed before FP8 quantization) and
with `jaxfp8.reference`, the float64 oracle of the same FP8 computation (the library's numerical contract)."""),
    new_code_cell("""row_magnitudes = jnp.exp2(jax.random.uniform(key_s, (M, 1), minval=-3, maxval=3))
x = (jax.random.normal(key_x, (M, K)) * row_magnitudes).astype(jnp.bfloat16)

y = jaxfp8.w8a8_block_fp8_linear(x, w_q, w_s, block_size)
y_bf16 = jnp.dot(x, w.T, preferred_element_type=jnp.float32)            # the unquantized layer
y_ref = reference.w8a8_block_fp8_linear(np.asarray(x), np.asarray(w_q), np.asarray(w_s), block_size)  # float64

print("y", y.shape, y.dtype)
print(f"vs the bf16 layer:        relative error {reference.relative_error(np.asarray(y, np.float32), np.asarray(y_bf16)):.2e}"
      "  (FP8 quantization of weights and activations)")
print(f"vs the float64 reference: relative error {reference.relative_error(np.asarray(y, np.float32), y_ref):.2e}"
      "  (the kernels' own error: accumulation order and the bf16 output)")"""),
    new_markdown_cell("""## 3. Which path runs, and why

`jaxfp8.linear.explain` returns the plan a call takes: the GEMM and quantizer implementations, the row padding, the
scale layout and the reason. On CPU that is the XLA path; on an H200 the Mosaic GPU kernels (Triton at M <= 4, where
it measured faster, and for shapes they cannot take). Shapes can be given as `jax.ShapeDtypeStruct`, so the plan of a large prefill batch costs nothing."""),
    new_code_cell("""for rows in (1, M, 4096):
  x_shape = jax.ShapeDtypeStruct((rows, K), jnp.bfloat16)
  print(f"M={rows:>5}:", jaxfp8.linear.explain(x_shape, w_q, block_size))"""),
    new_markdown_cell("""Eager calls (outside `jax.jit`) are compiled once per *row bucket*, not once per batch size: a server that sees
every M from 1 to 64 compiles a handful of executables. `cache_info()` counts them."""),
    new_code_cell("""jaxfp8.linear.cache_clear()
for rows in range(1, 17):
  jaxfp8.w8a8_block_fp8_linear(x[:rows], w_q, w_s, block_size).block_until_ready()
info = jaxfp8.linear.cache_info()
print(info)
print(f"16 batch sizes -> {info.misses} compilations, {info.hits} cache hits, buckets {info.buckets}")"""),
    new_markdown_cell("""## 4. The error by row

Rows were given magnitudes spread over six octaves. Per-token-group scales make the relative error of a row
independent of its magnitude: every row shows about the same FP8 quantization error against bf16, and the
kernels stay within the bf16 output rounding of the float64 reference."""),
    new_code_cell("""def row_errors(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)

fig, ax = plt.subplots(figsize=(8, 3.5))
ax.semilogy(row_errors(y, y_bf16), "o-", label="jaxfp8 vs bf16 layer (quantization error)")
ax.semilogy(row_errors(y, y_ref), "s-", label="jaxfp8 vs float64 FP8 reference (kernel error)")
ax.set_xlabel("row of x"); ax.set_ylabel("relative error (L2 of the row)")
ax.grid(True, alpha=0.3); ax.legend(fontsize=8)
plt.show()
assert row_errors(y, y_ref).max() < 1e-2"""),
]

BENCHMARKS = [
    new_markdown_cell("""# jaxfp8 benchmark results

Loads the committed results in `benchmarks/` (H200, CUPTI kernel times, every implementation and baseline timed
in the same run) and plots throughput against M. `python -m jaxfp8 bench --out=...` writes such a JSON;
`python -m jaxfp8 plot --json=... --out=....png` draws the same plot from the command line."""),
    new_code_cell("""import json
from pathlib import Path

import matplotlib.pyplot as plt
from jaxfp8.tools import plot as jaxfp8_plot

root = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks").is_dir() and (p / "jaxfp8").is_dir())
everything = {path.name: json.loads(path.read_text()) for path in sorted((root / "benchmarks").glob("*.json"))}
# Benchmark-command results carry rows and run metadata; the rest are other measurements (see benchmarks/README.md).
results = {name: r for name, r in everything.items() if {"rows", "jax_version", "timing", "command"} <= r.keys()}
print("other measurements (not plotted here):", ", ".join(sorted(everything.keys() - results.keys())) or "none")
for name, result in results.items():
  print(f"{name}: {result.get('benchmark', '?')}\\n  {result['device']}, jax {result['jax_version']}, "
        f"{result['date'][:10]}, {len(result['rows'])} rows; {result['timing']}\\n  command: {result['command']}")"""),
    new_markdown_cell("""## Tables
Each JSON has a markdown table beside it (`.md`), written by the same run."""),
    new_code_cell("""from IPython.display import Markdown, display

for name in results:
  table = root / "benchmarks" / name.replace(".json", ".md")
  if table.exists():
    display(Markdown(table.read_text()))"""),
    new_markdown_cell("""## Plots
Two representative shapes per file (the GEMM: a wide projection and a long-K down projection; the quantizer:
K = 7168 and 18432), one line per implementation, in the same colour in every plot; each plot names its file.
Dashed: the roofline measured or quoted in the same run."""),
    new_code_cell("""for name, result in results.items():
  fig = jaxfp8_plot.plot_result(result, source=f"benchmarks/{name}")
  plt.show()"""),
]

MOE = [
    new_markdown_cell("""# The FP8 mixture-of-experts layer

An MoE block the way Qwen3-MoE and DeepSeek-V3 FP8 checkpoints hold it: each expert's gate, up and down projections
in block FP8, a float router. This notebook

1. quantizes a small block's experts and routes random tokens with Qwen3-MoE's router,
2. runs `jaxfp8.moe.fp8_moe_from_logits` and compares it with the same block in bf16 and with the float64 reference
   (docs/CONTRACT.md §8), and shows the plan (`moe.explain`),
3. plots how many routed rows each expert received,
4. plots the layer step by step: the H200 results of `python -m jaxfp8 bench --ops=moe` when
   `benchmarks/moe_h200.json` exists, otherwise the same benchmark on a tiny layer here (on CPU: wall clock, which only
   shows the command working).

It runs unchanged on CPU (XLA, the Mosaic kernels not at all) and on a Hopper GPU (the Mosaic grouped GEMMs)."""),
    new_code_cell("""import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import matplotlib.pyplot as plt

import jaxfp8
from jaxfp8 import moe, reference

print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")"""),
    new_markdown_cell("""## 1. A small block: 16 experts, H=512, I=256, top-4

Experts are stacked once: `w13` (E, 2I, H) holds each expert's [gate | up] rows, `w2` (E, H, I) its down projection
(`jaxfp8.moe.weights.load_hf_moe` does this from a checkpoint)."""),
    new_code_cell("""E, H, I, TOP_K, T = 16, 512, 256, 4, 96
keys = jax.random.split(jax.random.key(0), 5)
w13 = (jax.random.normal(keys[0], (E, 2 * I, H)) * 0.05).astype(jnp.bfloat16)
w2 = (jax.random.normal(keys[1], (E, H, I)) * 0.05).astype(jnp.bfloat16)
gate_weight = jax.random.normal(keys[2], (E, H)) * 0.05
quantize = jax.vmap(lambda w: jaxfp8.quantize_weight_blockwise(w, block_size=(128, 128)))
w13_q, w13_s = quantize(w13)
w2_q, w2_s = quantize(w2)
x = jax.random.normal(keys[3], (T, H)).astype(jnp.bfloat16)
router = moe.Qwen3MoeRouter(top_k=TOP_K)
logits = router.logits(x, gate_weight)
print("w13_q", w13_q.shape, w13_q.dtype, "| w13_s", w13_s.shape, "| logits", logits.shape)"""),
    new_markdown_cell("""## 2. Run the layer; compare with bf16 and the reference"""),
    new_code_cell("""out = moe.fp8_moe_from_logits(x, logits, w13_q, w13_s, w2_q, w2_s, router=router)
ids, weights = router(logits)

def bf16_block(x, ids, weights, w13, w2):
  \"\"\"The same block on the bf16 weights, one expert at a time (dense masks: fine at this size).\"\"\"
  out = jnp.zeros(x.shape, jnp.float32)
  for e in range(E):
    h = x.astype(jnp.float32) @ w13[e].astype(jnp.float32).T
    y = (jax.nn.silu(h[:, :I]) * h[:, I:]) @ w2[e].astype(jnp.float32).T
    out = out + (jnp.where(ids == e, weights, 0.0).sum(-1))[:, None] * y
  return out

bf16 = np.asarray(bf16_block(x, ids, weights, w13, w2))
exact = reference.fp8_moe(np.asarray(x), np.asarray(ids), np.asarray(weights), np.asarray(w13_q), np.asarray(w13_s),
                          np.asarray(w2_q), np.asarray(w2_s), (128, 128))
got = np.asarray(out, np.float32)
print(f"vs the float64 reference of the same FP8 computation: {reference.relative_error(got, exact):.2e}")
print(f"vs the bf16 block (the model before FP8):               {reference.relative_error(got, bf16):.2e}")
print()
print(moe.explain(x, w13_q, w2_q, top_k=TOP_K))"""),
    new_markdown_cell("""## 3. Routed rows per expert
The layer's `dispatch` step sorts the routed rows by expert; `group_sizes` counts them. An expert no token chose
costs nothing."""),
    new_code_cell("""group_sizes = moe.layer.dispatch(ids, E).group_sizes
fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(np.arange(E), np.asarray(group_sizes))
ax.set_xlabel("expert"); ax.set_ylabel("routed rows"); ax.set_title(f"{T} tokens x top-{TOP_K} over {E} experts")
plt.show()"""),
    new_markdown_cell("""## 4. The layer step by step
`python -m jaxfp8 bench --ops=moe` times each step of the layer alone (route, then `jaxfp8.moe.layer.STEPS`:
dispatch, quantize, permute, gate_up, silu_quant, down, combine), the whole layer, and the same layer in bf16, each checked against the float64 reference
first. On the H200 it is CUPTI kernel time (`scripts/gpu_round.sh moe` writes `moe_h200.json`); here, without that
file, it runs a tiny layer on this machine."""),
    new_code_cell("""from jaxfp8.tools import bench

root = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks").is_dir() and (p / "jaxfp8").is_dir())
saved = root / "benchmarks" / "moe_h200.json"
if saved.exists():
  result = json.loads(saved.read_text())
else:
  result = bench.run(["moe"], problems=bench.Problems(moe_layers=("tiny",), tokens=(8, 64)), iterations=3,
                     log=lambda *_: None)
print(result["device"], "|", result["timing"])
rows = [r for r in result["rows"] if r["op"] == "moe" and "us" in r]
assert all(r["within_bound"] for r in rows if "within_bound" in r)  # each output against the float64 reference

steps = list(dict.fromkeys(r["implementation"] for r in rows if r.get("step")))
cases = sorted({(r["shape"], r["m"]) for r in rows})
times = {(r["shape"], r["m"], r["implementation"]): r["us"] for r in rows}
fig, ax = plt.subplots(figsize=(8, 0.6 * len(cases) + 1.5))
for row, case in enumerate(cases):
  left = 0.0
  for i, step in enumerate(steps):
    us = times.get((*case, step), 0.0)
    ax.barh(row, us, left=left, color=plt.cm.tab10(i), label=step if row == 0 else None)
    left += us
  for name, marker in (("layer", "|"), ("ragged_dot_bf16", "x"), ("pallas_ragged_bf16", "+")):
    if (*case, name) in times:
      ax.plot(times[(*case, name)], row, marker, color="k", markersize=12, label=name if row == 0 else None)
ax.set_yticks(range(len(cases)), [f"{layer} T={t}" for layer, t in cases])
ax.set_xlabel("microseconds"); ax.legend(fontsize=7, ncol=3, loc="lower right")
ax.set_title("MoE layer: each step alone (bars) and the whole layer (markers)")
plt.show()"""),
]


def write(cells, name: str) -> None:
  nb = new_notebook(cells=cells, metadata={
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"}})
  nbformat.validate(nb)
  nbformat.write(nb, HERE / name)


if __name__ == "__main__":
  write(QUICKSTART, "quickstart.ipynb")
  write(BENCHMARKS, "benchmarks.ipynb")
  write(MOE, "moe.ipynb")
