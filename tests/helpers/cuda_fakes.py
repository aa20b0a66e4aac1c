"""A CudaRuntime over a fake driver: ``CudaRuntime``'s copy paths driven on a machine without a GPU."""

from __future__ import annotations

import ctypes
import threading
import types

import kvtier.runtime.cuda as cuda_module
from kvtier.runtime.base import Runtime

MAX_PITCH = (1 << 31) - 1   # cudaDevAttrMaxPitch (deviceQuery's "Maximum memory pitch") on every current NVIDIA GPU


class FakeCudart:
    """Just enough of cuda-bindings' runtime module for ``CudaRuntime.memcpy_runs_async``: every copy is performed
    at the call, in the order the calls are made (the most favourable order a stream and a batch could give), and a
    2D copy is refused as the CUDA documentation says (cudaMemcpy2DAsync "returns an error if dpitch or spitch is
    greater than the maximum allowed"; width must not exceed either pitch)."""

    INVALID_PITCH = 12   # cudaErrorInvalidPitchValue

    def __init__(self) -> None:
        self.cudaError_t = types.SimpleNamespace(cudaSuccess=0, cudaErrorNotSupported=801,
                                                 cudaErrorCallRequiresNewerDriver=36)
        self.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyDefault=4)
        self.cudaStreamCaptureStatus = types.SimpleNamespace(cudaStreamCaptureStatusNone=0)
        self.cudaMemcpySrcAccessOrder = types.SimpleNamespace(cudaMemcpySrcAccessOrderStream=1)
        self.calls: list[tuple] = []

    def cudaGetErrorName(self, status):  # noqa: N802 (the driver's names)
        return 0, b"cudaErrorInvalidPitchValue" if status == self.INVALID_PITCH else b"cudaError%d" % status

    def cudaGetErrorString(self, status):  # noqa: N802
        return 0, b"invalid pitch argument" if status == self.INVALID_PITCH else b"error"

    def cudaStreamIsCapturing(self, native):  # noqa: N802
        return 0, 0

    def cudaMemcpyAttributes(self):  # noqa: N802
        return types.SimpleNamespace()

    def cudaMemcpyAsync(self, dst, src, n, kind, native):  # noqa: N802
        self.calls.append(("1d", n))
        ctypes.memmove(dst, src, n)
        return (0,)

    def cudaMemcpy2DAsync(self, dst, dst_pitch, src, src_pitch, width, height, kind, native):  # noqa: N802
        self.calls.append(("2d", dst_pitch, src_pitch, width, height))
        if max(dst_pitch, src_pitch) > MAX_PITCH or width > min(dst_pitch, src_pitch):
            return (self.INVALID_PITCH,)
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
        return (0,)

    def cudaMemcpyBatchAsync(self, dsts, srcs, counts, n, attrs, attr_index, n_attrs, native):  # noqa: N802
        self.calls.append(("batch", n))
        for d, s, c in zip(dsts, srcs, counts, strict=True):
            ctypes.memmove(d, s, c)
        return (0,)


def fake_runtime(monkeypatch, fake: FakeCudart) -> cuda_module.CudaRuntime:
    """A CudaRuntime of one device whose driver is ``fake``."""
    monkeypatch.setattr(cuda_module, "_bindings", lambda: fake)
    runtime = object.__new__(cuda_module.CudaRuntime)
    Runtime.__init__(runtime)
    runtime._cudart, runtime._memcpy_default, runtime._batch_supported, runtime._count = fake, 4, True, 1
    runtime._detours, runtime._detour_lock = {}, threading.Lock()
    return runtime
