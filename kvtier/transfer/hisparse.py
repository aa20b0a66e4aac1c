"""HiSparse: sparse attention over a long context whose full KV lives in the host pool.

Each request keeps a device *hot buffer* per layer: ``slots`` rows managed least-recently-used, plus one row for its
newest token. At every decode step and layer, the model's indexer picks top-k tokens; :meth:`HotBuffer.swap_in`
finds them in the buffer (hits move to the most-recent end), copies the misses host → device into the least recent
rows no top-k token holds, and writes the device row of every top-k entry — all in one kernel (one block per
request), so it can be captured in a CUDA graph with the rest of the step. A sequence no longer than ``slots`` is
wholly resident (token t in row t): no copy and no LRU change. :meth:`backup_newest` copies each request's newest
token to the host (all layers) before the next step overwrites its row.

Contract with the engine: after :meth:`assign`, tokens 0..slots-1 are in rows 0..slots-1 (prefill writes them
there); the model writes a request's newest token into row ``slots`` once the sequence is longer than ``slots``; the
host pool holds every token but the newest (prefill backs them up; ``backup_newest`` each step). Top-k entries are
token ids, -1 for padding; an entry outside [0, seq_len) gets row -1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher, SwapIn
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.memory.lifetime import Owned
from kvtier.pools import DevicePool, HostPool, build_pointer_table, device_strides
from kvtier.runtime import Stream
from kvtier.transfer.completion import Transfer, user_event
from kvtier.transfer.indices import IndexRing
from kvtier.transfer.lifetime import PoolUser
from kvtier.transfer.ordering import CURRENT, order_after
from kvtier.transfer.plan import plan_for

STATE = ("slot_tokens", "lru", "lru_next", "token_slot", "flags", "miss_src", "miss_dst", "host_locs", "device_locs")


class HotBuffer(PoolUser):
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, requests: int, slots: int, top_k: int,
                 max_tokens: int, launcher: KernelLauncher | None = None, threads: int = 1024) -> None:
        """``device_pool``: rows (page size 1) of the same kind, layers and row as ``host_pool``; request r's rows
        are r * (slots + 1) .. + slots unless :meth:`assign` names others."""
        g, h = device_pool.geometry, host_pool.geometry
        if g.page_size != 1:
            raise InvalidArgument(f"the hot buffer's device pool holds rows (page size 1), not {g.page_size}-token "
                                  f"pages")
        if (g.kind, g.layers, g.row_bytes, g.heads) != (h.kind, h.layers, h.row_bytes, h.heads):
            raise InvalidArgument(f"device rows {g} and host pages {h} differ in kind, layers or row")
        if device_pool.runtime is not host_pool.runtime:
            raise InvalidArgument("device and host pools belong to different runtimes")
        if host_pool.buffer.kind is HostKind.PAGEABLE:
            raise InvalidArgument("swap-in reads the host pool from the GPU: it must be registered, pinned or shm")
        plan = plan_for(h, host_pool.strides)
        if plan.unit == "head":
            raise InvalidArgument(f"a {host_pool.layout.value} host pool splits token rows by head: swap-in copies "
                                  f"whole rows (use layer_first, page_first or page_first_direct)")
        self.requests, self.slots = integer(requests, "requests", low=1), integer(slots, "slots", low=1)
        self.top_k = integer(top_k, "top_k", low=1, high=self.slots + 1)
        self.max_tokens = integer(max_tokens, "max_tokens", low=self.slots + 1)
        self.device_pool, self.host_pool, self.geometry = device_pool, host_pool, g
        self.runtime, self.device, self.threads = device_pool.runtime, device_pool.device, threads
        self.launcher = launcher or KernelLauncher(self.runtime)
        self._start(device_pool, host_pool)
        self._host_locs = np.full((self.requests, self.max_tokens), -1, np.int64)
        self._device_locs = np.full((self.requests, self.slots + 1), -1, np.int64)
        self._spilled = np.zeros(self.requests, dtype=bool)
        self._assigned = np.zeros(self.requests, dtype=bool)
        if device_pool.pages >= self.requests * (self.slots + 1):  # the documented default rows, where they fit
            self._device_locs[:] = np.arange(self.requests * (self.slots + 1)).reshape(self.requests, -1)
        self._owned = Owned()
        r, n, k, t, layers = self.requests, self.slots, self.top_k, self.max_tokens, g.layers
        sizes = {"slot_tokens": r * layers * (n + 1) * 4, "lru": r * layers * n * 4, "lru_next": r * n * 4,
                 "token_slot": r * layers * t * 4, "flags": r * n * 4, "miss_src": r * k * 8, "miss_dst": r * k * 8,
                 "host_locs": r * t * 8, "device_locs": r * (n + 1) * 8}
        with self._owned.building() as owned:
            self.state = {name: owned.own(DeviceBuffer(sizes[name], self.device, runtime=self.runtime))
                          for name in STATE}
            self.out = owned.own(DeviceBuffer(r * k * 8, self.device, runtime=self.runtime))
            reset = sum(-(-size // r // 16) * 16 for name, size in sizes.items() if name not in
                        ("lru_next", "flags", "miss_src", "miss_dst"))
            self._staging = owned.own(HostBuffer.allocate(reset, HostKind.PINNED, runtime=self.runtime))
            self.d2h = owned.own(self.runtime.create_stream(self.device))
            self._ring = owned.own(IndexRing(self.runtime, self.device, self.d2h, 4 * r * 8))
            self._inputs: dict[Any, IndexRing] = {}
            device_table = owned.own(build_pointer_table(self.runtime, self.device, [
                op for tensor in range(g.tensors) for op in device_pool.layers[tensor]]))
            host_table = owned.own(build_pointer_table(self.runtime, self.device, [
                region for tensor in range(g.tensors) for region in host_pool.layer_regions(tensor)]))
        dev = device_strides(g)
        self.device_side = ChunkSide(device_table, dev.page, 0, 0, 1)
        self.host_side = ChunkSide(host_table, host_pool.strides.page, host_pool.strides.slot, 0, h.page_size)
        self.state["flags"].upload(np.zeros(r * n, np.int32))
        self._staged: Any = None
        for request in range(r):
            self._reset(request)
        self._attach()

    # -- set-up ------------------------------------------------------------------------------------------------------
    def assign(self, request: int, host_tokens: Any, device_rows: Any = None, *, stream: Any = None) -> None:
        """Give ``request`` its tokens' host units (token ids 0..len-1 → host token units, page * page_size + slot)
        and, optionally, its ``slots + 1`` device rows; resets its LRU state (token t in row t). The reset is queued
        on ``stream`` (default: the caller's current stream, where its swap-ins run) without synchronizing the
        device: a new request must not stall the others' decode steps."""
        with self._lock:
            self._check_open()
            request = integer(request, "request", low=0, high=self.requests)
            host = index_array(host_tokens, "host_tokens")
            if host.size > self.max_tokens:
                raise InvalidArgument(f"{host.size} tokens exceed max_tokens={self.max_tokens}")
            self.host_pool.check_pages(host // self.host_pool.geometry.page_size)
            rows = np.arange(request * (self.slots + 1), (request + 1) * (self.slots + 1)) if device_rows is None \
                else index_array(device_rows, "device_rows")
            if rows.size != self.slots + 1 or np.unique(rows).size != rows.size:
                raise InvalidArgument(f"a request needs {self.slots + 1} distinct device rows, got {rows.size}")
            self.device_pool.check_pages(rows, "device row")
            others = np.arange(self.requests) != request
            holders = np.flatnonzero(np.isin(self._device_locs, rows).any(axis=1) & others)
            claimed = [int(h) for h in holders if self._assigned[h]]
            if claimed:
                raise InvalidArgument(f"device rows {np.intersect1d(rows, self._device_locs[claimed[0]])[:4].tolist()} "
                                      f"belong to request {claimed[0]}: two requests would overwrite each other's "
                                      f"hot rows (release({claimed[0]}) first)")
            self._device_locs[holders] = -1      # unassigned requests lose default rows another takes
            target = self.runtime.current_stream(self.device) if stream is None else self.runtime.as_stream(stream)
            self._host_locs[request] = -1
            self._host_locs[request, :host.size] = host
            self._device_locs[request] = rows
            self._spilled[request] = False
            self._assigned[request] = True
            self._reset(request, target)

    def release(self, request: int) -> None:
        """Take ``request``'s device rows and host units away (its rows may then go to another request); it cannot
        swap in until assigned again."""
        with self._lock:
            self._check_open()
            request = integer(request, "request", low=0, high=self.requests)
            self._device_locs[request] = -1
            self._host_locs[request] = -1
            self._spilled[request] = self._assigned[request] = False

    def _reset_arrays(self, request: int) -> list[tuple[str, np.ndarray]]:
        """(state buffer, the request's contiguous bytes there) of a fresh LRU state: token t in row t."""
        n, t, layers = self.slots, self.max_tokens, self.geometry.layers
        tokens = np.tile(np.concatenate([np.arange(n), [-1]]).astype(np.int32), layers)
        token_slot = np.full((layers, t), -1, np.int32)
        token_slot[:, :n] = np.arange(n, dtype=np.int32)
        return [("slot_tokens", tokens), ("lru", np.tile(np.arange(n, dtype=np.int32), layers)),
                ("token_slot", token_slot.reshape(-1)), ("host_locs", self._host_locs[request]),
                ("device_locs", self._device_locs[request])]

    def _reset(self, request: int, stream: Stream | None = None) -> None:
        """Write the request's fresh state: synchronously (construction), or queued on ``stream`` from a pinned
        staging area whose previous contents are rewritten only once their copies have run."""
        arrays = self._reset_arrays(request)
        if stream is None:
            for name, array in arrays:
                self.state[name].upload(array, request * array.nbytes)
            return
        if self._staged is not None:
            self._staged.synchronize()
        view = self._staging.as_tensor().numpy()
        offset = 0
        for name, array in arrays:
            view[offset:offset + array.nbytes] = array.view(np.uint8)
            self.runtime.memcpy_async(self.state[name].address + request * array.nbytes,
                                      self._staging.cpu_address + offset, array.nbytes, stream=stream)
            offset += -(-array.nbytes // 16) * 16
        del view
        self._staged = self.runtime.create_event(self.device)
        self._staged.record(stream)

    # -- the step ---------------------------------------------------------------------------------------------------
    def swap_in(self, layer: int, requests: Any, topk: Any, seq_lens: Any, *, out: Any = None,
                stream: Any = None) -> Any:
        """Swap ``layer``'s top-k tokens of each request into its hot buffer on ``stream`` (default: the caller's
        current stream); returns ``out`` ([batch, top_k] int64 device rows; the buffer's own unless given).

        ``requests`` / ``seq_lens`` (int64) and ``topk`` (int32, [batch, top_k]) are host arrays (checked, then
        uploaded on the stream) or device operands (tensors, buffers; read by the kernel as they are, e.g. the
        indexer's output inside a CUDA graph)."""
        with self._lock:
            self._check_open()
            layer = integer(layer, "layer", low=0, high=self.geometry.layers)
            target = self.runtime.current_stream(self.device) if stream is None else self.runtime.as_stream(stream)
            on_device = [_is_device(x) for x in (requests, topk, seq_lens)]
            if all(on_device):
                batch = _rows(requests)
                ops = [requests, topk, seq_lens]
            elif not any(on_device):
                ops, batch = self._upload(requests, topk, seq_lens, target)
            else:
                raise InvalidArgument("give requests, topk and seq_lens all as host arrays or all on the device")
            if batch > self.requests:
                raise InvalidArgument(f"a batch of {batch} requests exceeds the buffer's {self.requests}")
            if all(on_device):
                for operand, need, name in ((topk, batch * self.top_k * 4, "topk"), (seq_lens, batch * 8, "seq_lens")):
                    if _nbytes(operand) < need:
                        raise InvalidArgument(f"{name} holds {_nbytes(operand)} bytes, a batch of {batch} needs {need}")
            out = self.out if out is None else out
            if _nbytes(out) < batch * self.top_k * 8:
                raise InvalidArgument(f"out holds {_nbytes(out)} bytes: a batch of {batch} needs "
                                      f"{batch * self.top_k * 8} ([batch, top_k] int64)")
            call = SwapIn(tuple(self.state[name] for name in STATE), self.host_side, self.device_side, ops[1], ops[0],
                          ops[2], out, batch, self.slots, self.top_k, self.max_tokens, layer, self.geometry.layers,
                          self.geometry.tensors, self.geometry.layers, self.geometry.row_bytes)
            self.launcher.swap_in(call, device=self.device, stream=target, threads=self.threads)
            return out

    def _upload(self, requests: Any, topk: Any, seq_lens: Any, stream: Stream) -> tuple[list[Any], int]:
        reqs, seqs = index_array(requests, "requests"), index_array(seq_lens, "seq_lens")
        top = np.asarray(topk)
        if top.ndim != 2 or top.shape != (reqs.size, self.top_k) or not np.issubdtype(top.dtype, np.integer):
            raise InvalidArgument(f"topk must be integers of shape ({reqs.size}, {self.top_k}), got {top.shape}")
        if seqs.size != reqs.size:
            raise InvalidArgument(f"{reqs.size} requests but {seqs.size} sequence lengths")
        if reqs.size and (reqs.min() < 0 or reqs.max() >= self.requests):
            raise InvalidArgument(f"request {int(reqs.max())} is out of range (buffer has {self.requests})")
        if np.unique(reqs).size != reqs.size:
            raise InvalidArgument("a request appears twice in one swap-in batch")
        if (self._device_locs[reqs] < 0).any():
            raise InvalidArgument(f"request {int(reqs[(self._device_locs[reqs] < 0).any(axis=1)][0])} has no device "
                                  f"rows: assign() them")
        if seqs.size and (seqs.min() < 1 or seqs.max() > self.max_tokens):
            raise InvalidArgument(f"sequence lengths must be in [1, {self.max_tokens}], got {seqs.tolist()}")
        for req, seq in zip(reqs.tolist(), seqs.tolist(), strict=True):
            if seq > self.slots and (self._host_locs[req, :seq - 1] < 0).any():
                raise InvalidArgument(f"request {req} has {seq} tokens but host units for fewer: assign() them")
            if seq <= self.slots and self._spilled[req]:
                raise InvalidArgument(f"request {req} is back to {seq} tokens after swap-ins moved other tokens into "
                                      f"its rows (a rollback): assign() it again so token t is in row t")
        self._spilled[reqs[seqs > self.slots]] = True
        top = np.where((top < -(1 << 31)) | (top >= 1 << 31), -1, top)   # out of [0, seq_len) as int32 too
        # one ring per native stream: wrappers of the same stream (torch's current stream, the legacy stream: handle
        # 0) are new objects at every call, so their id would allocate a ring per step
        key = (stream.device, stream.handle)
        ring = self._inputs.get(key)
        if ring is None:
            ring = self._inputs[key] = self._owned.own(
                IndexRing(self.runtime, self.device, stream, 4 * (2 * self.requests * 8 + self.requests * self.top_k
                                                                  * 4)))
        ring.stream = stream  # the caller's wrapper of that native stream (an old one may be destroyed)
        addresses, lease = ring.upload([reqs.astype(np.int64), top.astype(np.int32).reshape(-1),
                                        seqs.astype(np.int64)])
        ring.fence(lease)
        return addresses, int(reqs.size)

    def backup_newest(self, requests: Any, seq_lens: Any, *, after: Any = CURRENT) -> Transfer:
        """Copy each request's newest token (its row ``slots``, every layer) to its host unit, on the buffer's D2H
        stream, ordered after ``after`` (default: the caller's current stream, where the model wrote it)."""
        with self._lock:
            self._check_open()
            reqs, seqs = index_array(requests, "requests"), index_array(seq_lens, "seq_lens")
            if reqs.size != seqs.size or (reqs.size and (reqs.min() < 0 or reqs.max() >= self.requests)):
                raise InvalidArgument("requests and seq_lens must match and name assigned requests")
            if np.unique(reqs).size != reqs.size:
                raise InvalidArgument("a request appears twice in one backup_newest: its newest row would be copied "
                                      "over an older token's host KV")
            if (self._device_locs[reqs] < 0).any():
                raise InvalidArgument("backup_newest of a request with no device rows: assign() it first")
            if seqs.size and (seqs.min() <= self.slots or seqs.max() > self.max_tokens):
                raise InvalidArgument(f"only sequences longer than the {self.slots} slots have a newest-token row")
            host = self._host_locs[reqs, seqs - 1]
            if (host < 0).any():
                raise InvalidArgument("a newest token has no host unit: assign() the request's tokens first")
            order_after(self.runtime, self.d2h, after)
            transfer = Transfer(self.runtime, user_event(self.runtime, self.device))
            indices, lease = self._ring.upload([self._device_locs[reqs, self.slots].astype(np.int64),
                                                host.astype(np.int64)])
            try:
                g = self.geometry
                call = ChunkCopy(src=self.device_side, dst=self.host_side, src_index=indices[0], dst_index=indices[1],
                                 index_bytes=8, n_units=reqs.size, layer_begin=0, n_layers=g.layers, n_pieces=1,
                                 chunk_bytes=g.row_bytes, n_tensors=g.tensors, table_layers=g.layers)
                self.launcher.copy_chunks(call, device=self.device, stream=self.d2h)
            finally:
                self._ring.fence(lease)
            transfer.finished.record(self.d2h)
            return transfer

    def read_state(self, request: int, layer: int) -> dict[str, np.ndarray]:
        """The request's LRU state for ``layer`` (tests, debugging): slot tokens, LRU order (least recent first)."""
        self.synchronize()
        n, layers = self.slots, self.geometry.layers
        row = integer(request, "request", low=0, high=self.requests) * layers + integer(layer, "layer", low=0,
                                                                                       high=layers)
        tokens = np.frombuffer(self.state["slot_tokens"].download(row * (n + 1) * 4, (n + 1) * 4), np.int32)
        lru = np.frombuffer(self.state["lru"].download(row * n * 4, n * 4), np.int32)
        return {"slot_tokens": tokens.copy(), "lru": lru.copy(), "device_rows": self._device_locs[request].copy()}

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        if self._closed:
            return
        self.d2h.synchronize()
        self.runtime.synchronize(self.device)   # not the callers' streams: they may be destroyed by now

    def _release(self) -> None:
        self._owned.close()

def _is_device(operand: Any) -> bool:
    return isinstance(operand, DeviceBuffer) or getattr(getattr(operand, "device", None), "type", None) == "cuda"


def _rows(operand: Any) -> int:
    if isinstance(operand, DeviceBuffer):
        return operand.nbytes // 8
    return int(operand.numel())


def _nbytes(operand: Any) -> int:
    """Bytes a device operand (buffer, region, tensor) holds from its start."""
    if hasattr(operand, "numel") and hasattr(operand, "element_size"):
        return int(operand.numel()) * int(operand.element_size())
    return int(operand.nbytes)
