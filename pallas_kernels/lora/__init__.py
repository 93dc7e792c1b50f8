"""LoRA kernels: the shrink/expand matmuls of mixed-adapter batches, grouped by slot."""
