"""Running one model over several devices and hosts: the mesh and every sharding decision
(sharding.py), the attention kernels under shard_map (attention.py), data-parallel replicas behind
one front end (data_parallel.py), and multi-process runs (distributed.py). docs/multi_gpu.md."""
