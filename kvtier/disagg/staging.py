"""Staging pages: a host pool an endpoint owns for what the wire cannot take straight from the caller's pool (a
device pool; or, on the sender, pages whose layout the receiver does not share), handed out per transfer."""

from __future__ import annotations

import numpy as np

from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.locks import named_condition
from kvtier.pools import HostLayout, HostPool, KVGeometry
from kvtier.runtime import Runtime


class Staging:
    def __init__(self, geometry: KVGeometry, layout: HostLayout, pages: int, runtime: Runtime) -> None:
        self.pool = HostPool.allocate(geometry, layout, pages=pages, runtime=runtime)
        self._free = list(range(pages))
        self._cond = named_condition("disagg.staging")
        self._closed = False

    def take(self, count: int, *, partial: bool, wait: bool = True) -> np.ndarray:
        """``count`` pages; with ``partial``, as many as are free (at least one, waiting for one if none is and
        ``wait``; none without). Without it, all ``count`` now or InvalidArgument (a receiver cannot wait: its pages
        are asked for up front)."""
        with self._cond:
            if not partial and count > len(self._free):
                raise InvalidArgument(f"{count} pages do not fit the {len(self._free)} free staging pages (of "
                                      f"{self.pool.pages}): give the endpoint more staging_pages")
            if wait:
                self._cond.wait_for(lambda: self._free or self._closed)
            if self._closed:
                raise BufferClosed("the endpoint closed while a transfer waited for staging pages")
            taken, self._free = self._free[:count], self._free[count:]
        return np.asarray(taken, dtype=np.int64)

    def give(self, pages: np.ndarray) -> None:
        with self._cond:
            self._free.extend(int(p) for p in pages)
            self._free.sort()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.pool.close()

