"""The model: config, weights and their layout, checkpoints, loading, the forward pass, the KV
cache and the tensor-parallel rules. Imports nothing of jaxspec above it (errors, checks, graphs
and pallas_kernels only)."""
