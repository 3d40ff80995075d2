"""Kiln's torch-free common layer: what the operator and the runtime must agree on.

Standard library only, so the slim operator image imports it without torch:

- ``kiln.common.constants``: ports, HTTP paths, the engine cache's paths and file names.
- ``kiln.common.enginespec``: the build spec (``BuildSpec``, ``ModelRef``) and its content
  address, the engine hash.
- ``kiln.common.manifest``: the engine folder's ``manifest.json``: one reader and one
  verifier for ``kiln build``, ``kiln serve`` and the operator.
- ``kiln.common.metrics``: the served metrics' names, types, help texts and buckets.
- ``kiln.common.tensorparallel``: whether a model splits over N tensor-parallel ranks (the
  rule of ``kiln serve`` and of the operator).
"""
