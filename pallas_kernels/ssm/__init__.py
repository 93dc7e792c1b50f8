"""Kernels of the hybrid models' recurrent layers: Gated DeltaNet (Qwen3-Next), Mamba-2's SSD scan
(Granite 4.0-H, Nemotron-H, Falcon-H1) and the causal depthwise conv1d both put before them."""
