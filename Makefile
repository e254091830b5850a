# `make run`: the main job; `make test`: the CPU test suite (incl. both notebooks); `make bench-cpu`: the benchmark
# command on a tiny shape list. All create .venv (Python >= 3.12) on first use.
VENV := .venv
PY := $(VENV)/bin/python
# A tiny shape list: seconds on CPU, only to exercise `python -m jaxfp8 bench` (CPU times say nothing about GPUs).
BENCH_CPU_SHAPES := 1,256,512;16,256,512;8,512,1024

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $$(scripts/find_python.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: run test bench-cpu plots notebooks gpu-round
run: $(VENV)/.installed
	$(PY) -m jaxfp8

# One seed for the whole run, printed first (and in pytest's header): JAXFP8_TEST_SEED=<seed> make test reproduces it.
test: $(VENV)/.installed
	@seed=$${JAXFP8_TEST_SEED:-$$($(PY) -c 'import secrets; print(secrets.randbelow(2**32))')}; \
	echo "JAXFP8_TEST_SEED=$$seed"; \
	JAXFP8_TEST_SEED=$$seed $(PY) -m pytest -q -n 2 -p no:cacheprovider

bench-cpu: $(VENV)/.installed
	$(PY) -m jaxfp8 bench --shapes='$(BENCH_CPU_SHAPES)' --iterations=3 --out=build/bench_cpu.json
	$(PY) -m jaxfp8 plot --json=build/bench_cpu.json --out=build/bench_cpu.png

# The PNG beside every committed results JSON, regenerated from the JSON alone.
plots: $(VENV)/.installed
	for json in benchmarks/bench_*.json benchmarks/quant_*.json benchmarks/tp_*.json; do $(PY) -m jaxfp8 plot --json=$$json --out=$${json%.json}.png || exit 1; done

# Rewrite notebooks/*.ipynb (outputs stripped) from notebooks/make_notebooks.py.
notebooks: $(VENV)/.installed
	$(PY) notebooks/make_notebooks.py

# On the GPU machine (through the device tool): GPU tests, then the benchmarks, phase by phase (see the script).
gpu-round:
	scripts/gpu_round.sh all
