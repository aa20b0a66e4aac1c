"""The one CUDA/HIP source of kvtier's transfer kernels, and its identity for caches and prebuilt images."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

SOURCE_PATH = Path(__file__).with_name("transfer.cu")
WIDTHS = (16, 8, 4, 2, 1)
"""Access widths of the copy kernels, widest first: a launch takes the widest every address and size allows."""
SWAP_WIDTHS = (16, 8, 4)
INDEX_TYPES = {8: "i64", 4: "i32"}


def copy_kernel(index_bytes: int, width: int) -> str:
    return f"kvtier_copy_chunks_{INDEX_TYPES[index_bytes]}" + ("" if width == 16 else f"_w{width}")


def swap_kernel(width: int) -> str:
    return "kvtier_hot_swap_in" + ("" if width == 16 else f"_w{width}")


def bulk_kernel(index_bytes: int) -> str:
    return f"kvtier_bulk_copy_{INDEX_TYPES[index_bytes]}"


KERNEL_NAMES = (tuple(copy_kernel(i, w) for i in INDEX_TYPES for w in WIDTHS)
                + tuple(swap_kernel(w) for w in SWAP_WIDTHS) + tuple(bulk_kernel(i) for i in INDEX_TYPES))
BULK_STAGES = 4
"""Shared-memory stages per warp of the bulk copy kernels (KVTIER_BULK_STAGES in transfer.cu)."""
DEFAULT_UNROLL = 8


@dataclass(frozen=True)
class Specialization:
    """The compile-time choices of the transfer kernels. The defaults are what prebuilt (AOT) images hold; anything
    else is a JIT build. Besides the block shape, the switches exist to measure what a feature costs in one run:
    ``streaming=False`` drops the evict-first cache hints, ``skip_absent=False`` builds the copy loop without the
    test for absent (negative) units, so it is only for engine calls, which never pass one."""

    unroll: int = DEFAULT_UNROLL
    max_threads: int = 1024
    streaming: bool = True
    skip_absent: bool = True

    @property
    def prebuilt(self) -> bool:
        return self == SHIPPED

    def defines(self) -> list[str]:
        return [f"-DKVTIER_UNROLL={self.unroll}", f"-DKVTIER_MAX_THREADS={self.max_threads}",
                f"-DKVTIER_STREAMING={int(self.streaming)}", f"-DKVTIER_SKIP_ABSENT={int(self.skip_absent)}"]

    def label(self) -> str:
        return (f"unroll{self.unroll}:threads{self.max_threads}" + ("" if self.streaming else ":cached")
                + ("" if self.skip_absent else ":noskip"))


SHIPPED = Specialization()
"""The specialization prebuilt images hold."""


@functools.cache
def source_text() -> str:
    return SOURCE_PATH.read_text()


@functools.cache
def source_hash() -> str:
    return hashlib.sha256(source_text().encode()).hexdigest()[:16]
