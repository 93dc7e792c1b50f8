"""Weight quantization: FP8 (e4m3, W8A8 on FP8 tensor cores) and int8 weight-only (W8A16).

- `ops`: per-channel quantization and `quantized_matmul`, the one matmul of quantized layers;
- `layers`: the model's Dense factory and the expert stacks' declaration;
- `loading`: quantized params from FP8/int8 checkpoints, or from bf16 weights quantized on load.

Beside it: `model/quant_scheme.py` (which quantization a model runs: config.json's
`quantization_config`, --quantization) and `model/quant_writer.py` (a quantized checkpoint in the
compressed-tensors layout, `jaxinfer convert`).

docs/quantization.md describes the formats and the measured speed.
"""
