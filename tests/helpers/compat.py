"""Operands for kvtier.compat tests, one way on every runtime: device tensors (DeviceArrays on the emulators, CUDA
tensors on the GPU), host tensors over kvtier pinned buffers (or torch-pinned ones), index tensors and raw uint64
pointer tables of ``data_ptr()``s, where SGLang keeps them. Random data or a poison pattern, never zeros."""

from __future__ import annotations

import contextlib
import gc
import math
import threading

import torch

from helpers.operands import start_and_join
from kvtier.compat import DeviceArray
from kvtier.memory import HostBuffer, HostKind
from kvtier.pause_points import armed


class Operands:
    def __init__(self, runtime, *, dtype=torch.int16, poison: int = 0x5A5A, torch_pinned: bool = False) -> None:
        self.runtime, self.cuda = runtime, runtime.name == "cuda"
        self.dtype, self.poison = dtype, poison
        self.torch_pinned = torch_pinned and self.cuda
        self.keep: list = []

    def values(self, shape, data: bool = True):
        if not data:
            return torch.full(shape, self.poison, dtype=self.dtype)
        info = torch.iinfo(self.dtype)
        return torch.randint(info.min, info.max, shape, dtype=self.dtype)

    def _own(self, thing):
        self.keep.append(thing)
        return thing

    def device(self, shape, data: bool = True, device: int = 0):
        values = self.values(shape, data)
        if self.cuda:
            return values.to(f"cuda:{device}")
        return self._own(DeviceArray.from_tensor(values, device=device, runtime=self.runtime))

    def buffer(self, nbytes: int, kind: HostKind = HostKind.PINNED) -> HostBuffer:
        return self._own(HostBuffer.allocate(nbytes, kind, runtime=self.runtime))

    def host(self, shape, data: bool = True, kind: HostKind = HostKind.PINNED):
        if self.torch_pinned:
            tensor = torch.empty(shape, dtype=self.dtype, pin_memory=True)
        else:
            size = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
            tensor = self.buffer(size, kind).as_tensor(self.dtype).view(shape)
        tensor.copy_(self.values(shape, data))
        return tensor

    def indices(self, values):
        tensor = torch.tensor(values, dtype=torch.int64)
        return tensor.to("cuda") if self.cuda else self._own(DeviceArray.from_tensor(tensor, runtime=self.runtime))

    def pinned_indices(self, values):
        tensor = self.buffer(8 * len(values)).as_tensor(torch.int64)
        tensor.copy_(torch.tensor(values, dtype=torch.int64))
        return tensor

    def table(self, tensors):
        raw = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)
        return raw.to("cuda") if self.cuda else self._own(DeviceArray.from_tensor(raw, runtime=self.runtime))

    def cpu(self, x):
        if isinstance(x, DeviceArray):
            return x.cpu()
        if self.cuda:
            torch.cuda.synchronize()
        return x.detach().to("cpu").clone()

    def poisoned(self, x) -> bool:
        data = self.cpu(x)
        return bool((data == self.poison).all())

    def close(self) -> None:
        for thing in self.keep:
            thing.close()


def byte_operands(runtime, poison: int = 0x5A) -> Operands:
    """Operands of uint8 elements: item sizes are then byte counts."""
    return Operands(runtime, dtype=torch.uint8, poison=poison)


OS_PAGE = 4096
"""An OS page: host memory is registered in whole pages, so registration (and chunk) edges fall on it."""
BYTE_ITEM = 64
"""The item_size of byte operands in tests about registrations: bytes of one token of one layer (uint8 elements)."""


def closing_cleanup(buffer, errors: list):
    """An engine's cleanup, for ``weakref.finalize(engine, ...)``: close the buffer, keeping what it raised."""
    from kvtier.errors import KvtierError

    def cleanup(b=buffer):
        try:
            b.close()
        except KvtierError as error:
            errors.append(error)
    return cleanup


class Engine:
    """A stand-in for a serving engine's object that holds host views and cleans up with ``weakref.finalize``."""


def buffer_with_closing_cleanup():
    """(a 64 KiB host buffer on a fresh split emulator, the list its cleanup's errors go to, the cleanup)."""
    from kvtier.memory import HostBuffer
    from kvtier.runtime import create

    buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
    errors: list = []
    return buffer, errors, closing_cleanup(buffer, errors)


def index_overwrite(runtime):
    """Checks on, lazy streams: a copy of 8 tokens whose pinned dst indices [0, 1] a device array [0, 300] (out of
    range) is about to overwrite. Returns (operands, dst, src, src_idx, dst_idx, computed, dst_idx's HostBuffer)."""
    m = byte_operands(runtime)
    dst = m.host((8, 16), data=False)
    src = m.device((8, 16))
    src_idx, dst_idx = m.pinned_indices([0, 1]), m.pinned_indices([0, 1])
    computed = m._own(DeviceArray.from_tensor(torch.tensor([0, 300]), runtime=runtime))
    runtime.synchronize(0)
    return m, dst, src, src_idx, dst_idx, computed, m.keep[-2]


def two_paused_mla_loads(rt, src, dst, row: int, points: dict, poison: int = 0x5A) -> None:
    """Threads "A" and "B" each run one ``transfer_kv_per_layer_mla`` of their own three rows of ``src`` into
    ``dst`` while ``points`` (pause point name -> action, run in whichever thread reaches it) force an interleaving;
    then every byte of ``dst`` must hold both loads over ``poison``: a thread that launched the other's indices, or
    over a freed table, fails here."""
    from kvtier.compat.sglang import kvcacheio as io

    jobs = {"A": ([1, 2, 3], [0, 1, 2]), "B": ([7, 8, 9], [10, 11, 12])}
    indices = {k: tuple(DeviceArray.from_tensor(torch.tensor(v), runtime=rt) for v in pair) for k, pair in jobs.items()}
    errors: list[BaseException] = []

    def work(name):
        try:
            io.transfer_kv_per_layer_mla(src, dst, *indices[name], row)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    with contextlib.ExitStack() as stack:
        for name, action in points.items():
            stack.enter_context(armed(name, action))
        start_and_join([threading.Thread(target=work, args=(name,), name=name) for name in "AB"], 20)
    gc.collect()
    rt.synchronize(0)
    assert not errors
    want = torch.full(tuple(dst.shape), poison, dtype=torch.uint8)
    source = src.cpu()
    for s, d in jobs.values():
        want[d] = source[s]
    got = dst.cpu()
    assert torch.equal(got[[0, 1, 2]], want[[0, 1, 2]]), "thread A's pairs were not copied (it launched B's)"
    assert torch.equal(got, want)
