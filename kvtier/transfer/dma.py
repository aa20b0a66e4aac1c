"""The copy-engine backends: ``direct`` (one ``cudaMemcpyAsync`` per contiguous run; also serves pageable host
pools) and ``batch`` (the runtime's batched memcpy, which falls back to ``direct`` where it is unavailable or capture is
on). Runs merge chunks contiguous on both sides, and are cut at the host buffer's registration boundaries: a copy may
not span two registrations."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.address import Address, DeviceAddress
from kvtier.memory.registration import split_at_boundaries
from kvtier.pools import device_strides
from kvtier.transfer.backend import Backend
from kvtier.transfer.job import D2H, Context, Job
from kvtier.transfer.plan import layer_spans, merge_runs


def host_pieces(context: Context, host_offsets: np.ndarray, other: np.ndarray, sizes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(host buffer offsets, other-side offsets, sizes) of the copies for runs given in host *buffer* offsets,
    each cut where a registration boundary falls inside it."""
    boundaries = context.host_pool.buffer.registration_boundaries
    if not boundaries:
        return host_offsets, other, sizes
    starts, pieces, origin, shift = split_at_boundaries(host_offsets, sizes, boundaries)
    return starts, other[origin] + shift, pieces


def copy_set(direction: str, host: tuple[Address, np.ndarray], device: tuple[Address, np.ndarray],
             sizes: np.ndarray) -> tuple[Address, np.ndarray, Address, np.ndarray, np.ndarray]:
    """Host ↔ device copies in the job's direction, each side a typed base and offsets, as ``memcpy_run_sets_async``
    takes them."""
    (dst, dst_offsets), (src, src_offsets) = (host, device) if direction == D2H else (device, host)
    return dst, dst_offsets, src, src_offsets, sizes


def queue_copies(context: Context, direction: str, host: tuple[Address, np.ndarray], device: tuple[Address, np.ndarray],
                 sizes: np.ndarray, stream: Any, batched: bool) -> None:
    """Host ↔ device copies in the job's direction: one call each or batched."""
    context.runtime.memcpy_run_sets_async([copy_set(direction, host, device, sizes)], stream=stream, batched=batched)


class DirectBackend(Backend):
    name = "direct"
    batched = False

    def run(self, job: Job) -> None:
        context = self.context
        plan = context.plan
        device_offsets = plan.offsets(job.device_pages, device_strides(context.geometry))
        host_offsets = plan.offsets(job.host_pages, context.host_pool.strides)
        host_runs, device_runs, sizes = merge_runs(host_offsets, device_offsets, plan.chunk_bytes)
        bases = [context.device_pool.layer_device_addresses(t) for t in range(context.geometry.tensors)]
        for begin, count in layer_spans(job.layers, job.per_layer):
            for layer in range(begin, begin + count):
                self._layer(job, layer, host_runs, device_runs, sizes, [b[layer] for b in bases])
            job.mark(context.runtime, context.device, begin, job.stream)

    def _layer(self, job: Job, layer: int, host_runs: np.ndarray, device_runs: np.ndarray, sizes: np.ndarray,
               device_bases: list[DeviceAddress]) -> None:
        """Every tensor's copies of the layer in one call (one batch)."""
        context = self.context
        host_pool, cpu = context.host_pool, context.host_pool.buffer.cpu_address
        sets = []
        for tensor, device_base in enumerate(device_bases):
            base = host_pool.tensor_offset(tensor) + layer * host_pool.strides.layer
            offsets, device, nbytes = host_pieces(context, base + host_runs, device_runs, sizes)
            sets.append(copy_set(job.direction, (cpu, offsets), (device_base, device), nbytes))
        context.runtime.memcpy_run_sets_async(sets, stream=job.stream, batched=self.batched)


class BatchBackend(DirectBackend):
    name = "batch"
    batched = True
