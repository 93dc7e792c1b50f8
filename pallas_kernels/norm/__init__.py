"""Residual add + RMSNorm: the Triton-lowered kernel and its jnp reference."""
