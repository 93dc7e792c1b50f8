"""Where a benchmark's time goes: `jaxinfer bench throughput | latency --profile` (engine_profile.py)
and the modules it runs, plus the kernel-level profilers (`python -m jaxinfer.bench.profile.<name>`):
device traces (trace_decode, trace_prefill, trace_tp_step), Mosaic's in-kernel profiler
(profile_decode, profile_prefill), the jaxpr op census of a step (step_op_census), reads of
optimized HLO (hlo_weight_reads, hlo_collectives, mosaic_operands over hlo_text), ptxas reports
(dump_kernels), the kernels' lowered IR (mosaic_ir), and the host's cost of a step under XLA's
command buffers (command_buffers)."""
