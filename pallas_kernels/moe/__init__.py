"""MoE kernels: the routed experts' grouped matmuls and their dispatch point (`moe_experts`)."""
