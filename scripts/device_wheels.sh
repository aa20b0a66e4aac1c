#!/usr/bin/env bash
# Wheels of kvtier's pure-Python (and small binary) dependencies for a GPU machine that has torch and cuda-bindings
# but no network: `bash scripts/device_wheels.sh` here, then carry `.wheels` to the machine, where
# scripts/gpu_check.sh installs whatever of them is missing. PYTHON_VERSION: the machine's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps -d .wheels --python-version "${PYTHON_VERSION:-3.12}" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    redis hiredis xxhash prometheus-client rich markdown-it-py mdurl pygments
# --mooncake: also Mooncake's CPU wheel (46 MB) and the Debian libraries it links (the mooncake phase of gpu_check.sh).
if [[ "${1:-}" == --mooncake ]]; then
    python3 -m pip download -q --no-deps -d .wheels --python-version "${PYTHON_VERSION:-3.12}" --only-binary=:all: \
        --platform manylinux_2_28_x86_64 'mooncake-transfer-engine-non-cuda>=0.3.13'
    mkdir -p .wheels/debs
    (cd .wheels/debs && apt-get download libibverbs1 librdmacm1 libnuma1)
fi
ls .wheels
