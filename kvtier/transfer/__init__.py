"""Moving KV pages between a device pool and a host pool."""

from kvtier.transfer.engine import BACKENDS, CURRENT, CapturedLoad, TransferEngine
from kvtier.transfer.job import Transfer

__all__ = ["BACKENDS", "CURRENT", "CapturedLoad", "Transfer", "TransferEngine"]
