"""A decode engine's use of ``kvtier.disagg`` with a ``KVCache``: receive a prefilled request's KV into cache pages
and insert it, so the cache serves the prefix.

It lives here, above both layers, because ``kvtier.disagg`` moves pages between pools and must not know the radix
tree, and the cache must not know Mooncake. The link's receiver must be over the cache's device pool::

    receiver = KVReceiver(cache.device_pool, dtype="bfloat16")       # its address goes to the prefill side
    link = receiver.accept()
    inserted = receive_prefix(cache, link, "req-7", tokens)         # the prefix is the cache's now
"""

from __future__ import annotations

from typing import Any

from kvtier.cache import KVCache
from kvtier.disagg import Link
from kvtier.errors import InvalidArgument


def receive_prefix(cache: KVCache, link: Link, request_id: str, tokens: Any, *,
                   timeout: float | None = None) -> int:
    """Receive request ``request_id``'s KV for the whole pages of ``tokens`` and insert it; returns the pages
    received. What the cache holds already (its matched prefix, host part loaded back) is not asked for: the sender
    is told to start past it. If the transfer fails (the sender died, dropped the link, or failed), the error is
    raised (PeerLost / TransferFailed naming the peer and the request) and nothing is inserted: the pages go back to
    the cache."""
    if link.receiver.pool is not cache.device_pool:
        raise InvalidArgument("receive_prefix: the link's receiver must be over the cache's device pool")
    with cache.request(tokens, prefetch=False) as request:
        request.wait()
        skip = len(request.prefix_pages)
        pages = request.allocate()
        if len(pages):
            link.expect(request_id, pages, skip=skip).wait(timeout)
        request.insert(after=None)
    return len(pages)
