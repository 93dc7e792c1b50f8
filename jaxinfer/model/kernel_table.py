"""The kernel table: every kernel the model calls, in one typed, hashable record, resolved once per
engine from the platform and the user's flags (`resolve_kernels`).

The model reads each kernel from the table it is given (`forward(..., kernels)`) and never asks
which device it runs on: this module is the one place that looks at the platform
(`current_platform`), and it decides there what each slot holds. A kernel given inputs it
cannot take falls back inside the kernel itself (`add_rms_norm_triton` past its row
limit, `MosaicLatentDecode` past its shapes, the LoRA kernels' `supported`), so the table says what
runs where the kernel applies.

Wrappers replace only the slots they wrap (`dataclasses.replace`): tensor parallelism
(parallel/kernels.py: `attention` under shard_map, `routed_experts` over the mesh, `state_heads`
per device) and the FP8 KV cache (worker/kv/kv_scales.py: `attention` with per-layer scales) keep
every other slot, the norm kernel included. The table is a static argument of every jitted step, so
it is part of every compile-cache key.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from jaxinfer.model.experts import RoutedExperts
from jaxinfer.model.gemm_rows import gemm_rows, plain_rows
from jaxinfer.model.lora.delta import LoraDelta
from jaxinfer.model.quant.ops import QuantizedMatmul
from jaxinfer.model.routing import Router
from jaxinfer.model.ssm_kernels import GatedDeltaNetKernels, Mamba2Kernels, StateHeads
from pallas_kernels.attention.backend import REFERENCE, get_backend, registered
from pallas_kernels.attention.reference import causal_attention_reference
from pallas_kernels.norm.reference import add_rms_norm_reference


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the resolver needs to know of the device: its kind ("cpu", "gpu", "tpu") and, on an
    NVIDIA GPU, its compute capability."""
    kind: str
    compute_capability: tuple[int, int] = (0, 0)

    @property
    def gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def hopper(self) -> bool:
        return self.gpu and self.compute_capability[0] == 9

    @property
    def interpret(self) -> bool:
        """Pallas kernels run in their interpreter (CPU tests)."""
        return not self.gpu


CPU = Platform("cpu")


@functools.cache
def current_platform() -> Platform:
    """The platform of the default device: the one device probe of the model's kernels."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return Platform(dev.platform)
    try:
        major, minor = (int(v) for v in str(dev.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        major, minor = 0, 0
    return Platform("gpu", (major, minor))


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """The kernels of one engine's model. Every slot is hashable (functions, frozen dataclasses)."""
    # Paged attention: write_kv, __call__ (decode + ragged prefill), for_layer, name;
    # an AttentionBackend or a wrapper around one (ShardedAttention, FP8KVAttention).
    attention: Any = REFERENCE
    # MLA's decode over its latent cache: value_width -> a `decode` (model/mla.py binds
    # kv_lora_rank). None: the jnp latent reference.
    latent_decode: Callable[[int], Callable] | None = None
    # The dense causal path without a cache (training: `train_forward`),
    # `causal_attention_reference`'s signature; `dense_fused.fused_causal_attention` on cuDNN.
    dense_attention: Callable = causal_attention_reference
    # The residual add + RMSNorm, `add_rms_norm_reference`'s signature.
    add_rms_norm: Callable = add_rms_norm_reference
    # Matmuls of one token kept as GEMMs (model/gemm_rows.py): `gemm_rows` on GPUs, else as is.
    gemm_rows: Callable = plain_rows
    # The MoE router (model/routing.py): `route` + the experts' sort, or the fused Pallas kernel.
    routing: Router = Router()
    # The MoE layer's routed rows: `RoutedExperts` on one device, `ShardedExperts` over a mesh.
    routed_experts: Callable = RoutedExperts()
    # Every quantized linear layer's matmul (model/quant/ops.py).
    quantized_matmul: Callable = QuantizedMatmul()
    # The LoRA delta of a mixed batch (model/lora/delta.py).
    lora_delta: LoraDelta = LoraDelta()
    # Mamba-2's conv1d and SSD scan (model/ssm_kernels.py): the Pallas kernels on a GPU.
    mamba2: Mamba2Kernels = Mamba2Kernels()
    # Gated DeltaNet's conv1d and delta rule (model/ssm_kernels.py): the Pallas kernels on a GPU.
    gdn: GatedDeltaNetKernels = GatedDeltaNetKernels()
    # Where the fixed-state layers' heads run: `StateHeads` on one device, `ShardedStateHeads`
    # per device over a mesh (parallel/state_heads.py).
    state_heads: StateHeads = StateHeads()
    # Columns a block table's width is a multiple of. On a GPU 64 (256 bytes): every row and group
    # a step slices out of the table (a mixed step's prefill rows, a KV group's table) is handed
    # to the kernels as a view, and Mosaic GPU refuses an operand not 256-byte aligned at launch.
    table_columns: int = 1

    @property
    def name(self) -> str:
        return self.attention.name

    def for_layer(self, i: int) -> "KernelTable":
        """The table layer i calls: its attention may differ per layer (FP8 KV scales)."""
        attention = self.attention.for_layer(i)
        return self if attention is self.attention else dataclasses.replace(self,
                                                                            attention=attention)


REFERENCE_KERNELS = KernelTable()


def attention_name(platform: Platform, flag: str = "auto") -> str:
    """--attention-backend with "auto" decided: Mosaic GPU kernels on Hopper, Triton-lowered
    Pallas on other CUDA GPUs, the jnp reference elsewhere (CPU)."""
    if flag != "auto":
        return flag
    if platform.hopper and "mosaic" in registered():
        return "mosaic"
    if platform.gpu and "triton" in registered():
        return "triton"
    return "reference"


def lora_impl(platform: Platform, flag: str = "auto", tensor_parallel: int = 1) -> str:
    """--lora-impl with "auto" decided: the Triton kernels on a GPU (lora_h200.json: faster than
    xla on all three workloads) unless tensor parallelism splits the weights they read. Under
    tensor parallelism it is xla whatever the flag: the kernels are not partitioned, and the
    XLA path is sharded with the projections it adds to."""
    if tensor_parallel > 1:
        return "xla"
    if flag != "auto":
        return flag
    return "pallas" if platform.gpu else "xla"


def resolve_kernels(platform: Platform, *, attention: str = "auto", moe: str = "auto",
                    quant: str = "auto", lora: str = "auto",
                    tensor_parallel: int = 1) -> KernelTable:
    """The table of `platform` under the flags (--attention-backend, --moe-impl, --quant-impl,
    --lora-impl; "auto" decided here): on a GPU the Triton add + norm kernel, two-row GEMMs and
    the fused MoE router (its own token limit sends larger steps to the sort),
    on Hopper under the Mosaic attention backend MLA's latent decode kernel; the per-call-shape
    choices of the MoE and quantized matmuls see the platform through their slots."""
    name = attention_name(platform, attention)
    table = KernelTable(
        attention=get_backend(name),
        routed_experts=RoutedExperts(moe, gpu=platform.gpu, hopper=platform.hopper),
        quantized_matmul=QuantizedMatmul(
            quant, None if platform.kind == "cpu" else platform.compute_capability),
        lora_delta=LoraDelta(lora_impl(platform, lora, tensor_parallel),
                             interpret=platform.interpret))
    if platform.gpu:
        from pallas_kernels.norm.rms_norm import add_rms_norm_triton
        table = dataclasses.replace(table, add_rms_norm=add_rms_norm_triton, gemm_rows=gemm_rows,
                                    routing=Router(fused=True), mamba2=Mamba2Kernels(pallas=True),
                                    gdn=GatedDeltaNetKernels(pallas=True), table_columns=64)
    if platform.hopper and name == "mosaic":
        from pallas_kernels.attention.latent_decode_mosaic import MosaicLatentDecode
        table = dataclasses.replace(table, latent_decode=MosaicLatentDecode)
    return table

