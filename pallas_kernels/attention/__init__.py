"""Attention kernels over the paged KV cache (decode, flash prefill, split combine), their jnp
references, the fp8 KV scheme and the backend dispatch."""
