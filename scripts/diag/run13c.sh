#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:$PWD/scripts/diag KVTIER_CACHE_DIR=/tmp/kvtier-cache PATH=$PWD/.redis/bin:$PATH
python3 -m kvtier.kernels.build > $OUT/build.txt 2>&1
KVTIER_KERNELS=aot timeout 360 python3 -m pytest -q -p no:cacheprovider -p shmdiag -rf tests > $OUT/full.log 2>&1
tail -4 $OUT/full.log
export PYTHONPATH=$PWD:/tmp/site
KVTIER_KERNELS=aot timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_layer_signals.py -k "cuda and (odd_shapes or counter or layer)" 2>&1 | tail -3 | tee $OUT/sanitizer.log
timeout 60 python3 bench/small_loads.py --json $OUT/small.json > $OUT/small.txt 2>&1
grep -E "pages (kernel|staged)" $OUT/small.txt | cut -c12-120 | grep -v staged
timeout 60 python3 bench/transfer.py --backend kernel --blocks 2 --gib 0.5 --geometry llama3-8b-p16 --geometry dsv3-mla-p16 --json $OUT/transfer.json > $OUT/transfer.txt 2>&1
grep -E "GB/s \(" $OUT/transfer.txt | cut -c12-100
