"""A tiny real kernel for the tests: ``dst[i] = src[i] ^ key`` on one device.

On the emulator it is a Python reference kernel that goes through the device's address map; on CUDA it is a torch
elementwise kernel over raw device addresses. Either way the device itself dereferences the addresses, which is what
exposes a CPU address handed to a kernel. (A plain copy would not: torch turns it into a copy-engine memcpy.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.memory import DeviceAddress
from kvtier.runtime import Runtime


def _xor_kernel(memory: Any, dst: int, src: int, nbytes: int, key: int) -> None:
    memory.view(dst, nbytes)[:] = memory.view(src, nbytes) ^ np.uint8(key)


class _CudaArray:
    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def xor_copy(runtime: Runtime, dst: DeviceAddress | int, src: DeviceAddress | int, nbytes: int, key: int,
             device: int) -> None:
    """Run the kernel on ``device``; raw ints are allowed here on purpose, to hand a kernel a CPU address."""
    dst_value = dst.value if isinstance(dst, DeviceAddress) else dst
    src_value = src.value if isinstance(src, DeviceAddress) else src
    if runtime.runs_python_kernels:
        runtime.run_python(_xor_kernel, dst_value, src_value, nbytes, key, device=device)  # type: ignore[attr-defined]
        return
    import torch

    with torch.cuda.device(device):
        out = torch.as_tensor(_CudaArray(dst_value, nbytes), device=f"cuda:{device}")
        source = torch.as_tensor(_CudaArray(src_value, nbytes), device=f"cuda:{device}")
        torch.bitwise_xor(source, key, out=out)
        torch.cuda.synchronize(device)


def random_bytes(nbytes: int) -> np.ndarray:
    """Fresh random data, never zeros: a test on zeros cannot tell an unwritten output from a right one."""
    data = np.random.default_rng().integers(1, 256, nbytes, dtype=np.uint8)
    return data
