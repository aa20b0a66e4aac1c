#!/usr/bin/env bash
# one device call: the whole suite with the shm diagnostic plugin, then transfer bench (kernel, 1 and 2 SMs, w8 variant)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/scripts/diag KVTIER_CACHE_DIR=/tmp/kvtier-cache PATH=$PWD/.redis/bin:$PATH
ulimit -n > $OUT/ulimit.txt
python3 -m kvtier.kernels.build > $OUT/build.txt 2>&1
KVTIER_KERNELS=aot timeout 400 python3 -m pytest -q -p no:cacheprovider -p shmdiag -rf tests > $OUT/full.log 2>&1
tail -4 $OUT/full.log
KVTIER_KERNELS=aot timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "cuda and odd_shapes" 2>&1 | tail -3 | tee $OUT/sanitizer.log
