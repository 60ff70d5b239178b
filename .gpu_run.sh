#!/usr/bin/env bash
# one-off device run (not committed): the GPU check, then the test suite in 4 shards
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
mkdir -p $OUT/check $OUT/tests
bash scripts/gpu_check.sh --budget ${CHECK_BUDGET:-370} $OUT/check > $OUT/check/stdout.log 2>&1
echo "check rc=$?"; tail -15 $OUT/check/stdout.log
python3 -c 'import pytest, expecttest; print("pytest", pytest.__version__)' || exit 0
export OMP_NUM_THREADS=2
files=$(ls tests/test_*.py | grep -v test_model_coverage)
i=0; for f in $files; do echo $f >> $OUT/tests/shard$((i % 6)).txt; i=$((i+1)); done
echo tests/test_model_coverage.py >> $OUT/tests/shard5.txt
for s in 0 1 2 3 4 5; do
  timeout -s INT ${TEST_SECONDS:-170} python3 -m pytest $(cat $OUT/tests/shard$s.txt) -q -p no:cacheprovider -rfEs > $OUT/tests/shard$s.log 2>&1 &
done
wait
for s in 0 1 2 3 4 5; do echo "== shard $s"; tail -25 $OUT/tests/shard$s.log; done
