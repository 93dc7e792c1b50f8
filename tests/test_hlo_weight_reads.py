"""jaxinfer/bench/profile/hlo_weight_reads.py: which ops read a module's weights, and whether an 8-bit weight
reaches its matmul directly or through a wider copy. On a CPU-compiled module (the CPU upcasts
e4m3 weights in a fusion of their own, then dots in f32) and on a module in the GPU's form (a
Triton gemm fusion inside a command buffer, a convert fusion feeding cuBLAS, a dot rewritten as a
reduce), written here since a CPU cannot compile for the GPU."""

# ruff: noqa: E501 - HLO text keeps its one-instruction lines

from __future__ import annotations

import gzip

import jax
import jax.numpy as jnp

from jaxinfer.model.quant.ops import quantize, quantized_matmul
from jaxinfer.bench.profile import hlo_weight_reads as hwr

GPU_HLO = """HloModule jit_step, is_scheduled=true, input_output_alias={ {2}: (3, {}, may-alias) }, entry_computation_layout={(f8e4m3fn[6144,4096]{1,0})->bf16[1]{0}}

%gemm_fusion_dot.1_computation (parameter_0: f8e4m3fn[6144,4096], parameter_1: bf16[1,4096]) -> bf16[1,6144] {
  %parameter_0 = f8e4m3fn[6144,4096]{1,0} parameter(0)
  %convert.1 = bf16[6144,4096]{1,0} convert(%parameter_0)
  %parameter_1 = bf16[1,4096]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1,6144]{1,0} dot(%parameter_1, %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%command_buffer (p0: f8e4m3fn[6144,4096], p1: bf16[1,4096]) -> bf16[1,6144] {
  %p0 = f8e4m3fn[6144,4096]{1,0} parameter(0)
  %p1 = bf16[1,4096]{1,0} parameter(1)
  ROOT %gemm_fusion_dot.1 = bf16[1,6144]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"256","split_k":"4"}}}
}

%wrapped_convert_computation (param_0: f8e4m3fn[4096,14336]) -> bf16[4096,14336] {
  %param_0 = f8e4m3fn[4096,14336]{1,0} parameter(0)
  ROOT %convert.2 = bf16[4096,14336]{1,0} convert(%param_0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_reduce (param_0.1: f8e4m3fn[1024,4096], param_1.1: bf16[1,4096]) -> f32[1024] {
  %param_0.1 = f8e4m3fn[1024,4096]{1,0} parameter(0)
  %convert.3 = f32[1024,4096]{1,0} convert(%param_0.1)
  %param_1.1 = bf16[1,4096]{1,0} parameter(1)
  %bitcast.1 = bf16[4096]{0} bitcast(%param_1.1)
  %convert.4 = f32[4096]{0} convert(%bitcast.1)
  %broadcast.1 = f32[1024,4096]{1,0} broadcast(%convert.4), dimensions={1}
  %multiply.1 = f32[1024,4096]{1,0} multiply(%convert.3, %broadcast.1)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[1024]{0} reduce(%multiply.1, %constant.1), dimensions={1}, to_apply=%add
}

ENTRY %main.9 (w_qkv: f8e4m3fn[6144,4096], w_down: f8e4m3fn[4096,14336], w_k: f8e4m3fn[1024,4096], kv: bf16[2,1024,8,128], x: bf16[1,4096], h: bf16[1,14336]) -> (bf16[1,6144], bf16[1,4096], f32[1024], bf16[2,1024,8,128]) {
  %w_qkv = f8e4m3fn[6144,4096]{1,0} parameter(0), metadata={op_name="params[\\'qkv\\']"}
  %w_down = f8e4m3fn[4096,14336]{1,0} parameter(1), metadata={op_name="params[\\'down\\']"}
  %w_k = f8e4m3fn[1024,4096]{1,0} parameter(2), metadata={op_name="params[\\'k\\']"}
  %kv = bf16[2,1024,8,128]{3,2,1,0} parameter(3)
  %x = bf16[1,4096]{1,0} parameter(4)
  %h = bf16[1,14336]{1,0} parameter(5)
  %call.1 = bf16[1,6144]{1,0} call(%w_qkv, %x), to_apply=%command_buffer
  %wrapped_convert = bf16[4096,14336]{1,0} fusion(%w_down), kind=kLoop, calls=%wrapped_convert_computation
  %custom-call.1 = (bf16[1,4096]{1,0}, s8[4194304]{0}) custom-call(%h, %wrapped_convert), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %get-tuple-element.1 = bf16[1,4096]{1,0} get-tuple-element(%custom-call.1), index=0
  %bitcast.2 = f8e4m3fn[1024,4096]{1,0} bitcast(%w_k)
  %reduce_fusion = f32[1024]{0} fusion(%bitcast.2, %x), kind=kInput, calls=%fused_reduce
  ROOT %tuple.1 = (bf16[1,6144]{1,0}, bf16[1,4096]{1,0}, f32[1024]{0}, bf16[2,1024,8,128]{3,2,1,0}) tuple(%call.1, %get-tuple-element.1, %reduce_fusion, %kv)
}
"""


def test_gpu_forms_direct_copy_and_reduce():
    out = hwr.report(GPU_HLO)
    reads = {r["weight"]: r for r in out["reads"]}
    assert [w["name"] for w in out["weights"]] == ["params['qkv']", "params['down']",
                                                   "params['k']"]  # the donated cache is not one
    qkv, down, k = reads["params['qkv']"], reads["params['down']"], reads["params['k']"]
    # Through the command buffer into the Triton gemm, converted inside it: 1 byte per value.
    assert (qkv["kind"], qkv["impl"], qkv["reads"], qkv["converts_to"], qkv["via"]) == (
        "matmul", "__triton_gemm", "f8e4m3fn", "bf16", [])
    # Upcast by a fusion of its own, then cuBLAS reads the bf16 copy: 1 + 2 + 2 bytes per value.
    assert (down["kind"], down["impl"], down["reads"]) == ("matmul", "__cublas$gemm", "bf16")
    assert down["via"] == ["wrapped_convert (kLoop) -> bf16[4096,14336]"]
    assert down["copy_bytes"] == 4096 * 14336 * 2
    assert (k["kind"], k["converts_to"], k["via"]) == ("reduce", "f32", [])
    s = out["summary"]
    assert s["by_dtype"]["f8e4m3fn"] == dict(weights=3, bytes=(6144 + 1024) * 4096 + 4096 * 14336,
                                              read_directly=2, through_a_copy=1, unread=0,
                                              copy_bytes=4096 * 14336 * 2)
    assert s["bytes_moved_estimate"] == s["weight_bytes"] + 2 * 4096 * 14336 * 2
    assert "f8e4m3fn: 3 weights" in s["verdict"][0] and "1 through a copy" in s["verdict"][0]


def test_a_cpu_module_upcasts_its_fp8_weight_apart(tmp_path, capsys):
    w8, scale = quantize(jax.random.normal(jax.random.key(0), (512, 256)), "fp8")
    w16 = jax.random.normal(jax.random.key(1), (512, 256), jnp.bfloat16)

    def step(w8, scale, w16, cache, x):
        y = quantized_matmul(x, w8, scale, impl="dequant")
        return y @ w16, cache + 1

    args = (w8, scale, w16, jnp.zeros((256, 256), jnp.float32), jnp.ones((1, 256), jnp.bfloat16))
    text = jax.jit(step, donate_argnums=(3,)).lower(*args).compile().as_text()
    path = tmp_path / "step.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    out = hwr.report(hwr.read_text(path), min_bytes=64 << 10)
    assert {w["dtype"] for w in out["weights"]} == {"f8e4m3fn", "bf16"}  # not the donated cache
    fp8 = [r for r in out["reads"] if r["weight"] == out["weights"][0]["name"]]
    assert fp8 and all(r["kind"] == "matmul" and r["via"] for r in fp8)
    assert out["summary"]["by_dtype"]["f8e4m3fn"]["through_a_copy"] == 1
    assert hwr.main([str(path), "--min-bytes", str(64 << 10)]) == 0
    assert "f8e4m3fn: 1 weights" in capsys.readouterr().out
