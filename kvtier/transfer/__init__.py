"""Moving KV pages between a device pool and a host pool."""

from kvtier.transfer.engine import BACKENDS, CapturedLoad, Transfer, TransferEngine

__all__ = ["BACKENDS", "CapturedLoad", "Transfer", "TransferEngine"]
