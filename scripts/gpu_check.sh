#!/usr/bin/env bash
# One call on the GPU machine: the whole test suite (emulated and cuda), kvtier doctor, and the benchmarks.
# Logs land under $OUT (the device tool brings them back). Usage: bash scripts/gpu_check.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0
# Reserve 1 GiB of huge pages on the throwaway VM (host setting, not the card's) so hugetlb is tested, not skipped.
if [ "$(cat /proc/sys/vm/nr_hugepages 2>/dev/null)" = 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
    echo 512 > /proc/sys/vm/nr_hugepages || true
fi
{ nvidia-smi; python3 -c 'import torch, cuda.bindings; print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__)'; } \
    > "$OUT/machine.txt" 2>&1
grep -i '^HugePages_' /proc/meminfo >> "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider -rs "$@" tests 2>&1 | tee "$OUT/pytest.log" || status=1
python3 -m kvtier --runtime cuda doctor 2>&1 | tee "$OUT/doctor.txt" || status=1
python3 -m kvtier --runtime cuda doctor --json > "$OUT/doctor.json" 2>"$OUT/doctor-json.err" || status=1
for bench in bench/*.py; do
    [ -e "$bench" ] || continue
    python3 "$bench" 2>&1 | tee "$OUT/$(basename "$bench" .py).txt" || status=1
done
exit $status
