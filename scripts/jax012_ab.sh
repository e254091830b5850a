#!/usr/bin/env bash
# Issue 38 on the H200: the Mosaic GEMM's prefill under JAX 0.11.2 (the image), under JAX 0.12.0.1 as installed, and
# under 0.12.0.1 with libnvJitLink out of reach, each in a process of its own (scripts/diag_jax012_mosaic_gemm.py),
# then the quantizer's GPU tests under 0.12. JAX 0.12's Mosaic GPU compiles PTX through libnvJitLink whenever that
# library loads (XLA's compilation-provider choice, hard-wired to "auto" in jaxlib/mosaic/gpu), and libnvJitLink
# compiles relocatable code, where ptxas ignores `setmaxnreg` (C7504): the consumer warpgroups keep the launch's
# register share. Without the library, Mosaic falls back to the ptxas executable, as 0.11.2 always did.
#   scripts/jax012_ab.sh TARBALL   (the 0.12 wheels unpacked under jax012/, tar.xz; WORKSPACE.md: how they travel)
#   BENCH=1 scripts/jax012_ab.sh TARBALL: instead, `python -m jaxfp8 bench --ops=gemm,quant` under each version
#   (BENCH_OPS, BENCH_SHAPES and GEMM_CONFIGS override the ops, the shapes and add --gemm_configs);
#   GROUPED=1: the grouped GEMM's prefill (the planner's schedule and the 128x128 tile split along M) under each.
set -u -o pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
tar -C /tmp -xJf "$1" || exit 1
new=/tmp/jax012:$PWD
if [[ -n ${GROUPED:-} ]]; then  # the grouped GEMM's prefill: the planner's and the 128x128 tile split along M, each version
  two_wgs="mosaic:tile_m=128,tile_n=128,num_compute_wgs=2,grid_minor_dim=M,grid_tile_width=8"
  for v in 0.11.2 0.12; do
    path=$PWD; [[ $v == 0.12 ]] && path=$new
    PYTHONPATH=$path timeout 240 python3 -m jaxfp8 bench --ops=grouped --implementations=mosaic \
      --expert_shapes="dsv3_ep8.gate_up;dsv3_ep8.down;qwen3_30b_a3b.gate_up;qwen3_30b_a3b.down" \
      --routed_rows=4096,16384 --gemm_configs="$two_wgs,k_blocks_per_step=1,max_concurrent_steps=4" \
      --out="$out/grouped_ab_$v.json" > "$out/grouped_ab_$v.log" 2>&1
    echo "$v rc $?"; grep -E "^grouped" "$out/grouped_ab_$v.log" | head -20
  done
  exit 0
fi
if [[ -n ${BENCH:-} ]]; then  # the issue's A/B: the same bench under each version, back to back
  shapes=${BENCH_SHAPES:-"4096,24576,7168;4096,7168,18432;1024,24576,7168;64,24576,7168;1,24576,7168"}
  configs=(); [[ -n ${GEMM_CONFIGS:-} ]] && configs=(--gemm_configs="$GEMM_CONFIGS")
  for v in 0.11.2 0.12; do
    path=$PWD; [[ $v == 0.12 ]] && path=$new
    PYTHONPATH=$path timeout 240 python3 -m jaxfp8 bench --ops="${BENCH_OPS:-gemm,quant}" --shapes="$shapes" \
      --implementations=mosaic,torch_scaled_mm "${configs[@]}" --out="$out/jax_ab_$v.json" > "$out/jax_ab_$v.log" 2>&1
    echo "$v rc $?"; grep -E "^gemm|^quant" "$out/jax_ab_$v.log" | head -20
  done
  exit 0
fi
timeout 200 python3 scripts/diag_jax012_mosaic_gemm.py "$out/diag_0.11.2" > "$out/diag_0.11.2.log" 2>&1
echo "0.11.2 rc $?"; grep -a -E "us per call|core_count|jax |nvJitLink mapped|Using (libnvjitlink|ptxas)" "$out/diag_0.11.2.log" | head -40
PYTHONPATH=$new timeout 200 python3 scripts/diag_jax012_mosaic_gemm.py "$out/diag_0.12" > "$out/diag_0.12.log" 2>&1
echo "0.12 rc $?"; grep -a -E "us per call|core_count|jax |nvJitLink mapped|Using (libnvjitlink|ptxas)" "$out/diag_0.12.log" | head -40
# libnvJitLink out of reach: every copy on the machine moved aside for this run, then put back.
hidden=$(find / -xdev \( -name 'libnvJitLink.so*' \) -not -path '/proc/*' 2>/dev/null)
for f in $hidden; do mv "$f" "$f.hidden"; done
echo "hid: $hidden"
# (cuSPARSE needs libnvJitLink: the plugin's version check of it is skipped, nothing here uses it)
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=$new timeout 200 python3 scripts/diag_jax012_mosaic_gemm.py \
  "$out/diag_0.12_ptxas" > "$out/diag_0.12_ptxas.log" 2>&1
echo "0.12 without libnvJitLink rc $?"
grep -a -E "us per call|core_count|jax |nvJitLink mapped|Using (libnvjitlink|ptxas)" "$out/diag_0.12_ptxas.log" | head -40
for f in $hidden; do mv "$f.hidden" "$f"; done
if [[ -z ${SKIP_TESTS:-} ]]; then
  PYTHONPATH=$new timeout 150 python3 -m pytest tests/test_quant_mosaic.py -q -p no:cacheprovider -m "gpu or hopper" \
    -n 4 > "$out/tests_quant_mosaic_0.12.log" 2>&1
  echo "quant tests 0.12: $(tail -1 "$out/tests_quant_mosaic_0.12.log")"
fi
parts=$(cd "$out" && ls -d diag_* tests_quant_mosaic_0.12.log 2>/dev/null)  # one file back: the device returns at most 8
tar -C "$out" -czf "$out/jax012_ab_h200.tgz" $parts && (cd "$out" && rm -rf $parts)
