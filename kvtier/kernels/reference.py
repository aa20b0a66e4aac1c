"""Python reference of every transfer kernel: what the emulated runtime executes.

It follows ``transfer.cu`` step for step — tables and indices are read from device memory, every chunk address is
computed the same way — and every access goes through the executing device's address map with the width the real
kernel uses (16-byte vectors for chunks), so an address a real kernel could not dereference, or could not
dereference with that width, faults here too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INDEX_DTYPES = {8: np.int64, 4: np.int32}
VECTOR_BYTES = 16


def _read(memory: Any, address: int, count: int, dtype: Any) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    return memory.view(address, count * itemsize, align=itemsize).view(dtype)


def copy_chunks(memory: Any, src: tuple[int, ...], dst: tuple[int, ...], src_index: int, dst_index: int,
                n_units: int, layer_begin: int, n_layers: int, n_tensors: int, table_layers: int, n_pieces: int,
                chunk_bytes: int, group: int, *, index_bytes: int) -> None:
    """``src``/``dst`` are (table, page_stride, unit_stride, piece_stride, units_per_page), as the kernel's Side;
    tables hold ``table_layers`` rows per tensor. ``group`` only shapes the CUDA kernel's warps."""
    sides = []
    rows = [t * table_layers + layer_begin + layer for t in range(n_tensors) for layer in range(n_layers)]
    for table, page_stride, unit_stride, piece_stride, units_per_page in (src, dst):
        entries = _read(memory, table, n_tensors * table_layers, np.uint64).astype(object)
        sides.append(([entries[r] for r in rows], page_stride, unit_stride, piece_stride, units_per_page))
    dtype = INDEX_DTYPES[index_bytes]
    units = [_read(memory, index, n_units, dtype).astype(object) for index in (src_index, dst_index)]
    for layer in range(len(rows)):
        for i in range(n_units):
            for piece in range(n_pieces):
                addresses = []
                for (bases, page_stride, unit_stride, piece_stride, per_page), unit in zip(sides, units, strict=True):
                    page, slot = divmod(int(unit[i]), per_page)
                    addresses.append(int(bases[layer]) + page * page_stride + slot * unit_stride + piece * piece_stride)
                source = memory.view(addresses[0], chunk_bytes, align=VECTOR_BYTES)
                memory.view(addresses[1], chunk_bytes, align=VECTOR_BYTES)[:] = source
