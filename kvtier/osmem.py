"""Raw POSIX memory mappings through libc.

Python's ``mmap`` module hides the mapping's address and refuses to unmap while buffers are exported; kvtier needs
the address (to register it with a GPU runtime) and control over the flags (MAP_HUGETLB, MAP_SHARED on a shm file,
MADV_POPULATE_WRITE), so it maps through libc directly.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os

PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED = mmap.MAP_SHARED
MAP_PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
MAP_HUGETLB = 0x40000
MADV_POPULATE_WRITE = 23
PAGE_SIZE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def map_memory(nbytes: int, flags: int = MAP_PRIVATE_ANON, fd: int = -1) -> int:
    """Map ``nbytes`` and return the CPU address; raises OSError with errno on failure."""
    address = _libc().mmap(None, nbytes, PROT_RW, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return int(address)


def unmap_memory(address: int, nbytes: int) -> None:
    if _libc().munmap(address, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap(0x{address:x}, {nbytes}) failed: {os.strerror(err)}")


def populate(address: int, nbytes: int) -> None:
    """Fault every page in now, so registration and first copies do not pay for page faults.

    Uses MADV_POPULATE_WRITE (Linux 5.14+); older kernels get one written byte per page.
    """
    if _libc().madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS):
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)}")
    pages = (ctypes.c_uint8 * nbytes).from_address(address)
    for offset in range(0, nbytes, PAGE_SIZE):
        pages[offset] = pages[offset]


def copy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def byte_array(address: int, nbytes: int) -> ctypes.Array:
    """A ctypes byte array over existing memory: the buffer-protocol object torch and numpy views hold on to."""
    return (ctypes.c_uint8 * nbytes).from_address(address)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
