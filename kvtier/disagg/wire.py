"""Mooncake's transfer engine as kvtier's wire: one engine per endpoint, memory registered once, writes checked.

Mooncake's Python binding returns bare integers (0 ok, negative an error) and logs the reason; every call here
checks its code and raises :class:`~kvtier.errors.TransferFailed` naming the peer and the request. What was measured
(loopback TCP, the non-CUDA wheel 0.3.13), and shapes this module:

- A batch of thousands of entries overflows the TCP lane's queue and the whole batch returns -1; batches here stay
  at ``MAX_ENTRIES`` entries and ``MAX_BATCH_BYTES`` bytes (which also bounds how long a close waits for one).
- Small entries are slow (2 KiB runs: 0.1 GB/s; 32 KiB: 0.9; 16 MiB: 2.5), which is why the sender converts layouts
  locally instead of scattering rows over the wire (``kvtier/disagg/plan.py``).
- A peer SIGKILLed mid-write fails the batch in ~0.1 s with -1 (connection reset), and every later write to it in
  ~1 s (connection refused, with back-off); a write into memory the peer has not registered (or has unregistered) is
  refused by the peer at once. Nothing hangs, so writes need no timeout of their own.

Registered addresses are CPU addresses: a transport that cannot reach device memory (TCP, the non-CUDA wheel) only
ever sees host memory by the address the CPU uses. Device addresses are taken only where :func:`reaches_device`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterator

import numpy as np

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import AddressDomainError, RuntimeUnavailable, TransferFailed
from kvtier.pause_points import reached

MAX_ENTRIES = 512
MAX_BATCH_BYTES = 64 << 20
MAX_ENTRY_BYTES = 16 << 20
INSTALL = "pip install mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine, with CUDA)"


def reaches_device(runtime_name: str) -> bool:
    """Whether the installed Mooncake can register and write GPU memory of ``runtime_name``'s devices: only the CUDA
    wheel on the ``cuda`` runtime (the emulator's device addresses are not memory any transport can reach)."""
    if runtime_name != "cuda":
        return False
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class MooncakeWire:
    """One Mooncake ``TransferEngine``: ``session`` is what a peer calls this process by (``host:rpc_port``)."""

    def __init__(self, hostname: str = "127.0.0.1", metadata: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 device_name: str = "", *, device_memory: bool = False, batch_entries: int = MAX_ENTRIES,
                 batch_bytes: int = MAX_BATCH_BYTES) -> None:
        """``metadata``: ``P2PHANDSHAKE`` (peers exchange segment descriptors themselves: no server) or a metadata
        server's URL. ``device_memory``: this wire may register device addresses (see :func:`reaches_device`).
        ``batch_entries`` / ``batch_bytes``: the most one Mooncake batch carries."""
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeUnavailable(f"kvtier.disagg needs Mooncake's transfer engine ({INSTALL}): {exc}") from exc
        self.engine = TransferEngine()
        code = self.engine.initialize(hostname, metadata, protocol, device_name)
        if code != 0:
            raise TransferFailed(f"Mooncake TransferEngine.initialize({hostname!r}, {metadata!r}, {protocol!r}) "
                                 f"returned {code}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.device_memory = device_memory
        self._registered: list[int] = []
        self.batch_entries, self.batch_bytes = batch_entries, batch_bytes

    def register(self, address: CpuAddress | DeviceAddress, nbytes: int) -> None:
        if isinstance(address, DeviceAddress) and not self.device_memory:
            raise AddressDomainError(f"{address}: this wire reaches host memory only; register its CPU address")
        if not isinstance(address, (CpuAddress, DeviceAddress)):
            raise AddressDomainError(f"register takes a CpuAddress or DeviceAddress, not {address!r}")
        code = self.engine.register_memory(address.value, nbytes)
        if code != 0:
            raise TransferFailed(f"Mooncake register_memory({address}, {nbytes}) returned {code}")
        self._registered.append(address.value)

    def unregister_all(self) -> None:
        """Unregister everything, last first; the peer's writes into it are refused from here on. Every region is
        tried; the first failure is raised after."""
        failed = []
        while self._registered:
            address = self._registered.pop()
            code = self.engine.unregister_memory(address)
            if code != 0:
                failed.append(f"0x{address:x}: {code}")
        if failed:
            raise TransferFailed(f"Mooncake unregister_memory failed for {', '.join(failed)}")

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, *,
              request_id: str | None = None, going: Callable[[], None] | None = None) -> int:
        """Write runs ``local[i]`` → ``remote[i]`` of ``lengths[i]`` bytes into ``peer``'s registered memory, in
        batches; returns the bytes written. Raises TransferFailed at the first batch that fails (the ones before it
        have landed; the peer must not take any of it as valid). ``going()`` runs before each batch: it raises to
        stop a write between batches (a close)."""
        total = 0
        for batch in batches(local, remote, lengths, self.batch_entries, self.batch_bytes):
            reached("disagg.wire.batch")
            if going is not None:
                going()
            code = self.engine.batch_transfer_sync_write(peer, *batch)
            if code != 0:
                raise TransferFailed(f"Mooncake batch_transfer_sync_write to {peer} "
                                     f"returned {code} after {total} bytes (peer gone, or memory not registered "
                                     f"there)", peer=peer, request_id=request_id)
            total += sum(batch[2])
        return total

    def start(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, *,
              going: Callable[[], None] | None = None) -> Writing:
        """Submit the runs' batches without waiting for them (the caller prepares the next ones meanwhile), then
        ``finish()`` the result. A failure to submit, or ``going()`` raising, is raised by ``finish`` (after the
        batches submitted before it were waited for), so the caller has one place to wait."""
        writing = Writing(self, peer)
        for batch in batches(local, remote, lengths, self.batch_entries, self.batch_bytes):
            try:
                reached("disagg.wire.batch")
                if going is not None:
                    going()
            except BaseException as exc:
                writing.error = exc
                break
            batch_id = self.engine.batch_transfer_async_write(peer, *batch)
            if batch_id <= 0:
                writing.error = TransferFailed(f"Mooncake batch_transfer_async_write to {peer} returned {batch_id}",
                                               peer=peer)
                break
            writing.batches.append((batch_id, sum(batch[2])))
        return writing


class Writing:
    """Batches submitted with ``batch_transfer_async_write`` and not yet waited for (:meth:`MooncakeWire.start`):
    the memory they read must stay registered and unchanged until :meth:`finish` returned."""

    def __init__(self, wire: MooncakeWire, peer: str) -> None:
        self.wire, self.peer = wire, peer
        self.batches: list[tuple[int, int]] = []
        self.error: BaseException | None = None

    def finish(self) -> int:
        """Wait for every batch; the bytes written, or the first failure raised once all were waited for."""
        failed, total = self.error, 0
        for batch_id, nbytes in self.batches:
            code = self.wire.engine.get_batch_transfer_status([batch_id])
            if code != 0 and failed is None:
                failed = TransferFailed(f"Mooncake batch transfer to {self.peer} returned {code} after {total} "
                                        f"bytes (peer gone, or memory not registered there)", peer=self.peer)
            total += nbytes
        self.batches, self.error = [], None
        if failed is not None:
            raise failed
        return total


def batches(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, max_entries: int = MAX_ENTRIES,
            max_bytes: int = MAX_BATCH_BYTES) -> Iterator[tuple[list, list, list]]:
    """Runs cut into entries of at most MAX_ENTRY_BYTES, grouped into batches of at most ``max_entries`` entries and
    ``max_bytes`` bytes (a larger entry alone)."""
    pieces = np.maximum(1, -(-lengths // MAX_ENTRY_BYTES))
    if pieces.max(initial=1) > 1:
        index = np.repeat(np.arange(len(lengths)), pieces)
        within = np.arange(len(index)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = within * MAX_ENTRY_BYTES
        local, remote = local[index] + offset, remote[index] + offset
        lengths = np.minimum(lengths[index] - offset, MAX_ENTRY_BYTES)
    start, size = 0, 0
    for end in range(len(lengths)):
        if end > start and (end - start >= max_entries or size + int(lengths[end]) > max_bytes):
            yield local[start:end].tolist(), remote[start:end].tolist(), lengths[start:end].tolist()
            start, size = end, 0
        size += int(lengths[end])
    if start < len(lengths):
        yield local[start:].tolist(), remote[start:].tolist(), lengths[start:].tolist()
