"""Transfer kernels: one CUDA source (AOT or JIT), a Python reference, and the launch boundary."""

from kvtier.kernels.launch import ChunkCopy, ChunkSide, KernelLauncher, PreparedCopy, SwapIn

__all__ = ["ChunkCopy", "ChunkSide", "KernelLauncher", "PreparedCopy", "SwapIn"]
