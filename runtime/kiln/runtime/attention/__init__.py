"""Attention over the paged KV cache: metadata shared by all backends, a torch backend
(CPU) and the Triton backend (CUDA, from ``kiln.kernels``)."""

from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
