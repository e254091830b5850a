# `make run`: the main job (each op on real-model shapes against the float64 reference, one table); `make test`: the
# CPU test suite (incl. every notebook); `make bench-cpu`: the benchmark command on a tiny shape list. All create .venv (Python >= 3.12, the newest JAX the supported range admits) on first
# use. `make test-jax-0.11`: the same suite in .venv-jax0.11 against the oldest JAX of the range (CI runs both).
VENV := .venv
PY := $(VENV)/bin/python
OLDEST_JAX := 0.11.2
OLD_VENV := .venv-jax0.11
OLD_PY := $(OLD_VENV)/bin/python
# One seed for a whole run, printed first (and in pytest's header): JAXFP8_TEST_SEED=<seed> make test reproduces it.
define run_suite
@seed=$${JAXFP8_TEST_SEED:-$$($(1) -c 'import secrets; print(secrets.randbelow(2**32))')}; \
echo "JAXFP8_TEST_SEED=$$seed ($$($(1) -c 'import jax; print("jax", jax.__version__)'))"; \
JAXFP8_TEST_SEED=$$seed XLA_FLAGS="$(SUITE_XLA_FLAGS) $$XLA_FLAGS" $(1) -m pytest -q -n 2 -p no:cacheprovider $(HANG_GUARD)
endef
# The suite's programs are tiny and mostly run once: XLA's CPU backend without LLVM's optimizations compiles them
# about a fifth faster (XLA's CPU fast-math stays off at every level). Subprocesses inherit it.
SUITE_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
# A test still running after 5 minutes has every thread's stack printed; after 10 its worker is killed and the test
# runs once more in a fresh worker (the longest test takes under 2 minutes on 2 CPU cores). Failures are never rerun
# (--rerun-except matches every one): only a killed or crashed worker's test is.
HANG_GUARD := -rfER -o faulthandler_timeout=300 --timeout=600 --timeout-method=thread --reruns=1 --rerun-except=.
# A tiny shape list: seconds on CPU, only to exercise `python -m jaxfp8 bench` (CPU times say nothing about GPUs).
BENCH_CPU_SHAPES := 1,256,512;16,256,512;8,512,1024

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $$(scripts/find_python.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(OLD_VENV)/.installed: pyproject.toml
	test -x $(OLD_PY) || $$(scripts/find_python.sh) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip
	$(OLD_PY) -m pip install -q -e '.[test]' 'jax==$(OLDEST_JAX)' 'jaxlib==$(OLDEST_JAX)'
	touch $@

# scripts/xla_gpu_kernels.py: XLA's GPU compiler on this machine, for an H100/H200 it does not have (JAX and the CUDA
# plugin's compile-only topology; no CUDA libraries needed).
GPU_OFFLINE_JAX := 0.12.1
.venv-gpu-offline/.installed: pyproject.toml
	test -x .venv-gpu-offline/bin/python || $$(scripts/find_python.sh) -m venv .venv-gpu-offline
	.venv-gpu-offline/bin/python -m pip install -q -e . 'jax==$(GPU_OFFLINE_JAX)' 'jaxlib==$(GPU_OFFLINE_JAX)' \
	  'jax-cuda13-plugin==$(GPU_OFFLINE_JAX)' 'jax-cuda13-pjrt==$(GPU_OFFLINE_JAX)'
	touch $@

.PHONY: run test test-jax-0.11 bench-cpu plots notebooks gpu-round
run: $(VENV)/.installed
	$(PY) -m jaxfp8

test: $(VENV)/.installed
	$(call run_suite,$(PY))

test-jax-0.11: $(OLD_VENV)/.installed
	$(call run_suite,$(OLD_PY))

bench-cpu: $(VENV)/.installed
	$(PY) -m jaxfp8 bench --shapes='$(BENCH_CPU_SHAPES)' --iterations=3 --out=build/bench_cpu.json
	$(PY) -m jaxfp8 plot --json=build/bench_cpu.json --out=build/bench_cpu.png

# The PNG beside every committed results JSON, regenerated from the JSON alone (tests/test_bench.py checks that every
# JSON of bench or tp has one).
plots: $(VENV)/.installed
	for json in benchmarks/*.json; do png=$${json%.json}.png; [ -e "$$png" ] || continue; \
	  $(PY) -m jaxfp8 plot --json=$$json --out=$$png || exit 1; done

# Rewrite notebooks/*.ipynb (outputs stripped) from notebooks/make_notebooks.py.
notebooks: $(VENV)/.installed
	$(PY) notebooks/make_notebooks.py

# On the GPU machine (through the device tool): GPU tests, then the benchmarks, phase by phase (see the script).
gpu-round:
	scripts/gpu_round.sh all
