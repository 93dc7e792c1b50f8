"""The kernel table (jaxinfer/model/kernel_table.py): what the resolver puts in each slot per
platform and flags; the model code neither probes the device nor keeps kernel choices in its
config (read with `ast`); and the wrappers of tensor parallelism and the fp8 KV cache keep the
norm kernel, which an engine's steps then call."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import norm_spy
from jaxinfer.model.experts import RoutedExperts
from jaxinfer.model.gemm_rows import gemm_rows, plain_rows
from jaxinfer.model.kernel_table import CPU, REFERENCE_KERNELS, Platform, resolve_kernels
from jaxinfer.model.lora.delta import LoraDelta
from jaxinfer.model.quant.ops import QuantizedMatmul
from jaxinfer.model.routing import Router
from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.kv_quant import FP8KVAttention
from pallas_kernels.norm.reference import add_rms_norm_reference
from test_engine_support import make_engine, prompt_ids, run_all

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "jaxinfer" / "model"
RESOLVER = MODEL / "kernel_table.py"
HOPPER, AMPERE = Platform("gpu", (9, 0)), Platform("gpu", (8, 0))
# Reading which device this is: the resolver's business alone.
PROBE_CALLS = {"default_backend"}
PROBE_ATTRIBUTES = {"platform", "device_kind", "compute_capability"}


def device_probes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PROBE_CALLS):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}()")
        elif isinstance(node, ast.Attribute) and node.attr in PROBE_ATTRIBUTES:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_no_device_probe_in_the_model_outside_the_resolver():
    probes = [p for path in sorted(MODEL.rglob("*.py")) if path != RESOLVER
              for p in device_probes(path)]
    assert probes == []
    assert device_probes(RESOLVER)  # the detector sees the one probe there is


def test_model_config_has_no_kernel_choice_fields():
    tree = ast.parse((MODEL / "config.py").read_text())
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    fields = [n.target.id for n in config.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert "num_layers" in fields  # the fields are where this reads them
    assert [f for f in fields if f.endswith("_impl")] == []


def test_cpu_resolves_to_the_reference_table():
    assert resolve_kernels(CPU) == REFERENCE_KERNELS  # equal tables: one compile-cache key
    assert REFERENCE_KERNELS.attention is REFERENCE
    assert REFERENCE_KERNELS.add_rms_norm is add_rms_norm_reference
    assert REFERENCE_KERNELS.gemm_rows is plain_rows
    assert REFERENCE_KERNELS.lora_delta == LoraDelta("xla", interpret=True)
    assert REFERENCE_KERNELS.quantized_matmul == QuantizedMatmul("auto", None)
    assert REFERENCE_KERNELS.routing == Router(fused=False)


def test_gpu_tables_take_the_kernels_their_platform_supports():
    from pallas_kernels.attention.latent_decode_mosaic import MosaicLatentDecode
    from pallas_kernels.norm.rms_norm import add_rms_norm_triton
    hopper, ampere = resolve_kernels(HOPPER), resolve_kernels(AMPERE)
    assert (hopper.attention.name, ampere.attention.name) == ("mosaic", "triton")
    for table in (hopper, ampere):
        assert table.add_rms_norm is add_rms_norm_triton and table.gemm_rows is gemm_rows
        assert table.lora_delta == LoraDelta("pallas", interpret=False)
        assert table.routing == Router(fused=True, interpret=False)
    assert hopper.latent_decode is MosaicLatentDecode and ampere.latent_decode is None
    # Block tables 256-byte wide per row on a GPU (Mosaic GPU's operand alignment).
    assert hopper.table_columns == ampere.table_columns == 64
    assert REFERENCE_KERNELS.table_columns == 1
    assert hopper.routed_experts == RoutedExperts("auto", gpu=True, hopper=True)
    assert ampere.quantized_matmul == QuantizedMatmul("auto", (8, 0))
    # The flags win over "auto"; the reference attention keeps the GPU's other kernels.
    forced = resolve_kernels(HOPPER, attention="reference", moe="padded", quant="dequant",
                             lora="xla")
    assert forced.attention is REFERENCE and forced.latent_decode is None
    assert forced.add_rms_norm is add_rms_norm_triton
    assert forced.routed_experts.impl == "padded" and forced.quantized_matmul.impl == "dequant"
    assert forced.lora_delta.impl == "xla"
    assert resolve_kernels(HOPPER, tensor_parallel=2).lora_delta.impl == "xla"
    # The kernels are not partitioned: under TP the flag's pallas runs as xla too.
    assert resolve_kernels(HOPPER, lora="pallas", tensor_parallel=2).lora_delta.impl == "xla"
    with pytest.raises(ValueError, match="--attention-backend 'nope'"):
        resolve_kernels(CPU, attention="nope")


def test_for_layer_changes_only_the_attention():
    table = dataclasses.replace(REFERENCE_KERNELS, add_rms_norm=norm_spy.counted_norm,
                                attention=FP8KVAttention(REFERENCE, (1.0, 2.0), (1.0, 4.0)))
    layer = table.for_layer(1)
    assert (layer.attention.k_scale, layer.attention.v_scale) == (2.0, 4.0)
    assert dataclasses.replace(layer, attention=table.attention) == table
    assert REFERENCE_KERNELS.for_layer(3) is REFERENCE_KERNELS


def test_fp8_kv_engine_steps_call_the_norm_kernel(monkeypatch):
    norm_spy.install(monkeypatch)
    before = len(norm_spy.CALLS)
    engine = make_engine(kv_cache_dtype="fp8", kv_cache_scales="1.0")
    kernels = engine.runner.kernels
    assert isinstance(kernels.attention, FP8KVAttention)
    assert kernels.add_rms_norm is norm_spy.counted_norm
    from jaxinfer.sampling_params import SamplingParams
    engine.add_request("a", prompt_ids(3, 9), SamplingParams(max_tokens=3, temperature=0.0,
                                                             ignore_eos=True))
    assert len(run_all(engine)["a"][0][0]) == 3
    assert len(norm_spy.CALLS) > before


def test_tensor_parallel_engines_keep_and_call_the_norm_kernel():
    """tests/kernel_table_checks.py on 2 CPU devices: TP = 2, with a 16-bit and an fp8 cache."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_table_checks.py")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert out["auto"]["attention"] == "reference/tp2"
    assert out["fp8"]["attention"] == "reference/fp8kv/tp2"
    for run in out.values():
        assert run["norm_is_the_kernel"] and run["norm_calls"] > 0
        assert run["tokens"] == run["reference_tokens"]
