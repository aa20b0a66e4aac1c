#!/usr/bin/env bash
# The one command for a machine with an AMD GPU (MI300X, MI325X, MI355X...) and ROCm: builds the kernels for the
# device's targets, runs the whole suite with the GPU tests on the hip runtime (the same tests as on CUDA), the GPU
# tests again with hiprtc-compiled kernels, kvtier doctor, and the transfer benchmark. Logs land under $OUT
# (default /tmp/kvtier-amd); send them back with the issue. Usage, from the repository root:
#     bash scripts/amd_check.sh
# Nothing here has run on AMD hardware yet: expect the first run to find what the emulator's split mode and the
# compile-only CI could not (see docs/hip.md).
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-amd}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HIP_PLATFORM=amd
export KVTIER_RUNTIME=hip KVTIER_GPU_RUNTIME=hip KVTIER_CACHE_DIR=${KVTIER_CACHE_DIR:-/tmp/kvtier-cache}
status=0
{
    date -u
    (rocm-smi --showproductname || true) 2>&1
    (rocminfo | grep -E "Marketing Name|Name: +gfx" || true) 2>&1
    python3 -c 'import kvtier, sys; print("kvtier", kvtier.__version__, "python", sys.version.split()[0])'
    python3 -c 'import torch; print("torch", torch.__version__, "hip", torch.version.hip)' 2>&1 || true
} > "$OUT/machine.txt"
python3 -m kvtier.kernels.build --hip 2>&1 | tee -a "$OUT/machine.txt" || status=1
python3 -m kvtier --runtime hip doctor 2>&1 | tee "$OUT/doctor.txt" || status=1
python3 -m kvtier --runtime hip doctor --json > "$OUT/doctor.json" 2>>"$OUT/doctor.txt" || status=1
KVTIER_KERNELS=aot python3 -m pytest -q -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/pytest-hip.log" || status=1
KVTIER_KERNELS=jit python3 -m pytest -q -p no:cacheprovider -m gpu tests/transfer/test_round_trips.py tests/kernels/test_build_and_launch.py \
    tests/transfer/test_layer_signals.py 2>&1 | tee "$OUT/pytest-hip-jit.log" || status=1
python3 bench/transfer.py --runtime hip --quick --json "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.txt" \
    || status=1
echo "logs in $OUT (exit $status)"
exit $status
