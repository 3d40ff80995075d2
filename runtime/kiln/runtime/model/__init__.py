"""Kiln's own model code (Llama family), written so tensor parallelism can be added:
column/row-parallel linears, fused QKV and gate-up projections, per-parameter loaders."""
