"""Tensor parallelism: the rank group, the worker processes and the per-step broadcast
(``parallel``)."""
