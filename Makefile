# `make run`: the main job; `make test`: the CPU test suite. Both create .venv (Python >= 3.12) on first use.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $$(scripts/find_python.sh) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: run test gpu-round
run: $(VENV)/.installed
	$(PY) -m jaxfp8

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -p no:cacheprovider

# On the GPU machine (through the device tool): GPU tests, then the benchmarks, phase by phase (see the script).
gpu-round:
	scripts/gpu_round.sh all
