"""Where host buffer bytes come from: anonymous, shared-memory, hugetlb and runtime-pinned memory.

Shared-memory files (their directory, names, owner locks and the sweep of dead owners' files) are in
:mod:`kvtier.memory.shm`; this module maps them.

Each source returns a :class:`HostMemory` with the CPU address and a ``release`` that gives the memory back; the
``HostBuffer`` above decides what gets registered. Read-write registration of disk-file mappings is deliberately
absent: Linux refuses long-term pins of writable file mappings (cudaErrorInvalidValue on the H200).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Callable

from kvtier import osmem
from kvtier.errors import HugePagesUnavailable, KvtierError
from kvtier.memory import shm
from kvtier.memory.shm import new_shm_name as new_shm_name
from kvtier.memory.shm import shm_path
from kvtier.runtime import Runtime


@dataclass
class HostMemory:
    address: int
    nbytes: int
    release: Callable[[], None]
    path: str | None = None
    owner: bool = True
    mapped_bytes: int = field(default=0)
    #: what to give back while the mapping must stay (readers may outlive the owner at exit): an shm file
    forget: Callable[[], None] | None = None


def anonymous(nbytes: int, *, populate: bool = True) -> HostMemory:
    address = osmem.map_memory(nbytes)
    if populate:
        osmem.populate(address, nbytes)
    return HostMemory(address, nbytes, lambda: osmem.unmap_memory(address, nbytes), mapped_bytes=nbytes)


def pinned(runtime: Runtime, nbytes: int) -> HostMemory:
    address = runtime.host_alloc(nbytes)
    return HostMemory(address, nbytes, lambda: runtime.host_free(address), mapped_bytes=nbytes)


def huge_page_size() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    return 2 << 20


def _free_huge_pages() -> str:
    try:
        with open("/proc/meminfo") as meminfo:
            return next((line.split(":")[1].strip() for line in meminfo if line.startswith("HugePages_Free")), "?")
    except OSError:
        return "?"


def hugetlb(nbytes: int) -> HostMemory:
    mapped = osmem.round_up(nbytes, huge_page_size())
    try:
        address = osmem.map_memory(mapped, osmem.MAP_PRIVATE_ANON | osmem.MAP_HUGETLB)
    except OSError as exc:
        if exc.errno not in (errno.ENOMEM, errno.EINVAL):
            raise
        raise HugePagesUnavailable(
            f"hugetlb buffer of {nbytes} bytes needs {mapped // huge_page_size()} free huge pages of "
            f"{huge_page_size() >> 20} MiB, the system has {_free_huge_pages()} free: reserve more with "
            f"`sysctl -w vm.nr_hugepages=N` (vm.nr_hugepages), or use kind='registered'") from exc
    try:
        osmem.populate(address, mapped)
    except OSError as exc:
        osmem.unmap_memory(address, mapped)
        raise HugePagesUnavailable(f"hugetlb pages could not be faulted in ({exc}); check vm.nr_hugepages") from exc
    return HostMemory(address, nbytes, lambda: osmem.unmap_memory(address, mapped), mapped_bytes=mapped)


def shm_create(name: str, nbytes: int) -> HostMemory:
    """A new shm file (see :mod:`kvtier.memory.shm`), mapped MAP_SHARED; the creator owns it.

    Only the creating process gives it back: its release unmaps, removes the file and drops the owner's lock. A fork
    child inherits the release but not the ownership, so there it does nothing (the file and the lock stay the
    creator's, and the child's mapping goes when the child exits).
    """
    path, fd = shm.create_owned(name, nbytes)
    try:
        address = osmem.map_memory(nbytes, osmem.MAP_SHARED, fd)
    except BaseException:
        shm.remove_owned(path, fd)
        raise
    try:
        osmem.populate(address, nbytes)
    except BaseException:
        osmem.unmap_memory(address, nbytes)
        shm.remove_owned(path, fd)
        raise
    return HostMemory(address, nbytes, _owner_release(address, nbytes, path, fd), path=path, owner=True,
                      mapped_bytes=nbytes, forget=_owner_release(None, nbytes, path, fd))


def _owner_release(address: int | None, nbytes: int, path: str, fd: int) -> Callable[[], None]:
    """Unmap (``address``; None leaves the mapping), then remove the file and drop the owner's lock."""
    creator = os.getpid()

    def release() -> None:
        if os.getpid() != creator:
            return  # a fork child: removing the file or dropping the lock would pull it from under the creator
        try:
            if address is not None:
                osmem.unmap_memory(address, nbytes)
        finally:
            shm.remove_owned(path, fd)

    return release


def shm_attach(name: str) -> HostMemory:
    """Map an existing shm file made by another process; releasing it leaves the file to its owner.

    An attacher holds no lock: it does not keep a dead owner's file from being swept (its mapping stays valid).
    """
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise KvtierError(f"no shm buffer named {name!r} ({path} does not exist)") from exc
    try:
        nbytes = os.fstat(fd).st_size
        if nbytes == 0:
            raise KvtierError(f"shm {path} is empty")
        address = osmem.map_memory(nbytes, osmem.MAP_SHARED, fd)
    finally:
        os.close(fd)
    return HostMemory(address, nbytes, lambda: osmem.unmap_memory(address, nbytes), path=path, owner=False,
                      mapped_bytes=nbytes)
