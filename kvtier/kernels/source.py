"""The one CUDA/HIP source of kvtier's transfer kernels, and its identity for caches and prebuilt images."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

SOURCE_PATH = Path(__file__).with_name("transfer.cu")
KERNEL_NAMES = {8: "kvtier_copy_chunks_i64", 4: "kvtier_copy_chunks_i32"}
DEFAULT_UNROLL = 8


@functools.cache
def source_text() -> str:
    return SOURCE_PATH.read_text()


@functools.cache
def source_hash() -> str:
    return hashlib.sha256(source_text().encode()).hexdigest()[:16]
