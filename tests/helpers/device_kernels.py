"""A tiny real kernel for the tests: ``dst[i] = src[i] ^ key`` on one device.

On the emulator it is a program whose Python reference goes through the device's address map; on CUDA it is a torch
elementwise kernel over raw device addresses. Either way the device itself dereferences the addresses, which is what
exposes a CPU address handed to a kernel. (A plain copy would not: torch turns it into a copy-engine memcpy.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.memory import DeviceAddress
from kvtier.runtime import ProgramSpec, Runtime, i64


def _xor_kernel(memory: Any, dst: int, src: int, nbytes: int, key: int) -> None:
    memory.view(dst, nbytes)[:] = memory.view(src, nbytes) ^ np.uint8(key)


def _no_image(capability: tuple[int, int]) -> tuple[bytes, str]:
    raise NotImplementedError("the xor test kernel runs through torch on CUDA")


XOR = ProgramSpec("test-xor", ("xor",), _no_image, {"xor": _xor_kernel})


def _touch_kernel(memory: Any, address: int, nbytes: int) -> None:
    memory.view(address, nbytes)[:] = 1


TOUCH = ProgramSpec("test-touch", ("touch",), _no_image, {"touch": _touch_kernel})
"""Writes ones at an address: the smallest kernel that faults when handed an address its device cannot reach."""


class _CudaArray:
    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def xor_copy(runtime: Runtime, dst: DeviceAddress | int, src: DeviceAddress | int, nbytes: int, key: int,
             device: int) -> None:
    """Run the kernel on ``device`` and wait; raw ints are allowed here on purpose, to hand a kernel a CPU address
    (as a DeviceAddress that lies about its domain, which is what bypassing the resolver amounts to)."""
    dst_value = dst.value if isinstance(dst, DeviceAddress) else dst
    src_value = src.value if isinstance(src, DeviceAddress) else src
    if runtime.name.startswith("emulated"):
        stream = runtime.legacy_stream(device)
        runtime.launch(runtime.load_program(XOR, device), "xor", grid=1, block=32, stream=stream,
                       args=[DeviceAddress(dst_value, device), DeviceAddress(src_value, device), i64(nbytes), i64(key)])
        stream.synchronize()
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
