#!/usr/bin/env bash
# compute-sanitizer over every GPU kernel of jaxfp8 at an aligned and an unaligned shape.
#   OUT=dir [SANITIZE_JOBS=n] scripts/sanitize.sh [TOOL ...]   (tools: memcheck racecheck initcheck synccheck; default all
#   four; SANITIZE_JOBS runs that many at once)
# One log per tool / kernel / shape under $OUT/sanitize/, and a summary table ($OUT/sanitize/summary.md) of the error
# counts compute-sanitizer reports. Notes:
#  - XLA_PYTHON_CLIENT_PREALLOCATE=false and the platform allocator, so that allocations are per buffer and
#    memcheck/initcheck see real buffer bounds (with JAX's BFC pool a read past a buffer lands in the pool, unseen).
#  - initcheck may still flag reads of memory XLA allocated but a kernel deliberately does not initialize (e.g.
#    padding read by a TMA box whose result is masked); such reports are triaged by hand, not counted as passes.
#  - The driver imports no CUPTI timing (jaxfp8.timing): CUPTI and compute-sanitizer conflict.
#  - racecheck/synccheck apply to shared-memory hazards and barriers of the Triton and Mosaic kernels; XLA's own
#    kernels in the same process are checked too (errors there are reported with their kernel names).
set -u -o pipefail
out=${OUT:-gpu_out}/sanitize; mkdir -p "$out"
# No XLA autotuning: its comparison kernel (xla_fp_comparison) reads candidate outputs it never initialized, which
# initcheck reported by the thousand on the H200; our kernels run the same either way.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_PYTHON_CLIENT_ALLOCATOR=platform TF_CPP_MIN_LOG_LEVEL=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
tools=("$@"); [[ ${#tools[@]} -eq 0 ]] && tools=(memcheck racecheck initcheck synccheck)
kernels=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import reliability_kernels as rk; print(*rk.KERNELS)")
limit=${SANITIZE_TIMEOUT:-300}
jobs=${SANITIZE_JOBS:-1}  # runs at once: each is its own process on the one GPU (correctness only, nothing is timed)
sanitize_one() {  # TOOL KERNEL INDEX -> $out/TOOL_KERNEL_INDEX.log and a summary row in $out/TOOL_KERNEL_INDEX.row
  local tool=$1 kernel=$2 index=$3 log="$out/$1_$2_$3.log" rc errors
  timeout "$limit" compute-sanitizer --tool "$tool" --print-limit 100 --error-exitcode 9 \
    python3 scripts/sanitize_driver.py "$kernel" "$index" > "$log" 2>&1
  rc=$?
  # memcheck/initcheck/synccheck end with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: ... (N errors, ...".
  errors=$(grep -Eo "ERROR SUMMARY: [0-9]+|\([0-9]+ errors" "$log" | tail -1 | grep -Eo "[0-9]+" || true)
  [[ $rc -eq 3 ]] && errors="skipped"
  echo "| $tool | $kernel | $index | ${errors:-?} | $rc |" | tee "$out/$1_$2_$3.row"
}
export -f sanitize_one; export out limit
runs=()  # "TOOL KERNEL INDEX", in summary order
for tool in "${tools[@]}"; do for kernel in $kernels; do runs+=("$tool $kernel 0" "$tool $kernel 1"); done; done
printf '%s\n' "${runs[@]}" | xargs -P "$jobs" -L 1 bash -c 'sanitize_one "$@"' _
echo "| tool | kernel | shape | errors | exit |" > "$out/summary.md"
echo "|---|---|---|---|---|" >> "$out/summary.md"
for run in "${runs[@]}"; do
  read -r tool kernel index <<< "$run"
  row="$out/${tool}_${kernel}_${index}.row"
  if [[ -f $row ]]; then cat "$row" >> "$out/summary.md"; rm "$row"; else echo "| $tool | $kernel | $index | not run | - |" >> "$out/summary.md"; fi
done
cat "$out/summary.md"
# The script's status: exit codes 0 (clean) and 3 (kernel not available here) pass; anything else (9: errors found,
# 124: timeout, -: not run) fails.
awk -F'|' 'NR > 2 && $6 !~ /^ *(0|3) *$/ {bad = 1} END {exit bad}' "$out/summary.md"
