"""A shaped, typed view of kvtier device memory that answers the parts of the torch tensor API the compat layers read.

The emulated runtime's device memory has addresses no torch tensor can have, so CI cannot hand a compat function a
CUDA tensor. A :class:`DeviceArray` over a :class:`~kvtier.memory.DeviceBuffer` can: ``data_ptr()`` is its device
address (what a CUDA tensor's would be), ``shape``/``stride()``/``element_size()`` describe it the torch way, and
``copy_()``/``cpu()`` move bytes through the runtime. On CUDA, use real tensors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument, WrongRuntime
from kvtier.memory import DeviceAddress, DeviceBuffer, DeviceRegion
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class DeviceArray:
    """``shape`` elements of ``dtype`` (a torch dtype), contiguous, at ``offset`` bytes into ``buffer``."""

    def __init__(self, buffer: DeviceBuffer, shape: tuple[int, ...] | list[int], dtype: Any, offset: int = 0,
                 *, owns: bool = False) -> None:
        import torch

        self.buffer, self.dtype, self.offset = buffer, dtype, int(offset)
        self.shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in self.shape):
            raise InvalidArgument(f"DeviceArray shape {self.shape} has a negative size")
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        buffer.check_span(self.offset, self.nbytes, "DeviceArray")
        self._owns = owns

    @classmethod
    def empty(cls, shape: tuple[int, ...] | list[int], dtype: Any, device: int = 0, *,
              runtime: Runtime | None = None) -> DeviceArray:
        """A new array in its own device buffer (freed by :meth:`close`)."""
        import torch

        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return cls(DeviceBuffer(max(nbytes, 1), device, runtime=runtime or get_runtime()), shape, dtype, owns=True)

    @classmethod
    def from_tensor(cls, tensor: Any, device: int = 0, *, runtime: Runtime | None = None) -> DeviceArray:
        """A device copy of a CPU tensor."""
        array = cls.empty(tuple(tensor.shape), tensor.dtype, device, runtime=runtime)
        array.copy_(tensor)
        return array

    # -- the torch tensor API the compat layers read ----------------------------------------------------------------
    @property
    def runtime(self) -> Runtime:
        return self.buffer.runtime

    @property
    def device(self) -> str:
        return f"{self.runtime.name}:{self.buffer.device}"

    @property
    def device_index(self) -> int:
        return self.buffer.device

    @property
    def address(self) -> DeviceAddress:
        return self.buffer.address + self.offset

    @property
    def region(self) -> DeviceRegion:
        return self.buffer.region(self.offset, self.nbytes)

    @property
    def nbytes(self) -> int:
        return self.numel() * self._itemsize

    def data_ptr(self) -> int:
        return self.address.value

    def element_size(self) -> int:
        return self._itemsize

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim: int | None = None) -> Any:
        strides = _contiguous_strides(self.shape)
        return strides if dim is None else strides[dim]

    def is_contiguous(self) -> bool:
        return True

    def select(self, dim: int, index: int) -> DeviceArray:
        """The sub-array at ``index`` of dimension 0 (the only one a contiguous view can drop without copying)."""
        if dim != 0:
            raise InvalidArgument("DeviceArray.select takes dimension 0 only")
        if not -self.shape[0] <= index < self.shape[0]:
            raise InvalidArgument(f"index {index} is out of range for dimension 0 of size {self.shape[0]}")
        index %= self.shape[0]
        inner = self.shape[1:]
        return DeviceArray(self.buffer, inner, self.dtype, self.offset + index * math.prod(inner) * self._itemsize)

    def __getitem__(self, index: int) -> DeviceArray:
        if type(index) is not int:
            raise InvalidArgument("DeviceArray indexing takes one integer (dimension 0)")
        return self.select(0, index)

    def __len__(self) -> int:
        return self.shape[0]

    def copy_(self, tensor: Any) -> DeviceArray:
        """Copy in a CPU tensor, a numpy array or another DeviceArray of the same number of bytes."""
        import torch

        if isinstance(tensor, DeviceArray):
            if tensor.runtime is not self.runtime:
                raise WrongRuntime("DeviceArray.copy_: the source belongs to another runtime, whose addresses mean "
                                   "nothing to this one; copy through .cpu()")
            if tensor.nbytes != self.nbytes:
                raise InvalidArgument(f"cannot copy {tensor.nbytes} bytes into a DeviceArray of {self.nbytes}")
            self.runtime.memcpy(self.address, tensor.address, self.nbytes)
            return self
        if isinstance(tensor, torch.Tensor):
            if tensor.device.type != "cpu":
                raise InvalidArgument(f"DeviceArray.copy_ takes a CPU tensor, not one on {tensor.device}")
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        else:
            data = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
        if data.nbytes != self.nbytes:
            raise InvalidArgument(f"cannot copy {data.nbytes} bytes into a DeviceArray of {self.nbytes}")
        self.buffer.upload(data.reshape(-1), self.offset)
        return self

    def cpu(self) -> Any:
        """A CPU tensor with the array's bytes, after the device's queued work."""
        import torch

        self.runtime.synchronize(self.buffer.device)
        raw = np.frombuffer(bytearray(self.buffer.download(self.offset, self.nbytes)), dtype=np.uint8)
        return torch.from_numpy(raw).view(self.dtype).reshape(self.shape)

    def close(self) -> None:
        if self._owns:
            self.buffer.close()

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device}, at {self.address})"
