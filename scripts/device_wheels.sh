#!/usr/bin/env bash
# Wheels for a GPU machine that has torch and cuda-bindings but no network: run this here, carry the folders to the
# machine, and scripts/gpu_check.sh installs whatever of them is missing there. Three folders, so that one call's
# carry stays under the device tool's 64 MiB:
#   .wheels           kvtier's pure-Python (and small binary) dependencies, and pytest-xdist
#   .wheels-mooncake  (--mooncake) Mooncake's CPU wheel and the Debian libraries it links (the mooncake phase)
#   .wheels-sglang    (--sglang) SGLang's wheel, tvm-ffi and ninja that build its JIT kernels, and the small packages
#                     its kernel modules import (the sglang phase's third side)
# PYTHON_VERSION: the machine's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
download() {
    local dir=$1; shift
    python3 -m pip download -q --no-deps -d "$dir" --python-version "${PYTHON_VERSION:-3.12}" --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_34_x86_64 "$@"
}
download .wheels redis hiredis xxhash prometheus-client rich markdown-it-py mdurl pygments pytest-xdist execnet
for option in "$@"; do
    case $option in
    --mooncake)
        download .wheels-mooncake 'mooncake-transfer-engine-non-cuda>=0.3.13'
        mkdir -p .wheels-mooncake/debs
        (cd .wheels-mooncake/debs && apt-get download libibverbs1 librdmacm1 libnuma1) ;;
    --sglang)
        download .wheels-sglang sglang==0.5.23 apache-tvm-ffi ninja msgspec orjson psutil pybase64 starlette anyio \
            sniffio pyzmq pydantic pydantic-core annotated-types typing-inspection pillow requests urllib3 idna certifi \
            charset-normalizer packaging ;;
    *) echo "unknown option $option (--mooncake, --sglang)" >&2; exit 2 ;;
    esac
done
du -sh .wheels*
