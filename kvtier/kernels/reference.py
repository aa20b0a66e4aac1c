"""Python reference of every transfer kernel: what the emulated runtime executes.

It follows ``transfer.cu`` step for step — tables and indices are read from device memory, every chunk address is
computed the same way — and every access goes through the executing device's address map with the width the real
kernel uses (16-byte vectors for chunks), so an address a real kernel could not dereference, or could not
dereference with that width, faults here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.pause_points import reached

INDEX_DTYPES = {8: np.int64, 4: np.int32}
VECTOR_BYTES = 16
LAYER_STEPS = 6
"""Scheduler steps a signalled copy spends on each layer before it lands (the emulator's stand-in for copy time)."""


def _read(memory: Any, address: int, count: int, dtype: Any) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    return memory.view(address, count * itemsize, align=itemsize).view(dtype)


def copy_chunks(memory: Any, src: tuple[int, ...], dst: tuple[int, ...], src_index: int, dst_index: int,
                n_units: int, layer_begin: int, n_layers: int, n_tensors: int, table_layers: int, n_pieces: int,
                chunk_bytes: int, group: int, layer_group: int = 1, layer_done: int = 0, *, index_bytes: int,
                width: int = VECTOR_BYTES) -> Iterator[None] | None:
    """``src``/``dst`` are (table, page_stride, unit_stride, piece_stride, units_per_page), as the kernel's Side;
    tables hold ``table_layers`` rows per tensor. ``group`` only shapes the CUDA kernel's warps; chunks are copied
    in the kernel's order (groups of ``layer_group`` layers, each unit by unit), and with ``layer_done`` the counter
    of each group's first layer then grows by the group's chunk count, as the kernel's warps add it up."""
    sides = []
    rows = [t * table_layers + layer_begin + layer for t in range(n_tensors) for layer in range(n_layers)]
    for table, page_stride, unit_stride, piece_stride, units_per_page in (src, dst):
        entries = _read(memory, table, n_tensors * table_layers, np.uint64).astype(object)
        sides.append(([entries[r] for r in rows], page_stride, unit_stride, piece_stride, units_per_page))
    dtype = INDEX_DTYPES[index_bytes]
    units = [_read(memory, index, n_units, dtype).astype(object) for index in (src_index, dst_index)]
    size = min(max(1, layer_group), max(1, n_layers))
    groups = [range(first, min(first + size, n_layers)) for first in range(0, n_layers, size)]
    group_orders = [[(t * n_layers + layer, i) for t in range(n_tensors) for i in range(n_units) for layer in layers]
                    for layers in groups]
    if not (layer_done and n_units):
        _copy(memory, sides, units, [pair for order in group_orders for pair in order], n_pieces, chunk_bytes, width)
        return None
    reached("reference.phased_copy")
    return _signalled(memory, sides, units, groups, group_orders, n_pieces, chunk_bytes, width,
                      layer_done + 8 * layer_begin, n_tensors * n_units * n_pieces)


def _signalled(memory: Any, sides: list[Any], units: list[Any], groups: list[range], group_orders: list[Any],
               n_pieces: int, chunk_bytes: int, width: int, counters: int, per_layer: int) -> Iterator[None]:
    """A layer group at a time, each taking a few scheduler steps (the emulator runs a generator kernel in phases,
    other streams in between): copy its chunks, then add its count to the counter of its first layer. A consumer can
    so see group g signalled, and read it, while g + 1 is still on its way."""
    for layers, order in zip(groups, group_orders, strict=True):
        for _ in range(LAYER_STEPS):
            yield
        _copy(memory, sides, units, order, n_pieces, chunk_bytes, width)
        _read(memory, counters + 8 * layers[0], 1, np.uint64)[0] += np.uint64(per_layer * len(layers))


def _copy(memory: Any, sides: list[Any], units: list[Any], order: list[tuple[int, int]], n_pieces: int,
          chunk_bytes: int, width: int) -> None:
    """Copy chunk (plane, unit i, piece) for each (plane, i) of ``order``, pieces innermost."""
    for plane, i in order:
        if any(int(unit[i]) < 0 for unit in units):
            continue  # absent on one side: skipped, as the kernel does
        for piece in range(n_pieces):
            addresses = []
            for (bases, page_stride, unit_stride, piece_stride, per_page), unit in zip(sides, units, strict=True):
                page, slot = divmod(int(unit[i]), per_page)
                addresses.append(int(bases[plane]) + page * page_stride + slot * unit_stride + piece * piece_stride)
            reached("reference.copy_chunk")
            source = memory.view(addresses[0], chunk_bytes, align=width)
            reached("reference.write_chunk")
            memory.view(addresses[1], chunk_bytes, align=width)[:] = source


def _side_bases(memory: Any, side: tuple[int, ...], rows: list[int], table_rows: int) -> tuple[Any, ...]:
    table, page_stride, unit_stride, piece_stride, units_per_page = side
    entries = _read(memory, table, table_rows, np.uint64).astype(object)
    return [entries[r] for r in rows], page_stride, unit_stride, piece_stride, units_per_page


def hot_swap_in(memory: Any, state: tuple[int, ...], host: tuple[int, ...], dev: tuple[int, ...], topk: int,
                requests: int, seq_lens: int, out: int, batch: int, n_slots: int, k: int, max_tokens: int, layer: int,
                state_layers: int, n_tensors: int, table_layers: int, row_bytes: int, group: int, *,
                width: int) -> None:
    """``kvtier_hot_swap_in`` step for step (one request at a time, as one block would): same ranks, same LRU
    order, same copies, every array read and written through the device's address map."""
    slot_tokens_p, lru_p, next_p, token_slot_p, flags_p, miss_src_p, miss_dst_p, host_locs_p, device_locs_p = state
    reqs = _read(memory, requests, batch, np.int64)
    seqs = _read(memory, seq_lens, batch, np.int64)
    for b in range(batch):
        req, seq = int(reqs[b]), int(seqs[b])
        top = _read(memory, topk + 4 * b * k, k, np.int32)
        result = _read(memory, out + 8 * b * k, k, np.int64)
        dloc = _read(memory, device_locs_p + 8 * req * (n_slots + 1), n_slots + 1, np.int64)
        valid = (top >= 0) & (top < seq)
        row = req * state_layers + layer
        slot_tokens = _read(memory, slot_tokens_p + 4 * row * (n_slots + 1), n_slots + 1, np.int32)
        if seq <= n_slots:
            safe = np.where(valid, top, 0)
            result[:] = np.where(valid & (slot_tokens[safe] == safe), dloc[safe], -1)
            continue
        lru = _read(memory, lru_p + 4 * row * n_slots, n_slots, np.int32)
        token_slot = _read(memory, token_slot_p + 4 * row * max_tokens, max_tokens, np.int32)
        _read(memory, next_p + 4 * req * n_slots, n_slots, np.int32)
        _read(memory, flags_p + 4 * req * n_slots, n_slots, np.int32)
        miss_src = _read(memory, miss_src_p + 8 * req * k, k, np.int64)
        miss_dst = _read(memory, miss_dst_p + 8 * req * k, k, np.int64)
        hloc = _read(memory, host_locs_p + 8 * req * max_tokens, max_tokens, np.int64)
        hit = np.zeros(n_slots, dtype=bool)
        owners: dict[int, int] = {}
        misses: list[int] = []
        for i, t in enumerate(top.tolist()):
            if not 0 <= t < seq:
                result[i] = -1
            elif t == seq - 1:
                result[i] = dloc[n_slots]
            elif token_slot[t] >= 0:
                result[i] = dloc[token_slot[t]]
                hit[token_slot[t]] = True
            elif t not in owners:
                owners[t] = i
                misses.append(i)
        order = lru.tolist()
        evictable = [s for s in order if not hit[s]]
        hits = [s for s in order if hit[s]]
        victims = evictable[:len(misses)]
        lru[:] = evictable[len(misses):] + victims + hits
        for r, (i, slot) in enumerate(zip(misses, victims, strict=True)):
            t, old = int(top[i]), int(slot_tokens[slot])
            if old >= 0:
                token_slot[old] = -1
            slot_tokens[slot] = t
            token_slot[t] = slot
            result[i] = dloc[slot]
            miss_src[r], miss_dst[r] = hloc[t], dloc[slot]
        for i, t in enumerate(top.tolist()):
            if 0 <= t < seq - 1 and owners.get(t, i) != i:
                result[i] = dloc[token_slot[t]]
        if misses:
            rows = [t * table_layers + layer for t in range(n_tensors)]
            sides = [_side_bases(memory, side, rows, n_tensors * table_layers) for side in (host, dev)]
            units = [miss_src[:len(misses)].astype(object), miss_dst[:len(misses)].astype(object)]
            order = [(t, i) for t in range(n_tensors) for i in range(len(misses))]
            _copy(memory, sides, units, order, 1, row_bytes, width)
