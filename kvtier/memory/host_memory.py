"""Where host buffer bytes come from: anonymous, shared-memory, hugetlb and runtime-pinned memory.

Each source returns a :class:`HostMemory` with the CPU address and a ``release`` that gives the memory back; the
``HostBuffer`` above decides what gets registered. Read-write registration of disk-file mappings is deliberately
absent: Linux refuses long-term pins of writable file mappings (cudaErrorInvalidValue on the H200).
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from kvtier import osmem
from kvtier.errors import HugePagesUnavailable, KvtierError
from kvtier.runtime import Runtime

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass
class HostMemory:
    address: int
    nbytes: int
    release: Callable[[], None]
    path: str | None = None
    owner: bool = True
    mapped_bytes: int = field(default=0)


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


def shm_path(name: str) -> str:
    if not _SHM_NAME.match(name):
        raise KvtierError(f"shm name {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-'")
    return os.path.join(SHM_DIR, name)


def new_shm_name() -> str:
    return f"kvtier-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def shm_create(name: str, nbytes: int) -> HostMemory:
    """A new /dev/shm file, mode 0600, mapped MAP_SHARED; the creator owns it and removes it on release."""
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise KvtierError(f"shm {path} already exists: attach to it with HostBuffer.attach_shm({name!r})") from exc
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        address = osmem.map_memory(nbytes, osmem.MAP_SHARED, fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    try:
        osmem.populate(address, nbytes)
    except BaseException:
        osmem.unmap_memory(address, nbytes)
        os.unlink(path)
        raise

    def release() -> None:
        osmem.unmap_memory(address, nbytes)
        if os.path.exists(path):
            os.unlink(path)

    return HostMemory(address, nbytes, release, path=path, owner=True, mapped_bytes=nbytes)


def shm_attach(name: str) -> HostMemory:
    """Map an existing /dev/shm file made by another process; releasing it leaves the file to its owner."""
    path = shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
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
