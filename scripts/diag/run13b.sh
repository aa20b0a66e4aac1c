#!/usr/bin/env bash
# one device call: transfer bench (kernel 1/2 SMs + w8 variant), staged layer_first, small load-backs
set -u
export PYTHONPATH=$PWD KVTIER_CACHE_DIR=/tmp/kvtier-cache
python3 -m kvtier.kernels.build > $OUT/build.txt 2>&1
timeout 100 python3 bench/small_loads.py --json $OUT/small.json > $OUT/small.txt 2>&1
grep -E "pages (kernel|staged)" $OUT/small.txt | cut -c12-140 | head -50
timeout 100 python3 bench/transfer.py --backend staged --layout layer_first --layout page_first --geometry llama3-8b-p16 --geometry dsv3-mla-p16 --blocks 2 --gib 0.5 --json $OUT/staged.json > $OUT/staged.txt 2>&1
grep -E "GB/s \(" $OUT/staged.txt | cut -c12-120
timeout 200 python3 bench/transfer.py --backend kernel --blocks 1,2 --gib 0.5 --variants 8x1024w8 --json $OUT/transfer.json > $OUT/transfer.txt 2>&1
grep -E "GB/s \(" $OUT/transfer.txt | cut -c12-120
