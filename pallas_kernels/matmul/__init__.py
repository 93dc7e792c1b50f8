"""Dense matmul kernels (FP8 weight streaming)."""
