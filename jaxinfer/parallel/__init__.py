"""Running one model over several devices and hosts: the mesh and every sharding decision
(sharding.py), the attention kernels and routed experts under shard_map (attention.py, experts.py),
and multi-process runs (distributed.py); the data-parallel front end is in jaxinfer/frontends/.
docs/multi_gpu.md."""
