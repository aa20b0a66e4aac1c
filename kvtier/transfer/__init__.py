"""Moving KV pages between a device pool and a host pool."""

from kvtier.transfer.completion import Transfer
from kvtier.transfer.engine import BACKENDS, CURRENT, CapturedLoad, TransferEngine

__all__ = ["BACKENDS", "CURRENT", "CapturedLoad", "Transfer", "TransferEngine"]
