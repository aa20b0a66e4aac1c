"""The io backend interface: a new way to move KV pages subclasses :class:`Backend` and writes this primitive, the
abstract method (a subclass missing it cannot be instantiated: the TypeError names it).

- ``Backend.run(job)`` queues ``job``'s copies, all ordered before the end of ``job.stream``; returns None.

A job's ``stream`` already waits for everything the caller ordered the transfer after: a backend that queues on
streams of its own makes them wait for it first, and makes it wait for them before ``run`` returns (the engine
records the transfer's end there). On a per-layer load (``job.per_layer``) it calls ``job.mark`` once each layer (or
run of layers) is queued; a refused copy raises. Optional hooks, with defaults here: ``__init__(context, options)``
(allocate what the backend owns, taking from :class:`BackendOptions` what it needs; the base keeps both),
``drain()`` (wait for streams the backend owns besides the engine's; nothing) and ``close()`` (free what it owns,
once, after the engine drained; nothing). A backend sees a :class:`~kvtier.transfer.job.Context` and a
:class:`~kvtier.transfer.job.Job`, nothing else of the engine, which picks it by its ``name`` (``BACKENDS`` in
:mod:`kvtier.transfer.engine`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.checks import integer
from kvtier.errors import InvalidArgument

if TYPE_CHECKING:
    from kvtier.transfer.job import Context, Job


@dataclass(frozen=True)
class BackendOptions:
    """The engine's settings for its backend; each backend takes the ones it needs. ``ring_bytes``: the index arena
    of each stream; ``staging_bytes``: the device staging area of each direction (``staged``), whose relayouts use
    ``relayout_blocks`` blocks (None: every SM); ``layer_signals``: per-layer loads signalled from the device (None:
    where the runtime can wait on a memory value)."""

    ring_bytes: int
    staging_bytes: int
    relayout_blocks: int | None = None
    layer_signals: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ring_bytes", integer(self.ring_bytes, "ring_bytes", low=1))
        object.__setattr__(self, "staging_bytes", integer(self.staging_bytes, "staging_bytes", low=1))
        if self.relayout_blocks is not None:
            object.__setattr__(self, "relayout_blocks", integer(self.relayout_blocks, "relayout_blocks", low=1))
        if self.layer_signals is not None and not isinstance(self.layer_signals, bool):
            raise InvalidArgument(f"layer_signals must be None (automatic), True or False, got {self.layer_signals!r}")


class Backend(abc.ABC):
    """An io backend: moves the pages of a :class:`~kvtier.transfer.job.Job`. One ``run`` each; ``drain`` waits
    for its own streams."""

    name = "abstract"

    def __init__(self, context: Context, options: BackendOptions) -> None:
        self.context, self.options = context, options

    @abc.abstractmethod
    def run(self, job: Job) -> None:
        """Queue ``job``'s copies, all ordered before the end of ``job.stream``."""

    def drain(self) -> None:  # noqa: B027 (an optional hook: no streams of its own by default)
        """Wait for streams the backend owns besides the engine's (the engine waits for its own)."""

    def close(self) -> None:  # noqa: B027 (an optional hook: nothing owned by default)
        """Free what the backend owns; the engine drained everything before."""
