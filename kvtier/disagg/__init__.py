"""Prefill → decode KV transfer between processes over Mooncake's transfer engine (docs/disagg.md).

The decode side runs a :class:`KVReceiver` over its pool and tells each sender, per request, which pages to fill;
the prefill side's :class:`KVSender` writes its pages' bytes straight into them and says when it is done; the
receiver's :class:`Landing` reports the request landed only then. This layer knows pools, not the radix tree:
``kvtier.integrations.disagg`` hands landed pages to a ``KVCache``.
"""

from kvtier.disagg.plan import Side, compatible, plan_runs
from kvtier.disagg.receiver import KVReceiver, Landing, Link
from kvtier.disagg.sender import KVSender
from kvtier.disagg.wire import MooncakeWire, reaches_device

__all__ = ["KVReceiver", "KVSender", "Landing", "Link", "MooncakeWire", "Side", "compatible", "plan_runs",
           "reaches_device"]
