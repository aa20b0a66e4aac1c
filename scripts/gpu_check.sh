#!/usr/bin/env bash
# One call on the GPU machine: AOT build, the suite with AOT and with JIT kernels, a compute-sanitizer memcheck
# over the kernel tests, the copy-across-registrations probe, kvtier doctor, the benchmarks, and the batched-memcpy
# probe. Logs land under $OUT (the device tool brings them back; it takes 8 files at most, so pick PHASES to fit).
# PHASES picks a subset, e.g. PHASES="build tests" bash scripts/gpu_check.sh; BENCH_ARGS goes to bench/transfer.py,
# TESTS narrows the AOT suite (default: tests), ENQUEUE_ARGS to bench/enqueue.py, DEMO_ARGS to kvtier demo, CACHE_ARGS to bench/cache.py (data plane),
# STORAGE_ARGS to bench/storage.py (MOONCAKE_STORAGE_ARGS in the mooncake phase, DISAGG_ARGS to bench/disagg.py), FAMILY_ARGS to bench/families.py (model-family pools, HiSparse), SMALL_ARGS to bench/small_loads.py, BOTH_ARGS to bench/bidirectional.py, GEMM_ARGS to bench/gemm_beside.py, SGLANG_ARGS to bench/sglang_compat.py (phase dmaq: bench/dma_queue.py), E2E_ARGS to bench/e2e.py (the transformers TTFT benchmark), OVERLAP_ARGS to bench/overlap_probe.py (phase overlap), VLLM_ARGS to bench/vllm_connector.py --worker (the vLLM connector's worker path). The storage phase
# needs redis-server on PATH and redis-py importable.
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}
PHASES=${PHASES:-"build tests jit sanitizer spans doctor bench both gemm families small enqueue demo cache limits storage mooncake e2e sglang sglang_kernel_tests dmaq vllm"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export KVTIER_CACHE_DIR=/tmp/kvtier-cache
status=0
want() { [[ " $PHASES " == *" $1 "* ]]; }
# Dependencies the machine's image lacks (redis-py, seen 2026-12-05), from wheels carried in .wheels
# (scripts/device_wheels.sh); already installed ones are kept.
if [ -d .wheels ]; then
    python3 -m pip install -q --no-index --find-links .wheels redis hiredis xxhash prometheus-client rich pytest-xdist \
        > "$OUT/wheels.txt" 2>&1 || status=1
fi
# Mooncake (the mooncake phase): its CPU wheel and Debian's RDMA/NUMA libraries it links, carried in .wheels-mooncake
# (scripts/device_wheels.sh --mooncake), unpacked beside the system's rather than over it.
if want mooncake && [ -d .wheels-mooncake ]; then
    python3 -m pip install -q --no-index --find-links .wheels-mooncake mooncake-transfer-engine-non-cuda \
        >> "$OUT/wheels.txt" 2>&1 || status=1
    for deb in .wheels-mooncake/debs/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/kvtier-debs; done
    export LD_LIBRARY_PATH="/tmp/kvtier-debs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# Reserve 1 GiB of huge pages on the throwaway VM (host setting, not the card's) so hugetlb is tested, not skipped.
if [ "$(cat /proc/sys/vm/nr_hugepages 2>/dev/null)" = 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
    echo 512 > /proc/sys/vm/nr_hugepages || true
fi
{ nvidia-smi; python3 -c 'import torch, cuda.bindings; print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__)'; } \
    > "$OUT/machine.txt" 2>&1
grep -i '^HugePages_' /proc/meminfo >> "$OUT/machine.txt"
if want build; then
    python3 -m kvtier.kernels.build 2>&1 | tee -a "$OUT/machine.txt" || status=1
fi
if want tests; then
    KVTIER_KERNELS=aot python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests} 2>&1 | tee "$OUT/pytest-aot.log" \
        || status=1
fi
if want jit; then
    KVTIER_KERNELS=jit python3 -m pytest -q -p no:cacheprovider -m gpu tests/transfer/test_round_trips.py tests/kernels/test_build_and_launch.py \
        tests/transfer/test_layer_signals.py 2>&1 \
        | tee "$OUT/pytest-jit.log" || status=1
fi
if want sanitizer; then
    # --show-backtrace device: a host backtrace makes compute-sanitizer keep the Python frame that queued each
    # launch (and every tensor in it) for the life of the process, so a HostBuffer's views never die in the tests.
    KVTIER_KERNELS=aot compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace device --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider \
        -m gpu tests/transfer/test_round_trips.py tests/kernels/test_build_and_launch.py -k "cuda and (kernel and fp8 or odd_shapes)" 2>&1 \
        | tail -40 | tee "$OUT/sanitizer.log" || status=1
    KVTIER_KERNELS=aot compute-sanitizer --tool memcheck --report-api-errors no --show-backtrace device --error-exitcode 99 python3 -m pytest -q \
        -p no:cacheprovider -m gpu tests/pools/test_families.py tests/transfer/test_hisparse.py tests/transfer/test_layer_signals.py tests/compat/test_kvcacheio.py -k cuda 2>&1 | tail -15 \
        | tee -a "$OUT/sanitizer.log" || status=1
fi
if want spans; then
    python3 bench/registration_span.py --json "$OUT/registration_span.json" 2>&1 | tee "$OUT/registration_span.txt" \
        || status=1
fi
if want doctor; then
    python3 -m kvtier --runtime cuda doctor 2>&1 | tee "$OUT/doctor.txt" || status=1
    python3 -m kvtier --runtime cuda doctor --json > "$OUT/doctor.json" || status=1
fi
if want bench; then
    for bench in bench/transfer.py; do
        [ -e "$bench" ] || continue
        python3 "$bench" ${BENCH_ARGS:-} --json "$OUT/$(basename "$bench" .py).json" 2>&1 \
            | tee "$OUT/$(basename "$bench" .py).txt" || status=1
    done
fi
if want both; then
    python3 bench/bidirectional.py ${BOTH_ARGS:-} --json "$OUT/bidirectional.json" 2>&1 | tee "$OUT/bidirectional.txt" \
        || status=1
fi
if want gemm; then
    python3 bench/gemm_beside.py ${GEMM_ARGS:-} --json "$OUT/gemm_beside.json" 2>&1 | tee "$OUT/gemm_beside.txt" \
        || status=1
fi
if want sglang; then
    # SGLang's own HiCache kernels as a third side: its wheel, tvm-ffi and ninja (they build the kernels with nvcc)
    # and the small packages its kernel module imports, carried in .wheels-sglang (scripts/device_wheels.sh
    # --sglang), installed apart so that only this phase sees them.
    sglang_env=()
    if [ -d .wheels-sglang ]; then
        python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/kvtier-sglang .wheels-sglang/*.whl \
            >> "$OUT/wheels.txt" 2>&1 || status=1
        sglang_env=(env "PYTHONPATH=$PYTHONPATH:/tmp/kvtier-sglang" "PATH=/tmp/kvtier-sglang/bin:$PATH")
    fi
    # torch's default stream, then a side stream of the compat calls' own (SGLang's HiCache uses side streams)
    "${sglang_env[@]}" python3 bench/sglang_compat.py ${SGLANG_ARGS:-} --json "$OUT/sglang_compat.json" 2>&1 \
        | tee "$OUT/sglang_compat.txt" || status=1
    "${sglang_env[@]}" python3 bench/sglang_compat.py ${SGLANG_ARGS:-} --stream side \
        --json "$OUT/sglang_compat_side.json" 2>&1 | tee "$OUT/sglang_compat_side.txt" || status=1
fi
if want sglang_kernel_tests; then
    # SGLang's own kvcacheio test against kvtier.compat.sglang.kvcacheio, through the sgl_kernel shim
    # (scripts/sgl_kernel_shim/README.md): a copy of the test carried in .external/sglang, its CUDA-13 skip removed.
    if [ -f .external/sglang/test_kvcacheio.py ]; then
        mkdir -p /tmp/kvtier-sgl-test
        sed 's/    _cuda_major >= 13, reason=/    False, reason=/' .external/sglang/test_kvcacheio.py \
            > /tmp/kvtier-sgl-test/test_kvcacheio.py
        grep -q "    False, reason=" /tmp/kvtier-sgl-test/test_kvcacheio.py || echo "the CUDA-13 skip was not found" >&2
        PYTHONPATH="$PWD/scripts/sgl_kernel_shim:$PYTHONPATH" python3 -m pytest -q -p no:cacheprovider -rfEs \
            --rootdir /tmp/kvtier-sgl-test /tmp/kvtier-sgl-test/test_kvcacheio.py \
            > "$OUT/sglang_kvcacheio_tests.txt" 2>&1 || status=1
        tail -3 "$OUT/sglang_kvcacheio_tests.txt"
    else
        echo "sglang_kernel_tests: .external/sglang/test_kvcacheio.py is missing (carry it)" | tee "$OUT/sglang_kvcacheio_tests.txt"
        status=1
    fi
fi
if want dmaq; then
    python3 bench/dma_queue.py --json "$OUT/dma_queue.json" 2>&1 | tee "$OUT/dma_queue.txt" || status=1
fi
if want families; then
    python3 bench/families.py ${FAMILY_ARGS:-} --json "$OUT/families.json" 2>&1 | tee "$OUT/families.txt" || status=1
fi
if want small; then
    python3 bench/small_loads.py ${SMALL_ARGS:-} --json "$OUT/small_loads.json" 2>&1 | tee "$OUT/small_loads.txt" \
        || status=1
fi
if want enqueue; then
    python3 bench/enqueue.py ${ENQUEUE_ARGS:-} 2>&1 | tee "$OUT/enqueue.txt" || status=1
fi
if want demo; then
    python3 -m kvtier --runtime cuda demo ${DEMO_ARGS:-} --save "$OUT/demo.json" 2>&1 | tee "$OUT/demo.txt" || status=1
fi
if want cache; then
    python3 bench/cache.py --runtime cuda --no-control --data ${CACHE_ARGS:-} --json "$OUT/cache.json" 2>&1 \
        | tee "$OUT/cache.txt" || status=1
fi
if want storage; then
    store=$(mktemp -d)
    {
        python3 -m kvtier --runtime cuda demo --storage "file:$store" ${DEMO_ARGS:-} --save "$OUT/demo-storage-1.json" &&
        python3 -m kvtier --runtime cuda demo --storage "file:$store" ${DEMO_ARGS:-} --save "$OUT/demo-storage-2.json" &&
        python3 -m kvtier storage ls "file:$store"
    } 2>&1 | tee "$OUT/demo-storage.txt" || status=1
    rm -rf "$store"
    python3 bench/storage.py --runtime cuda ${STORAGE_ARGS:-} --json "$OUT/storage.json" 2>&1 | tee "$OUT/storage.txt" \
        || status=1
fi
if want overlap; then
    python3 bench/overlap_probe.py ${OVERLAP_ARGS:-} --json "$OUT/overlap_probe.json" 2>&1 | tee "$OUT/overlap_probe.txt" \
        || status=1
fi
if want e2e; then
    python3 bench/e2e.py ${E2E_ARGS:-} --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" || status=1
fi
if want mooncake; then
    # A Mooncake Store on loopback (master + a segment holder lending 16 GB), its tests on the CUDA runtime, the
    # storage rows beside the file store's, the prefill -> decode transfer benchmark.
    mooncake_dir=$(mktemp -d)
    eval "$(PYTHON=python3 bash scripts/mooncake_servers.sh start "$mooncake_dir" "16 GB")"
    KVTIER_REQUIRE_MOONCAKE=1 python3 -m pytest -q -p no:cacheprovider -rs tests/storage/test_mooncake.py tests/disagg \
        tests/cache/test_hybrid_storage.py tests/storage/test_state_snapshots.py -k "mooncake or disagg or Mooncake" \
        2>&1 | tail -30 | tee "$OUT/pytest-mooncake.log" || status=1
    python3 bench/storage.py --runtime cuda --stores file,mooncake --mooncake "$KVTIER_MOONCAKE_SPEC" \
        ${MOONCAKE_STORAGE_ARGS:-} --json "$OUT/storage-mooncake.json" 2>&1 | tail -30 | tee "$OUT/storage-mooncake.txt" \
        || status=1
    [ -e bench/disagg.py ] && { python3 bench/disagg.py ${DISAGG_ARGS:-} --json "$OUT/disagg.json" 2>&1 | tail -30 \
        | tee "$OUT/disagg.txt" || status=1; }
    bash scripts/mooncake_servers.sh stop "$mooncake_dir"
fi
if want vllm; then
    python3 bench/vllm_connector.py --worker ${VLLM_ARGS:-} --json "$OUT/vllm_connector.json" 2>&1 \
        | tee "$OUT/vllm_connector.txt" || status=1
fi
if want limits; then
    python3 bench/batch_limits.py 2>&1 | tee "$OUT/batch_limits.txt" || status=1
fi
exit $status
