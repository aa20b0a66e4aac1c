"""Helpers many test files share: fresh random data, poisoned destinations, kvtier operands on an emulated runtime,
threads and fork children, collections at chosen moments, and pause points armed to act once."""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import secrets
import threading

import numpy as np
import pytest
import torch

from kvtier.compat import DeviceArray
from kvtier.memory import HostBuffer, HostKind
from kvtier.pause_points import armed

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


def all_poison(x, poison: int = POISON) -> bool:
    """Whether every byte of ``x`` (a tensor or a DeviceArray) still holds ``poison``."""
    return bool((cpu(x) == poison).all())


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
def at_point(name: str, action, thread: str | None = None, *, must_reach: bool = True):
    """Arm the pause point ``name`` (``kvtier.pause_points``) so that ``action()`` runs once, in the first thread to
    reach it (the first named ``thread``, where given); later arrivals pass. Yields the list that then holds what
    the action returned. The block fails if no thread reached the point, unless ``must_reach`` is false (a point
    only a defect leads to)."""
    done: list = []
    taken: list = []
    guard = threading.Lock()

    def once():
        with guard:
            if taken or (thread is not None and threading.current_thread().name != thread):
                return
            taken.append(True)
        done.append(action())

    with armed(name, once, must_reach=must_reach):
        yield done


def in_thread(call, name: str | None = None):
    """``call()`` in a new daemon thread; returns (thread, the errors it raised)."""
    errors: list = []

    def run():
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            errors.append(error)
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, errors


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


@pytest.fixture
def collections_only_when_asked():
    """No automatic collection: cyclic garbage goes exactly where a test calls ``gc.collect()``. A test module imports
    it and asks for it with ``pytest.mark.usefixtures("collections_only_when_asked")``."""
    with no_automatic_collection():
        yield


def collect_inside_first_kernel(run) -> list:
    """``run()`` with one ``gc.collect()`` at the first chunk an emulated kernel copies (the moment an allocation
    there could trigger the collector), no automatic collection meanwhile; what the collection returned."""
    with no_automatic_collection(), at_point("reference.copy_chunk", gc.collect) as collected:
        run()
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
