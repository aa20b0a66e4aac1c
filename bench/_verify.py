"""Checks that a benchmark's timed copies moved the right bytes (not a script itself).

A fast wrong copy looks like a win, so every script that times copies checks what they left behind:

1. sources hold random bytes (``random_bytes``, ``fill``), never zeros;
2. destinations are poisoned (``poison``: every destination byte set to ``POISON``) before the timed repeats;
3. after them ``verify`` compares each destination unit (a page, slot, token or piece) byte for byte with the source
   unit it was copied from: every unit when the copy moved at most ``FULL_BYTES``, else a sample of ``SAMPLE``
   units spread evenly over the transfer from its first to its last, plus the ones at the lowest and highest
   destination index. A difference ends the run at once: ``Mismatch`` (a ``SystemExit``, so one line on stderr and
   exit status 1, no traceback) names the script, the row, the unit and how many of its bytes differ. A source unit
   that holds only zeros or only poison fails too: it would match a copy that did nothing.

``KVTIER_BENCH_PLANT=1`` in the environment plants a wrong copy, to show that the check catches one: the first
``verify`` of the run flips one byte of one destination unit in memory (after the timed copies, before the check),
and ``same_answers`` changes one answer. The run must then fail with the mismatch message.

A side of a copy (``Side``) is one or more planes: arrays of units, each unit ``shape`` bytes ``strides`` apart, the
units ``page_stride`` (and within a page ``unit_stride``) apart. Both sides of a copy list their planes in the same
order (tensor, then layer), so unit ``i`` read from either side is comparable byte for byte. Host sides are numpy
views of host memory; device sides are read and written through the runtime's ``memcpy``, windows of nearby units
at a time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

POISON = 0xEE
"""The byte every destination holds before the timed copies: not zero, and a random source has few of it."""
PLANT = "KVTIER_BENCH_PLANT"
FULL_BYTES = 64 << 20
"""A copy of at most this many bytes is checked whole; a larger one by ``SAMPLE`` units."""
SAMPLE = 64
GAP = 1 << 20
"""Device units closer than this are read (and poisoned) as one window: one copy instead of one per unit."""

_planted: list[bool] = []


class Mismatch(SystemExit):
    """A verification failed: its message is one line naming the script, the row, the unit and the bytes."""


def script() -> str:
    return Path(sys.argv[0]).name or "bench"


def fail(what: str, message: str) -> Mismatch:
    return Mismatch(f"{script()}: verification failed: {what}: {message}")


def planted() -> bool:
    """True once per process, at the first check, when ``KVTIER_BENCH_PLANT`` asks for a planted wrong copy."""
    if os.environ.get(PLANT, "") not in ("", "0") and not _planted:
        _planted.append(True)
        return True
    return False


def random_bytes(nbytes: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """``nbytes`` random bytes in 1..255: a copy that did nothing, or copied zeros, cannot match them."""
    return (rng or np.random.default_rng()).integers(1, 256, nbytes, dtype=np.uint8)


@dataclass(frozen=True)
class Plane:
    """One array of units: unit ``u`` starts ``(u // per_page) * page_stride + (u % per_page) * unit_stride`` bytes
    past ``base`` (an offset into a host array, or a device address) and holds ``shape`` bytes ``strides`` apart
    (the last stride 1)."""

    base: Any
    page_stride: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    unit_stride: int = 0
    per_page: int = 1

    @property
    def item_bytes(self) -> int:
        return int(np.prod(self.shape))

    @property
    def span(self) -> int:
        """Bytes from a unit's first byte to its last, inclusive."""
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))

    def starts(self, units: np.ndarray) -> np.ndarray:
        return (units // self.per_page) * self.page_stride + (units % self.per_page) * self.unit_stride

    def items(self, buffer: np.ndarray) -> np.ndarray:
        """A view of ``buffer`` (1-D bytes) whose element ``i`` is the unit whose first byte is ``buffer[i]``."""
        return np.lib.stride_tricks.as_strided(buffer, (buffer.size - self.span + 1, *self.shape),
                                               (buffer.strides[0], *self.strides))


class Side:
    """One side of a copy: its units, as ``unit_bytes`` bytes each, read and written plane by plane."""

    where = ""

    def __init__(self, planes: Sequence[Plane], unit: str = "page") -> None:
        self.planes, self.unit = list(planes), unit
        self.unit_bytes = sum(p.item_bytes for p in self.planes)

    def read(self, units: Any) -> np.ndarray:
        """``[len(units), unit_bytes]``: each unit's bytes, plane after plane."""
        units = as_units(units)
        self.settle()
        return np.concatenate([self._read(p, units) for p in self.planes], axis=1) if self.planes else \
            np.zeros((units.size, 0), np.uint8)

    def write(self, units: Any, value: int | np.ndarray) -> None:
        """Set ``units`` to ``value``: one byte for all, or ``[len(units), unit_bytes]`` as ``read`` gives them."""
        units = as_units(units)
        self.settle()
        column = 0
        for plane in self.planes:
            part = value if np.isscalar(value) else np.asarray(value)[:, column:column + plane.item_bytes]
            self._write(plane, units, part)
            column += plane.item_bytes
        self.settle()

    def settle(self) -> None:
        """Wait for device work that may touch these units (device sides)."""

    def _read(self, plane: Plane, units: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _write(self, plane: Plane, units: np.ndarray, value: Any) -> None:
        raise NotImplementedError


def as_units(units: Any) -> np.ndarray:
    return np.asarray(units, dtype=np.int64).reshape(-1)


class HostSide(Side):
    """Units in host memory: ``memory`` is a ``HostBuffer`` (viewed only while a call runs, so the buffer can close
    while the side lives) or a 1-D numpy array of bytes."""

    where = "host"

    def __init__(self, memory: Any, planes: Sequence[Plane], unit: str = "page") -> None:
        super().__init__(planes, unit)
        self.memory = memory

    def array(self) -> np.ndarray:
        return self.memory if isinstance(self.memory, np.ndarray) else host_array(self.memory)

    def _read(self, plane: Plane, units: np.ndarray) -> np.ndarray:
        return plane.items(self.array()[plane.base:])[plane.starts(units)].reshape(units.size, -1)

    def _write(self, plane: Plane, units: np.ndarray, value: Any) -> None:
        view = plane.items(self.array()[plane.base:])
        view[plane.starts(units)] = value if np.isscalar(value) else value.reshape(units.size, *plane.shape)


class DeviceSide(Side):
    """Units in device memory (``Plane.base``: a device address), copied through ``runtime.memcpy`` a window of
    nearby units at a time."""

    where = "device"

    def __init__(self, runtime: Any, device: int, planes: Sequence[Plane], unit: str = "page") -> None:
        super().__init__(planes, unit)
        self.runtime, self.device = runtime, device

    def settle(self) -> None:
        self.runtime.synchronize(self.device)

    def _windows(self, plane: Plane, units: np.ndarray):
        """(positions in ``units``, first byte, end byte) of each window of units less than ``GAP`` apart."""
        starts = plane.starts(units)
        order = np.argsort(starts, kind="stable")
        ordered = starts[order]
        cuts = np.flatnonzero(ordered[1:] - ordered[:-1] - plane.span > GAP) + 1
        for chunk in np.split(order, cuts):
            yield chunk, int(starts[chunk].min()), int(starts[chunk].max()) + plane.span

    def _copy(self, host: np.ndarray, address: Any, *, to_device: bool) -> None:
        from kvtier.memory import CpuAddress

        cpu = CpuAddress(host.ctypes.data)
        self.runtime.memcpy(address, cpu, host.size) if to_device else self.runtime.memcpy(cpu, address, host.size)

    def _read(self, plane: Plane, units: np.ndarray) -> np.ndarray:
        out = np.empty((units.size, plane.item_bytes), np.uint8)
        for chunk, low, high in self._windows(plane, units):
            window = np.empty(high - low, np.uint8)
            self._copy(window, plane.base + low, to_device=False)
            out[chunk] = plane.items(window)[plane.starts(units[chunk]) - low].reshape(chunk.size, -1)
        return out

    def _write(self, plane: Plane, units: np.ndarray, value: Any) -> None:
        for chunk, low, high in self._windows(plane, units):
            window = np.empty(high - low, np.uint8)
            tiled = np.isscalar(value) and plane.span == plane.item_bytes and chunk.size * plane.span == high - low
            if tiled:                      # the units cover the window: nothing in it to keep
                window[:] = value
            else:
                self._copy(window, plane.base + low, to_device=False)
                plane.items(window)[plane.starts(units[chunk]) - low] = (
                    value if np.isscalar(value) else value[chunk].reshape(chunk.size, *plane.shape))
            self._copy(window, plane.base + low, to_device=True)


# -- the sides kvtier's pools have ----------------------------------------------------------------------------------
def kv_device(pool: Any, *, layers: Sequence[int] | None = None, unit: str = "page") -> DeviceSide:
    """A ``DevicePool``'s pages (or, ``unit="token"``, token rows), every tensor and layer (or ``layers``)."""
    g = pool.geometry
    planes = []
    for tensor in range(g.tensors):
        addresses = pool.layer_device_addresses(tensor)
        for layer in range(g.layers) if layers is None else layers:
            if unit == "token":
                planes.append(Plane(addresses[layer], g.page_bytes, (g.row_bytes,), (1,), g.row_bytes, g.page_size))
            else:
                planes.append(Plane(addresses[layer], g.page_bytes, (g.page_bytes,), (1,)))
    return DeviceSide(pool.runtime, pool.device, planes, "row" if unit == "page" and g.page_size == 1 else unit)


def kv_host(pool: Any, *, layers: Sequence[int] | None = None, unit: str = "page", strides: Any = None) -> HostSide:
    """A ``HostPool``'s pages (or token rows) in the device's byte order (token, head, byte), whatever its layout;
    ``strides`` (a ``Strides``) reads its buffer in another layout than the pool's own."""
    g, s = pool.geometry, strides or pool.strides
    planes = []
    for tensor in range(g.tensors):
        for layer in range(g.layers) if layers is None else layers:
            base = pool.tensor_offset(tensor) + layer * s.layer
            if unit == "token":
                planes.append(Plane(base, s.page, (g.heads, g.head_bytes), (s.head, 1), s.slot, g.page_size))
            else:
                planes.append(Plane(base, s.page, (g.page_size, g.heads, g.head_bytes), (s.slot, s.head, 1)))
    return HostSide(pool.buffer, planes, unit)


def family_device(pool: Any, unit: str) -> DeviceSide:
    """A model-family device pool's units of kind ``unit`` (slot, page or token): every part that moves them."""
    planes = [Plane(base, placement.page_stride, (part.pieces, part.chunk_bytes), (placement.piece_stride, 1),
                    placement.unit_stride, part.units_per_page)
              for part, placement in pool.parts() if part.unit == unit for base in placement.bases]
    return DeviceSide(pool.runtime, pool.device, planes, unit)


def family_host(host: Any, device_pool: Any, unit: str) -> HostSide:
    """The host copy of ``family_device(device_pool, unit)``, plane for plane."""
    planes = []
    for part, _ in device_pool.parts():
        if part.unit == unit:
            bases, page_stride, unit_stride = host.cpu_offsets(part)
            planes += [Plane(base, page_stride, (part.item_bytes,), (1,), unit_stride, part.units_per_page)
                       for base in bases]
    return HostSide(host.buffer, planes, unit)


def flat_host(memory: Any, base: int, size: int, unit: str = "piece") -> HostSide:
    """Pieces of ``size`` bytes of host memory (a ``HostBuffer`` or an array), piece ``i`` at ``base + i * size``."""
    return HostSide(memory, [Plane(base, size, (size,), (1,))], unit)


def flat_device(runtime: Any, device: int, address: Any, size: int, unit: str = "piece") -> DeviceSide:
    """Pieces of ``size`` bytes of device memory, piece ``i`` at ``address + i * size``."""
    return DeviceSide(runtime, device, [Plane(address, size, (size,), (1,))], unit)


def host_array(buffer: Any) -> np.ndarray:
    """A ``HostBuffer``'s bytes as a 1-D numpy array (a view: writes land in the buffer)."""
    return buffer.as_tensor().numpy().reshape(-1).view(np.uint8)


# -- the steps ------------------------------------------------------------------------------------------------------
def fill(side: Side, units: Any, rng: np.random.Generator | None = None) -> None:
    """Random bytes (``random_bytes``) in ``units``: sources are never zeros."""
    units = as_units(units)
    per = max(1, FULL_BYTES // max(1, side.unit_bytes))
    for first in range(0, units.size, per):
        chunk = units[first:first + per]
        side.write(chunk, random_bytes(chunk.size * side.unit_bytes, rng).reshape(chunk.size, -1))


def poison(side: Side, units: Any) -> None:
    """Every byte of ``units`` set to ``POISON``: before the timed copies into them."""
    side.write(units, POISON)


def checked_positions(dst_units: np.ndarray, unit_bytes: int) -> np.ndarray:
    """Which of a copy's units to check: all when the copy is at most ``FULL_BYTES``, else ``SAMPLE`` spread evenly
    over it (its first and last included) and those at the lowest and highest destination index."""
    n = dst_units.size
    if n * unit_bytes <= FULL_BYTES or n <= SAMPLE:
        return np.arange(n)
    spread = np.linspace(0, n - 1, SAMPLE).round().astype(np.int64)
    return np.unique(np.concatenate([spread, [int(dst_units.argmin()), int(dst_units.argmax())]]))


def verify(what: str, dst: Side, dst_units: Any, src: Side, src_units: Any) -> dict:
    """Compare the copy of ``src_units`` of ``src`` into ``dst_units`` of ``dst`` (after the timed copies); raise
    ``Mismatch`` naming ``what`` (the row) and the first unit that differs. Returns what was checked, for the row:
    ``{"unit", "checked", "of", "bytes"}``."""
    dst_units, src_units = as_units(dst_units), as_units(src_units)
    if dst_units.size != src_units.size or dst.unit_bytes != src.unit_bytes:
        raise fail(what, f"{dst_units.size} destination units of {dst.unit_bytes} bytes against {src_units.size} "
                         f"source units of {src.unit_bytes} bytes: the two sides do not describe one copy")
    positions = checked_positions(dst_units, dst.unit_bytes)
    if planted() and positions.size:
        corrupt(dst, int(dst_units[positions[0]]))
    per = max(1, FULL_BYTES // max(1, dst.unit_bytes))
    first_bad, bad, differ_bytes = None, 0, 0
    for begin in range(0, positions.size, per):
        chunk = positions[begin:begin + per]
        got, want = dst.read(dst_units[chunk]), src.read(src_units[chunk])
        blank = (want == 0).all(axis=1) | (want == POISON).all(axis=1)
        if blank.any():
            i = int(chunk[np.flatnonzero(blank)[0]])
            raise fail(what, f"source {src.where} {src.unit} {int(src_units[i])} holds no data (all zeros or all "
                             f"poison): a copy that did nothing would match it")
        differ = np.count_nonzero(got != want, axis=1)
        wrong = np.flatnonzero(differ)
        if wrong.size and first_bad is None:
            first_bad = (int(chunk[wrong[0]]), int(differ[wrong[0]]))
        bad += wrong.size
        differ_bytes += int(differ.sum())
    if first_bad is not None:
        i, count = first_bad
        raise fail(what, f"{dst.where} {dst.unit} {int(dst_units[i])} (from {src.where} {src.unit} "
                         f"{int(src_units[i])}) has {count} of {dst.unit_bytes} bytes unlike its source; {bad} of "
                         f"{positions.size} checked {dst.unit}s differ, {differ_bytes} bytes in all")
    return {"unit": dst.unit, "checked": int(positions.size), "of": int(dst_units.size),
            "bytes": int(positions.size) * dst.unit_bytes}


def corrupt(side: Side, unit: int) -> None:
    """The planted wrong copy: one byte of ``unit`` flipped in memory."""
    row = side.read([unit])
    row[0, 0] ^= 0xFF
    side.write([unit], row)


def merged(*checks: dict) -> dict:
    """One ``verify`` record for several copies of one row (both directions, or every side of a comparison)."""
    return {"unit": checks[0]["unit"], "checked": sum(c["checked"] for c in checks),
            "of": sum(c["of"] for c in checks), "bytes": sum(c["bytes"] for c in checks), "copies": len(checks)}


def described(check: dict | None) -> str:
    """``8/8 pages`` (or ``66/512 pages``, sampled) for a table cell."""
    if not check:
        return ""
    copies = f" in {check['copies']} copies" if check.get("copies", 1) > 1 else ""
    return f"{check['checked']}/{check['of']} {check['unit']}s{copies}"


def same_answers(what: str, answers: dict[str, list[Any]], reference: str) -> int:
    """Every answer of every row equals the first answer of ``reference`` (e2e.py: the first token id of each timed
    request against the device hit's); raise ``Mismatch`` naming the first row that differs. Returns the number of
    answers checked."""
    answers = {row: list(values) for row, values in answers.items()}
    if reference not in answers or not answers[reference]:
        raise fail(what, f"no answers from the reference row {reference!r}")
    expected = answers[reference][0]
    if planted():
        row = next((r for r in answers if r != reference and answers[r]), reference)
        answers[row][-1] = f"{answers[row][-1]} (planted)"
    for row, values in answers.items():
        wrong = [v for v in values if v != expected]
        if wrong:
            raise fail(what, f"row {row!r} answered {wrong[0]!r} in {len(wrong)} of {len(values)} timed runs, "
                             f"{reference!r} answered {expected!r}")
    return sum(len(values) for values in answers.values())
