"""Attention over the paged KV cache: the metadata of a step's batch and the backend that
picks the Triton kernels (CUDA) or the torch references (CPU) of ``kiln.kernels``."""

from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
