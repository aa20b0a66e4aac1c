"""Helpers the adversary test files share: fresh random data, poisoned destinations, kvtier operands on an emulated
runtime, and trace functions that stop a thread at a chosen line."""

from __future__ import annotations

import contextlib
import gc
import inspect
import math
import multiprocessing
import secrets
import sys

import numpy as np
import torch

from kvtier.compat import DeviceArray
from kvtier.memory import HostBuffer, HostKind

POISON = 0x5A
MODES = ["emulated:split", "emulated:unified"]
_keep: list = []


def rnd(shape):
    return torch.randint(1, 255, shape, dtype=torch.uint8)


def device(rt, shape, data=True, dev=0):
    return DeviceArray.from_tensor(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8), dev,
                                   runtime=rt)


def dev_idx(rt, values, dtype=torch.int64, dev=0):
    return DeviceArray.from_tensor(torch.tensor(values, dtype=dtype), dev, runtime=rt)


def pin_idx(rt, values, dtype=torch.int64):
    """Index values (or table entries) in a pinned kvtier HostBuffer (what a kernel may read)."""
    data = torch.tensor(values, dtype=dtype)
    buffer = HostBuffer.allocate(max(data.numel(), 1) * data.element_size(), HostKind.PINNED, runtime=rt)
    _keep.append(buffer)
    out = buffer.as_tensor(dtype)[:data.numel()].view(data.shape)
    out.copy_(data)
    return out


def host(rt, shape, kind=HostKind.PINNED, data=True, *, chunk=None, offset=0):
    """A uint8 host tensor (fresh random bytes, or poison) over a kvtier HostBuffer of its own, kept alive: the view
    starts ``offset`` bytes in; ``chunk`` registers the buffer in chunks of that size, so a view can straddle a
    registration boundary."""
    nbytes = math.prod(shape)
    extra = {} if chunk is None else {"register_chunk_bytes": chunk}
    buffer = HostBuffer.allocate(nbytes + offset, kind, runtime=rt, **extra)
    _keep.append(buffer)
    tensor = buffer.as_tensor(torch.uint8)[offset:offset + nbytes].view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return tensor


def poison(x):
    if isinstance(x, DeviceArray):
        x.copy_(torch.full(x.shape, POISON, dtype=torch.uint8))
    else:
        x.fill_(POISON)


def cpu(x):
    return x.cpu() if isinstance(x, DeviceArray) else x.detach().clone()


def fresh(shape):
    return torch.full(shape, POISON, dtype=torch.uint8)


def host_buffer(rt, shape, kind=HostKind.PINNED, data=True, **extra):
    """(a kvtier HostBuffer of its own, a uint8 tensor of ``shape`` over it holding fresh random bytes or the poison);
    ``extra``: register_chunk_bytes, granularity. The caller keeps the buffer alive (and may close it)."""
    nbytes = math.prod(shape)
    buffer = HostBuffer.allocate(nbytes, kind, runtime=rt, **extra)
    tensor = buffer.as_tensor(torch.uint8)[:nbytes].view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return buffer, tensor


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator seeded afresh, and its seed (for the failure message: a failing draw can be replayed)."""
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def all_poison(x):
    return bool((cpu(x) == POISON).all())


def source_line(function, text):
    """The line number of the first line of ``function``'s source that holds ``text``."""
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def at_line(function, text, action):
    """A trace function that runs ``action()`` once, when ``function`` is about to run the line holding ``text``."""
    code, at, done = function.__code__, source_line(function, text), []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == at and not done:
                done.append(action())
            return local
        return local
    return tracer, done


def traced(tracer, call):
    sys.settrace(tracer)
    try:
        return call()
    finally:
        sys.settrace(None)


def _fork_child(queue, call):
    try:
        result = call()
        queue.put("ok" if result is None else result)
    except Exception as error:  # noqa: BLE001
        queue.put(repr(error))


def run_in_fork(call, meanwhile=None, timeout=60.0):
    """(hung, what ``call()`` gave) in a 'fork' child: "ok" for None, else its result or its error's repr.
    ``meanwhile()`` runs in the parent once the child started; a child still alive ``timeout`` seconds later hangs."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_fork_child, args=(queue, call))
    child.start()
    if meanwhile is not None:
        meanwhile()
    child.join(timeout)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join(60)
        return True, None
    return False, queue.get(timeout=5)


def fork_operands(rt, n=8, row=32):
    """(src, dst, layers, outs, src_indices, dst_indices): an MLA kernel call's and a ``transfer_kv_direct`` call's
    operands, destinations poisoned."""
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    layers = [device(rt, (n, row)) for _ in range(2)]
    outs = [device(rt, (n, row), data=False) for _ in range(2)]
    return src, dst, layers, outs, dev_idx(rt, [1, 3]), dev_idx(rt, [0, 5])


@contextlib.contextmanager
def no_automatic_collection():
    """Cyclic garbage goes exactly where the code inside calls ``gc.collect()``."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_inside_first_kernel(run) -> list:
    """``run()`` with one ``gc.collect()`` at the first chunk an emulated kernel copies (the moment an allocation
    there could trigger the collector), no automatic collection meanwhile; what the collection returned."""
    from kvtier.kernels import reference

    tracer, collected = at_line(reference._copy, "source = memory.view", gc.collect)
    with no_automatic_collection():
        traced(tracer, run)
    assert collected and collected[0] > 0, "the collector found nothing inside the kernel"
    return collected


def close_when_collected(buffer) -> None:
    """Hand ``buffer`` to an owner in a reference cycle whose ``__del__`` closes it: once the caller drops its own
    reference, only the collector closes it (wherever it runs)."""

    class Owner:
        def __del__(self):
            self.buffer.close()

    owner = Owner()
    owner.me, owner.buffer = owner, buffer


def start_and_join(threads, timeout: float) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
