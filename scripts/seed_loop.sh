#!/bin/bash
# The whole CPU suite once per seed: scripts/seed_loop.sh TREE PYTHON LOG SEED... runs `pytest -n 2` in TREE (a
# worktree of the commit under test) with JAXFP8_TEST_SEED=SEED and appends one line per seed to LOG (each seed's
# full output goes to LOG.seedN). With JAXFP8_SEEDED_ONLY=1 in the environment, only the tests that draw from the
# seed run (tests/conftest.py); the others give one result for every seed.
tree=$1; py=$2; log=$3; shift 3
cd "$tree" || exit 2
echo "commit $(git rev-parse --short HEAD), $("$py" -c 'import jax; print("jax", jax.__version__)')${JAXFP8_SEEDED_ONLY:+, seeded tests only}" >> "$log"
for s in "$@"; do
  start=$(date +%s)
  JAXFP8_TEST_SEED=$s PYTHONPATH=$PWD "$py" -m pytest -q -p no:cacheprovider -n 2 > "$log.seed$s" 2>&1
  rc=$?
  echo "seed $s: rc=$rc $(tail -1 "$log.seed$s") ($(( $(date +%s) - start )) s)" >> "$log"
done
