#!/usr/bin/env bash
# The standard GPU round. One device call can hold about 10 minutes, so the round is split into phases:
#   scripts/gpu_round.sh PHASE [PHASE ...]        e.g.  scripts/gpu_round.sh tests-quant bench-quant
# Phases (rough H200 wall times as measured):
#   tests-suite   every test file with GPU work in three pytest-xdist groups at once (GEMM GPU tests; quantizer,
#                 linear and the rest; grouped GEMM, gather, MoE and adversarial tests). Not yet timed
#   tests-all     the GPU-marked GEMM tests, and the quant, linear, weights, nn, sharding, extremes, edges,
#                 transforms, gradient and example tests (kernels native) at once in two pytest-xdist groups sharing the GPU
#                 (TEST_WORKERS, default 4, and 2 more; the image has pytest-xdist): compiling is the slow part.
#                 With TEST_WORKERS=8: GEMM group 3 min, quant+linear group 3.5 min
#   tests-quant   tests/test_quant.py + tests/test_quant_mosaic.py natively (~4-5 min)
#   tests-gemm    GPU-marked GEMM tests, Triton and Mosaic, TEST_WORKERS (default 4) xdist workers (serially
#                 they got 52% through in 330 s; the Mosaic file alone took 150 s with 4 workers)
#   tests-linear  linear, weights, nn, sharding tests
#   bench         python -m jaxfp8 bench: GEMM and linear with every baseline in one run, the committed results
#                 (BENCH_ARGS overrides DeepSeek-V3 q_proj_no_lora and dense_down and Qwen3-32B qkv_proj x M=1..4096;
#                 7.5 min alone on the GPU; --time_budget_s=490 stops it between shapes if slower; the quantizer has
#                 its own phase, bench-quant)
#   bench-gemm-decode   the GEMM part of bench at every M of shapes.json's m_decode (1..256), one run
#   bench-gemm-prefill  the same at every M of m_prefill (512..8192), one run. Together they are the issues'
#                 benchmark; all 14 M in one run would need about 12 minutes, more than a device call (BENCH_ALL_ARGS
#                 overrides the models; each stops between shapes at 520 s: use PHASE_TIMEOUT=590)
#   gemm-grid     python -m jaxfp8 bench --ops=gemm at M in {1, 7, 64, 100, 128, 256, 511, 512, 1000, 1024, 2048, 3000,
#                 4096} beside cuBLAS blockwise (issue 37), GRID_MODELS of shapes.json per call (e.g.
#                 deepseek_v3_tp8,deepseek_v3_tp16,qwen3_4b in a second call); not yet timed
#   gemm-sweep    python -m jaxfp8 bench --ops=gemm at the (M, N, K) of SWEEP_SHAPES (default: the 41 points of
#                 benchmarks/gemm_medium_m_h200.json below 0.98x cuBLAS) with the planner, cuBLAS blockwise and the 8
#                 schedules of SWEEP_CONFIGS, one process; then scripts/mosaic_table_from_sweep.py writes the device's
#                 measured table to $out/mosaic_gemm_table.json (SWEEP_DEVICE, default "NVIDIA H200"; copy it into
#                 jaxfp8/gemm/configs/ and name it in MEASURED_TABLES). 12 points took 104 s on an H100
#   bench-quant   python -m jaxfp8 bench --ops=quant at the quantizer's widths K = 512..18432 and M = 1..16384
#                 (~2 min; BENCH_QUANT_ARGS overrides them)
#   grouped       the grouped GEMM's GPU tests (tests/test_grouped.py -m hopper: DeepSeek-V3 EP8 and Qwen3-30B-A3B
#                 expert shapes, ragged and masked, every expert's sampled rows against the reference), then
#                 python -m jaxfp8 bench --ops=grouped (ours ragged and masked, lax.ragged_dot and JAX's Pallas ragged
#                 dot in bf16, our dense GEMM at the same rows, each problem's floor; GROUPED_BENCH_ARGS overrides;
#                 stops between shapes at 420 s). The GPU tests single-process: 18 of 24 in 70 s; an earlier version
#                 of the bench aborted in ptxas (WORKSPACE.md)
#   grouped-blocks  block sizes of 64 on the Mosaic GEMMs: their GPU tests (dense and grouped), the grouped bench at
#                 --block_size=64,64 and 128,64, and a sweep of the grouped decode schedules in 64- and 32-column tiles
#                 beside the planner's at R = 8 and 64 (--gemm_configs); run on an H100
#   grouped-medium  the ragged grouped GEMM at R = 8, 64, 512 against five schedule variants (--gemm_configs): the data
#                 for the decode and medium-rows schedules and for gate_up's fused epilogue at decode (about 200 s on
#                 an H100)
#   blocks-64-dispatch  block sizes of 64: the Mosaic GEMMs against the Triton dense GEMM and XLA's grouped one (what
#                 the default dispatch ran them on; about 150 s on an H100)
#   moe-live-grid  scripts/ab_moe_plan.py live_grid: the MoE layer at 1, 8, 64 tokens, ragged decode GEMMs on the live
#                 grid or not (about 250 s on an H100)
#   moe-fused-permute  scripts/ab_moe_plan.py fused_permute: Qwen3-30B-A3B's layer at 1024, 2048, 4096 tokens with the
#                 permute in the quantizer at any extra read against the planner's 16 MiB edge
#   grouped-masked  the masked layout at decode (R = 8, 64, 256, issue 36's expert shapes): zeroed rows past each
#                 expert's count, unwritten ones (masked_mosaic_live), and ragged; its bench run on an H100
#   moe           tests/test_moe.py, tests/test_moe_hardening.py and the routers' tests on the GPU (the layer on the
#                 real kernels against the reference; eager and jit bit-identical; about 330 s with 8 workers on an
#                 H100, past one call with the bench: MOE_SKIP_TESTS=1 leaves them out), then
#                 python -m jaxfp8 bench --ops=moe: the MoE layer step by step (route, sort, quantize, permute,
#                 gate_up, silu_quant, down, combine) with the non-GEMM share, and whole, beside the same layer in bf16
#                 on lax.ragged_dot and JAX's Pallas ragged dot, DeepSeek-V3 EP8 and Qwen3-30B-A3B at 1, 64, 4096
#                 tokens (MOE_BENCH_ARGS overrides, e.g. --tokens; stops between layers at 420 s)
#   router-ab     scripts/ab_router_kernel.py: the routers' Mosaic kernel, XLA's compare-and-count and merged forms
#                 on the same logits at T = 1 .. 4096 (the data behind routing.XLA_DEFAULT and MOSAIC_MIN_TOKENS)
#   valid-rows    valid_rows on the GPU: tests/test_gemm.py -k valid_rows (the masked kernel at M = 13, 130, 4096, a
#                 two-CTA persistent grid included), then python -m jaxfp8 bench --ops=valid_rows (a bucket with
#                 valid_rows live against the exact rows and the whole bucket; VALID_ROWS_ARGS overrides, e.g.
#                 --valid_rows_cases). Not yet run
#   linear-grad   python -m jaxfp8 bench --ops=linear_grad: forward + backward of the linear, FP8 against bf16, on the
#                 benchmarks' three weights at M = 1, 64, 1024, 4096 (LINEAR_GRAD_ARGS overrides)
#   notebooks     every notebook's code cells, unchanged, through scripts/run_notebook.py (the image has no Jupyter)
#   tune          python -m jaxfp8 tune: Triton GEMM configs -> $out/triton_gemm_h200.json, started from a copy of the
#                 shipped table so that its other entries stay (TUNE_ARGS overrides the shapes, M and --max_configs;
#                 copy the result into jaxfp8/gemm/configs/ by hand)
#   bench-gemm    python -m jaxfp8 bench --ops=gemm on the DeepSeek-V3/Qwen3 shapes (several minutes; set
#                 BENCH_GEMM_ARGS, e.g. --gemm_configs='mosaic:tile_m=128,tile_n=256,wg_split=N' to time explicit
#                 kernel configs beside the planner's)
#   bench-linear  python -m jaxfp8 bench --ops=linear on DeepSeek-V3 and Qwen3-32B at decode and prefill M
#                 (BENCH_LINEAR_ARGS overrides)
#   tp            python -m jaxfp8 tp over every visible GPU (needs 2 or more): column- and row-parallel
#                 DeepSeek-V3 linears checked against one GPU and timed against it (TP_ARGS; stops at 420 s)
#   fuzz-gpu      tests/test_fuzz.py with JAXFP8_FUZZ_PROFILE=gpu, TEST_WORKERS (default 8) xdist workers: every
#                 property at its full count (gemm_xla's 300 as six tests of 50, one per block size) in 172 s on one
#                 H200; JAXFP8_FUZZ_GPU_SCALE=0.5 halves the counts
#   reliability-determinism  scripts/determinism.py: 20 runs of every kernel, bit-identical (not timed yet)
#   reliability-sanitize     scripts/sanitize.sh: compute-sanitizer memcheck/racecheck/initcheck/synccheck over every
#                            kernel (slow: set SANITIZE_TOOLS="memcheck" etc. to split it over device calls)
#   correctness   every correctness check at once on one GPU, nothing timed (a 16-core H200 machine, ~9 min): the
#                 GPU-marked GEMM tests (-n 4), linear/weights/nn/sharding/extremes tests (-n 3), the GPU fuzz
#                 profile (-n 8, one worker per property), every notebook, determinism and all four
#                 compute-sanitizer tools (SANITIZE_JOBS, default 3, at once). The quantizer tests are left out (run
#                 tests-quant when pallas_kernels/quant_* change)
#   all           every phase above, in order (needs several device calls' worth of time: use phases)
# On a machine with several GPUs, pin phases with CUDA_VISIBLE_DEVICES and run them side by side, e.g. tests on GPU 0
# while GPU 1 times: (CUDA_VISIBLE_DEVICES=0 scripts/gpu_round.sh tests-all &); CUDA_VISIBLE_DEVICES=1 scripts/gpu_round.sh tune
# Logs, JUnit XML and JSON results go to $OUT (the device tool brings them back; ./gpu_out when unset).
# Each phase runs under `timeout` (PHASE_TIMEOUT seconds, default 540) so that a slow phase still leaves its log.
# The H200 image's python3 has jax 0.11.2, pytest and hypothesis; the project runs from the tree via PYTHONPATH.
set -u -o pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAXFP8_FAILURE_LOG=$out/failures.log  # every test failure, written as it happens (tests/conftest.py)
limit=${PHASE_TIMEOUT:-540}
status=0
run() {  # run NAME COMMAND...: log to $out/NAME.log, keep going on failure
  local name=$1; shift
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || { echo "=== $name exited $?"; status=1; }
  tail -n 15 "$out/$name.log"
}
background=()  # "name pid" of the jobs start_bg started
start_bg() {  # start_bg NAME COMMAND...: like run, in the background; wait_bg collects it
  local name=$1; shift
  echo "=== $name (background): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 &
  background+=("$name $!")
}
wait_bg() {
  local job name pid
  for job in "${background[@]}"; do
    read -r name pid <<< "$job"
    wait "$pid" || { echo "=== $name exited $?"; status=1; }
    echo "--- $name"; tail -n 8 "$out/$name.log"
  done
  background=()
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} > "$out/env.log" 2>&1
pytest_args=(-q -rs -p no:cacheprovider)
gemm_models=--models=deepseek_v3.q_proj_no_lora,deepseek_v3.dense_down,qwen3_32b.qkv_proj  # the benchmarks' shapes
# tests-all: one line per test as it finishes (-v; with -q they cancel out), so a run cut by its time limit still
# names its failures; short tracebacks at the end.
parallel_args=(-v --tb=short -rfs -p no:cacheprovider)
phases=("$@"); [[ ${#phases[@]} -eq 0 || ${phases[0]} == all ]] && \
  phases=(tests-quant tests-gemm tests-linear bench)
for phase in "${phases[@]}"; do
  case $phase in
    tests-all|tests-suite)
      # tests-all: the GEMM files' GPU tests beside the quantizer/linear group; tests-suite adds a third group at
      # once, the grouped/MoE files (the GPU tests of the kernel files, every MoE test).
      workers=${TEST_WORKERS:-4}
      start_bg tests_gemm python3 -m pytest tests/test_gemm.py tests/test_gemm_mosaic.py -m "gpu or hopper" \
        -n "$workers" "${parallel_args[@]}" --junitxml="$out/tests_gemm.junit.xml"
      start_bg tests_quant_linear python3 -m pytest tests/test_quant.py tests/test_quant_mosaic.py tests/test_linear.py \
        tests/test_weights.py tests/test_nn.py tests/test_sharding.py tests/test_extremes.py tests/test_edges.py \
        tests/test_transforms.py tests/test_grad.py tests/test_examples.py tests/test_validation.py \
        -n "$((workers + 2))" "${parallel_args[@]}" --junitxml="$out/tests_quant_linear.junit.xml"
      if [[ $phase == tests-suite ]]; then
        start_bg tests_moe python3 -m pytest tests/test_moe.py tests/test_moe_hardening.py tests/test_adversarial.py \
          tests/test_grouped.py tests/test_gather_rows.py -m "not slow" -n 3 "${parallel_args[@]}" \
          --junitxml="$out/tests_moe.junit.xml"
      fi
      wait_bg ;;
    tests-quant) run tests_quant python3 -m pytest tests/test_quant.py tests/test_quant_mosaic.py "${pytest_args[@]}" \
                   --junitxml="$out/tests_quant.junit.xml" ;;
    tests-gemm) run tests_gemm python3 -m pytest tests/test_gemm.py tests/test_gemm_mosaic.py -m "gpu or hopper" \
                  -n "${TEST_WORKERS:-4}" "${parallel_args[@]}" --junitxml="$out/tests_gemm.junit.xml" ;;
    tests-linear) run tests_linear python3 -m pytest tests/test_linear.py tests/test_weights.py tests/test_nn.py \
                    tests/test_sharding.py "${pytest_args[@]}" --junitxml="$out/tests_linear.junit.xml" ;;
    bench) run bench python3 -m jaxfp8 bench ${BENCH_ARGS:---ops=gemm,linear $gemm_models --m=1,16,64,256,1024,4096 \
             --time_budget_s=490} --out="$out/bench_h200.json" ;;
    bench-gemm-decode) run bench_gemm_decode python3 -m jaxfp8 bench --ops=gemm ${BENCH_ALL_ARGS:-$gemm_models} \
             --m=1,2,4,8,16,32,64,128,256 --time_budget_s=520 --out="$out/bench_gemm_decode_h200.json" ;;
    bench-gemm-prefill) run bench_gemm_prefill python3 -m jaxfp8 bench --ops=gemm ${BENCH_ALL_ARGS:-$gemm_models} \
             --m=512,1024,2048,4096,8192 --time_budget_s=520 --out="$out/bench_gemm_prefill_h200.json" ;;
    gemm-grid) # issue 37's grid: every dense weight of shapes.json at its 13 M beside cuBLAS blockwise; about 400
               # points, a few device calls: GRID_MODELS picks the models of one call (default the first two)
               run gemm_grid python3 -m jaxfp8 bench --ops=gemm --models=${GRID_MODELS:-deepseek_v3,qwen3_32b} \
                 --m=1,7,64,100,128,256,511,512,1000,1024,2048,3000,4096 --implementations=mosaic,triton,torch_scaled_mm \
                 --time_budget_s=${GRID_BUDGET_S:-500} --out="$out/gemm_grid_h200.json" ;;
    gemm-sweep) # the schedules a measured table picks from (jaxfp8/gemm/mosaic.py MEASURED_TABLES)
                sweep_configs=${SWEEP_CONFIGS:-"mosaic:tile_m=128,tile_n=128,max_concurrent_steps=3,k_blocks_per_step=2,num_compute_wgs=2,wg_split=M,epi_tile_n=16;mosaic:tile_m=64,tile_n=128,max_concurrent_steps=6,num_compute_wgs=2,wg_split=N;mosaic:tile_m=128,tile_n=256,max_concurrent_steps=4,num_compute_wgs=2,wg_split=N;mosaic:tile_m=64,tile_n=128,max_concurrent_steps=4,k_blocks_per_step=2,num_compute_wgs=1,persistent=false,weight_scales_ahead=true;mosaic:tile_m=64,tile_n=64,max_concurrent_steps=4,k_blocks_per_step=2,num_compute_wgs=1,persistent=false,weight_scales_ahead=true;mosaic:tile_m=192,tile_n=128,max_concurrent_steps=4,num_compute_wgs=3,cluster_dim=N,grid_tile_width=16;mosaic:tile_m=128,tile_n=128,max_concurrent_steps=3,k_blocks_per_step=2,num_compute_wgs=2,wg_split=M,epi_tile_n=16,persistent=false;mosaic:tile_m=256,tile_n=128,max_concurrent_steps=3,num_compute_wgs=2,wg_split=M"}
                sweep_shapes=${SWEEP_SHAPES:-"100,1536,7168;100,4096,7168;100,5120,8192;100,5120,25600;100,10240,5120;100,24576,1536;100,24576,7168;100,32768,512;100,36864,7168;100,51200,5120;128,10240,5120;128,24576,1536;128,24576,7168;128,32768,512;128,36864,7168;128,51200,5120;256,5120,8192;256,7168,2048;256,7168,16384;256,7168,18432;256,24576,1536;256,24576,7168;256,32768,512;256,36864,7168;256,51200,5120;512,4096,7168;512,7168,2048;512,24576,1536;512,24576,7168;512,32768,512;512,36864,7168;512,51200,5120;1000,7168,2048;1000,7168,16384;1000,7168,18432;1000,10240,5120;1000,24576,7168;1000,32768,512;1000,36864,7168;1000,51200,5120;3000,32768,512"}
                run gemm_sweep python3 -m jaxfp8 bench --ops=gemm --shapes="$sweep_shapes" \
                  --implementations=mosaic,torch_scaled_mm --gemm_configs="$sweep_configs" --seed=0 \
                  --time_budget_s=${SWEEP_BUDGET_S:-500} --out="$out/gemm_sweep.json"
                run mosaic_table python3 scripts/mosaic_table_from_sweep.py "$out/gemm_sweep.json" \
                  "${SWEEP_DEVICE:-NVIDIA H200}" "$out/mosaic_gemm_table.json" ;;
    bench-quant) run bench_quant python3 -m jaxfp8 bench --ops=quant ${BENCH_QUANT_ARGS:---k=512,2048,7168,18432 \
                   --m=1,16,64,256,1024,4096,16384} --out="$out/quant_h200.json" ;;
    bench-gemm) run bench_gemm python3 -m jaxfp8 bench --ops=gemm ${BENCH_GEMM_ARGS:-} --out="$out/gemm_h200.json" ;;
    grouped) run tests_grouped python3 -m pytest tests/test_grouped.py -m "gpu or hopper" "${pytest_args[@]}" \
               --junitxml="$out/tests_grouped.junit.xml"
             run bench_grouped python3 -m jaxfp8 bench --ops=grouped ${GROUPED_BENCH_ARGS:---time_budget_s=420} \
               --out="$out/grouped_h200.json" ;;
    grouped-blocks)
      # block sizes of 64 on both Mosaic GEMMs (tests), the grouped decode schedules in narrower column tiles beside
      # the planner's at R = 8 and 64, and the grouped GEMM at block sizes of 64
      run tests_block_sizes python3 -m pytest tests/test_grouped.py tests/test_gemm_mosaic.py -k gpu_block_sizes \
        -n 4 "${parallel_args[@]}" --junitxml="$out/tests_block_sizes.junit.xml"
      decode="max_concurrent_steps=6,k_blocks_per_step=2,num_compute_wgs=1,weight_scales_ahead=True"
      run bench_grouped_decode python3 -m jaxfp8 bench --ops=grouped --routed_rows=8,64 --seed=0 \
        --expert_shapes="qwen3_30b_a3b.gate_up;qwen3_30b_a3b.down;dsv3_ep8.gate_up;dsv3_ep8.down;qwen3_235b_a22b_ep8.gate_up" \
        --implementations=mosaic,masked_mosaic --time_budget_s=240 --out="$out/grouped_decode_sweep_h200.json" \
        --gemm_configs="mosaic:tile_m=64,tile_n=64,persistent=False,$decode;mosaic:tile_m=64,tile_n=32,persistent=False,$decode;masked_mosaic:tile_m=64,tile_n=64,live_grid=True,$decode"
      for bs in 64,64 128,64; do
        run "bench_grouped_block_${bs/,/x}" python3 -m jaxfp8 bench --ops=grouped --block_size=$bs --seed=0 \
          --expert_shapes="dsv3_ep8.gate_up;qwen3_30b_a3b.down" --routed_rows=8,4096 --implementations=mosaic \
          --time_budget_s=80 --out="$out/grouped_block_${bs/,/x}_h200.json"
      done ;;
    grouped-medium)
      # the ragged grouped GEMM at 1, 8 and 64 tokens of top-8 (R = 8, 64, 512) against schedule variants: the
      # decode tile on a persistent grid over the live items, 64x256 on two consumers (the tile the fused SiLU-and-mul
      # epilogue needs) off and on the persistent grid, 6 or 8 stages of one K block (explicit configs are not fitted to
      # shared memory: two K blocks a step in 8 stages, or on 64x256 tiles, overflow it)
      d="tile_m=64,tile_n=128,num_compute_wgs=1,weight_scales_ahead=True"
      w="tile_m=64,tile_n=256,num_compute_wgs=2,wg_split=N"
      run bench_grouped_medium python3 -m jaxfp8 bench --ops=grouped --routed_rows=8,64,512 --seed=0 \
        --expert_shapes="qwen3_30b_a3b.down;qwen3_30b_a3b.gate_up;dsv3_ep8.down;qwen3_235b_a22b_ep8.gate_up;dsv3_ep8.gate_up" \
        --implementations=mosaic --time_budget_s=200 --out="$out/grouped_medium_sweep_h200.json" \
        --gemm_configs="mosaic:$d,max_concurrent_steps=4,k_blocks_per_step=2,persistent=True,live_grid=True;mosaic:$w,max_concurrent_steps=4,k_blocks_per_step=1,persistent=False,weight_scales_ahead=True;mosaic:$d,max_concurrent_steps=6,k_blocks_per_step=1,persistent=False;mosaic:$d,max_concurrent_steps=8,k_blocks_per_step=1,persistent=False;mosaic:$w,max_concurrent_steps=4,k_blocks_per_step=1,persistent=True,live_grid=True" ;;
    blocks-64-dispatch)
      # block sizes of 64 on the Mosaic GEMMs against what the default dispatch runs them on today (the Triton dense
      # GEMM, XLA's grouped GEMM): the data behind gemm.mosaic.DEFAULT_BLOCK_SIZES
      for bs in 64,64 128,64; do
        run "bench_gemm_block_${bs/,/x}" python3 -m jaxfp8 bench --ops=gemm --block_size=$bs --seed=0 \
          --implementations=mosaic,triton --shapes="1,7168,2048;64,24576,7168;256,7168,18432;1024,7168,18432;4096,24576,7168" \
          --time_budget_s=90 --out="$out/gemm_block_${bs/,/x}_h200.json"
        run "bench_grouped_block_${bs/,/x}" python3 -m jaxfp8 bench --ops=grouped --block_size=$bs --seed=0 \
          --implementations=mosaic,xla --expert_shapes="dsv3_ep8.down;qwen3_30b_a3b.gate_up" --routed_rows=8,512,4096 \
          --time_budget_s=80 --out="$out/grouped_block_${bs/,/x}_h200.json"
      done ;;
    moe-live-grid)
      # the MoE layer at 1, 8 and 64 tokens with the ragged decode GEMMs on a persistent grid over the live items
      # (jaxfp8.grouped.mosaic.DECODE_LIVE_GRID["ragged"]) against a CTA per item, off / on / off in one process
      run moe_live_grid python3 scripts/ab_moe_plan.py live_grid "$out/moe_live_grid_h200.json" ;;
    moe-fused-permute)
      # the planner's edge for the permute inside the quantizer (jaxfp8.moe.planner.FUSED_PERMUTE_EXTRA_BYTES_MAX):
      # fused at any extra read against the edge, off / on / off in one process
      run moe_fused_permute python3 scripts/ab_moe_plan.py fused_permute "$out/moe_fused_permute_h200.json" ;;
    grouped-masked)
      # issue 36's masked layout at decode: with the rows past each expert's count zeroed (the planner's), without
      # them (masked_mosaic_live: those rows unwritten), and ragged, at the bench's T (each expert's capacity rounded
      # up to 64 rows)
      run bench_grouped_masked python3 -m jaxfp8 bench --ops=grouped --routed_rows=8,64,256 --seed=0 \
        --expert_shapes="qwen3_30b_a3b.gate_up;qwen3_30b_a3b.down;dsv3_ep8.gate_up;dsv3_ep8.down;qwen3_235b_a22b_ep8.gate_up" \
        --implementations=mosaic,masked_mosaic,masked_mosaic_live --time_budget_s=300 \
        --out="$out/grouped_masked_h200.json" ;;
    moe) [[ -n ${MOE_SKIP_TESTS:-} ]] || run tests_moe python3 -m pytest tests/test_moe.py tests/test_moe_hardening.py \
           tests/test_gather_rows.py tests/test_route_topk_mosaic.py tests/test_route_xla_merge.py "${pytest_args[@]}" \
           --junitxml="$out/tests_moe.junit.xml"
         run bench_moe python3 -m jaxfp8 bench --ops=moe ${MOE_BENCH_ARGS:---time_budget_s=420} \
           --out="$out/moe_h200.json" ;;
    router-ab) run router_ab python3 scripts/ab_router_kernel.py "$out/router_ab_h200.json" ;;
    valid-rows) run tests_valid_rows python3 -m pytest tests/test_gemm.py -k valid_rows "${pytest_args[@]}" \
                  --junitxml="$out/tests_valid_rows.junit.xml"
                run bench_valid_rows python3 -m jaxfp8 bench --ops=valid_rows ${VALID_ROWS_ARGS:-} \
                  --out="$out/valid_rows_h200.json" ;;
    linear-grad) run bench_linear_grad python3 -m jaxfp8 bench --ops=linear_grad \
                   ${LINEAR_GRAD_ARGS:-$gemm_models --m=1,64,1024,4096} --out="$out/linear_grad_h200.json" ;;
    notebooks) run notebooks python3 scripts/run_notebook.py notebooks/quickstart.ipynb notebooks/benchmarks.ipynb notebooks/moe.ipynb ;;
    tune) cp jaxfp8/gemm/configs/triton_gemm_h200.json "$out/triton_gemm_h200.json"
          run tune python3 -m jaxfp8 tune ${TUNE_ARGS:-} --out="$out/triton_gemm_h200.json" ;;
    bench-linear) run bench_linear python3 -m jaxfp8 bench --ops=linear \
                    ${BENCH_LINEAR_ARGS:---models=deepseek_v3,qwen3_32b --m=1,16,64,512,4096} --out="$out/linear_h200.json" ;;
    tp) run tp python3 -m jaxfp8 tp --out="$out/tp_h200.json" ${TP_ARGS:-} ;;
    fuzz-gpu) JAXFP8_FUZZ_PROFILE=gpu run fuzz_gpu python3 -m pytest tests/test_fuzz.py -n "${TEST_WORKERS:-8}" \
                "${parallel_args[@]}" --junitxml="$out/fuzz_gpu.junit.xml" ;;
    correctness)
      start_bg tests_gemm python3 -m pytest tests/test_gemm.py tests/test_gemm_mosaic.py -m "gpu or hopper" -n 4 \
        "${parallel_args[@]}" --junitxml="$out/tests_gemm.junit.xml"
      start_bg tests_linear python3 -m pytest tests/test_linear.py tests/test_weights.py tests/test_nn.py \
        tests/test_sharding.py tests/test_extremes.py -n 3 "${parallel_args[@]}" \
        --junitxml="$out/tests_linear.junit.xml"
      JAXFP8_FUZZ_PROFILE=gpu start_bg fuzz_gpu python3 -m pytest tests/test_fuzz.py -n 8 "${parallel_args[@]}" \
        --junitxml="$out/fuzz_gpu.junit.xml"
      start_bg notebooks python3 scripts/run_notebook.py notebooks/quickstart.ipynb notebooks/benchmarks.ipynb notebooks/moe.ipynb
      start_bg determinism python3 scripts/determinism.py "$out/determinism_h200.json"
      OUT=$out SANITIZE_JOBS=${SANITIZE_JOBS:-3} start_bg sanitize scripts/sanitize.sh ${SANITIZE_TOOLS:-}
      wait_bg ;;
    reliability-determinism) run determinism python3 scripts/determinism.py "$out/determinism_h200.json" ;;
    reliability-sanitize) OUT=$out run sanitize scripts/sanitize.sh ${SANITIZE_TOOLS:-} ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
exit $status
