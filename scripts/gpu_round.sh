#!/usr/bin/env bash
# The standard GPU round, one device call: the test suite on the GPU, then the benchmarks.
#   scripts/gpu_round.sh [all|tests|bench] [extra pytest args...]
# Logs and results go to $OUT (the device tool brings them back) or ./gpu_out when $OUT is unset.
# On the H200 machine the image's python3 already has jax 0.11.2 (CUDA 13 plugin), pytest and hypothesis;
# the project runs from the working tree through PYTHONPATH.
set -u -o pipefail
phase=${1:-all}; shift || true
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$out/env.log"
if [[ $phase == all || $phase == tests ]]; then
  python3 -m pytest tests -q -rs -p no:cacheprovider --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/tests.log" \
    || status=1
fi
if [[ $phase == all || $phase == bench ]]; then
  python3 -m jaxfp8 bench_quant --out="$out/quant_h200.json" 2>&1 | tee "$out/bench_quant.log" || status=1
fi
exit $status
