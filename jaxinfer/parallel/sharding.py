"""Every sharding decision of the engine, in one place.

One `jax.sharding.Mesh` with axes ``("dp", "tp")`` is built from `--data-parallel-size` and
`--tensor-parallel-size`; each data-parallel replica runs on its row of the mesh (a sub-mesh with
``dp`` = 1), so everything below names only the ``tp`` axis:

- parameters: `param_spec` (q/k/v, gate/up and the state-space mixers' in-projections
  column-sharded; o/down and the mixers' out_proj row-sharded; embedding and
  lm_head over the vocabulary; MoE experts by `expert_layout`: whole experts over tp (expert
  parallelism) or tensor-parallel inside each expert, over their intermediate size; norms, routers
  and row-parallel biases replicated);
- KV cache: sharded over KV heads; when tp exceeds the KV heads, every device stores the one KV head
  its query heads read (the K/V projections are replicated and each device keeps its head, as vLLM
  does), so the cache holds `ShardingPlan.stored_kv_heads` = tp heads;
- step inputs, sampled tokens and everything the host builds: replicated.

The model code never names a mesh: XLA's SPMD partitioner follows these specs and inserts the
all-reduces after the row-parallel matmuls. Only the kernels, per-device code, run under
`shard_map`: attention (jaxinfer/parallel/attention.py, `attention_specs`), the routed experts
(jaxinfer/parallel/experts.py, `expert_specs`) and the fixed-state layers' steps over their
state-space heads (jaxinfer/parallel/state_heads.py), whose states stay in each device's head
shard of the cache pages.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig

DP, TP = "dp", "tp"

# Param-path leaf owner -> how its kernel [in, out] is split over tp ("col": out, "row": in).
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
           "q_b_proj", "kv_b_proj",  # MLA's per-head up-projections (out = heads x dims)
           # the fixed-state layers' in-projections, each laid out by head (state_heads.py)
           "in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_x", "in_proj_b", "in_proj_c",
           "in_proj_dt")
_ROW = ("o_proj", "down_proj", "out_proj")
# How MoE experts split over tp: "ep" whole experts per device, "tp" every expert's intermediate
# size (jaxinfer/parallel/experts.py).
EXPERT_LAYOUTS = ("ep", "tp")
DEFAULT_EXPERT_LAYOUT = "tp"


def validate_parallel_sizes(cfg: ModelConfig, tp: int, dp: int, num_devices: int,
                            expert_layout: str = DEFAULT_EXPERT_LAYOUT) -> None:
    """Refuse sizes the model or the machine cannot take, naming the flag."""
    def refuse(flag: str, value: int, why: str):
        raise ConfigError(f"--{flag} {value}: {why}")

    if tp < 1:
        refuse("tensor-parallel-size", tp, "must be >= 1")
    if dp < 1:
        refuse("data-parallel-size", dp, "must be >= 1")
    if tp > num_devices:
        refuse("tensor-parallel-size", tp, f"exceeds the {num_devices} device(s) available")
    if dp * tp > num_devices:
        refuse("data-parallel-size", dp, f"x --tensor-parallel-size {tp} = {dp * tp} exceeds the "
                                         f"{num_devices} device(s) available")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ConfigError(f"--expert-layout {expert_layout}: expected one of "
                          f"{', '.join(EXPERT_LAYOUTS)}")
    if tp == 1:
        return
    if cfg.num_heads % tp:
        refuse("tensor-parallel-size", tp, f"does not divide the model's {cfg.num_heads} "
                                           f"attention heads")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        refuse("tensor-parallel-size", tp, f"neither divides nor is a multiple of the model's "
                                           f"{kv} KV heads")
    if cfg.intermediate_size % tp:
        refuse("tensor-parallel-size", tp, f"does not divide the model's MLP intermediate size "
                                           f"{cfg.intermediate_size}")
    if cfg.is_moe and expert_layout == "tp" and cfg.moe_intermediate_size % tp:
        refuse("tensor-parallel-size", tp, f"does not divide the model's expert intermediate size "
                                           f"{cfg.moe_intermediate_size} (--expert-layout ep "
                                           f"splits whole experts instead)")
    states = getattr(cfg.family_options, "state_dims", None)  # a hybrid's state-space layers
    if states is not None and (why := states.tp_refusal(tp)):
        refuse("tensor-parallel-size", tp, why)
    if cfg.is_moe and expert_layout == "ep" and cfg.num_experts % tp:
        refuse("tensor-parallel-size", tp, f"does not divide the model's {cfg.num_experts} "
                                           f"experts (--expert-layout ep)")


def build_mesh(tp: int, dp: int = 1, devices: list | None = None) -> Mesh:
    """The ("dp", "tp") mesh over the first dp x tp devices (all processes' devices in a multi-host
    run: jax.devices() is global). A tp group is consecutive devices, so it stays on one host's
    NVLink when tp divides the devices per host."""
    devices = list(jax.devices() if devices is None else devices)[:dp * tp]
    return Mesh(np.array(devices, dtype=object).reshape(dp, tp), (DP, TP))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One sub-mesh per data-parallel replica: row i of the mesh, with dp = 1."""
    return [Mesh(mesh.devices[i:i + 1], (DP, TP)) for i in range(mesh.shape[DP])]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where one engine replica's arrays live. Hashable (it is a static part of jitted functions
    and of the in-process compile cache, so two meshes never share an executable)."""
    mesh: Mesh
    cfg: ModelConfig
    expert_layout: str = DEFAULT_EXPERT_LAYOUT

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP]

    @property
    def kv_replicated(self) -> bool:
        """tp exceeds the KV heads: each device stores the one KV head its query heads read."""
        return self.tp > self.cfg.num_kv_heads

    @property
    def stored_kv_heads(self) -> int:
        """KV heads of the global cache array: tp when replicated, else the model's."""
        return self.tp if self.kv_replicated else self.cfg.num_kv_heads

    @property
    def kv_heads_per_device(self) -> int:
        return self.stored_kv_heads // self.tp

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return self.named(P())

    @property
    def kv_cache(self) -> NamedSharding:
        """[heads, blocks, block_size, head_dim], heads over tp."""
        return self.named(P(TP))

    def param(self, path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        return self.named(param_spec(path, shape, self.cfg, self.tp, self.expert_layout))

    def params(self, shapes) -> object:
        """A pytree of NamedShardings matching the param pytree (of arrays or ShapeDtypeStructs)."""
        return jax.tree_util.tree_map_with_path(
            lambda p, leaf: self.param(tuple(k.key for k in p), leaf.shape), shapes)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig,
               tp: int, expert_layout: str = DEFAULT_EXPERT_LAYOUT) -> P:
    """PartitionSpec of one parameter (Flax layout: Dense kernels [in, out], experts [E, in, out];
    quantized linears: `weight` [out, in] and `weight_scale` [out], expert scales [E, out])."""
    if tp == 1:
        return P()
    owner, leaf = (path[-2], path[-1]) if len(path) >= 2 else ("", path[-1])
    if path == ("embed", "embedding"):  # [V, H]
        return P(TP, None) if cfg.vocab_size % tp == 0 else P()
    if path == ("lm_head", "kernel"):  # [H, V]
        return P(None, TP) if cfg.vocab_size % tp == 0 else P()
    if owner in ("k_proj", "v_proj") and tp > cfg.num_kv_heads:
        return P()  # every device computes all KV heads and stores its own
    if owner in _COLUMN:  # everything but a kernel has out first: weight, scale, bias
        return P(None, TP) if leaf == "kernel" else P(TP)
    if owner in _ROW:  # scale and bias are per output: replicated, applied after the all-reduce
        return {"kernel": P(TP, None), "weight": P(None, TP)}.get(leaf, P())
    if owner == "moe" and leaf in EXPERT_LEAVES:
        specs = (expert_specs(expert_layout) + expert_scale_specs(expert_layout)
                 + expert_bias_specs(expert_layout))
        return dict(zip(EXPERT_LEAVES, specs))[leaf]
    if owner == "attn" and leaf == "sinks":  # [Hq]: each device's query heads
        return P(TP)
    return P()  # norms, router, the experts' down bias (added after the all-reduce)


def expert_specs(expert_layout: str) -> tuple[P, P, P]:
    """Specs of (w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H]): "ep" over the experts,
    "tp" over the intermediate size (column- then row-parallel)."""
    if expert_layout == "ep":
        return P(TP, None, None), P(TP, None, None), P(TP, None, None)
    return P(None, None, TP), P(None, None, TP), P(None, TP, None)


# Expert stacks, their per-output-channel scales [E, out] (quantized checkpoints only), then the
# gate/up biases [E, F] (gpt-oss).
EXPERT_LEAVES = ("w_gate", "w_up", "w_down", "w_gate_scale", "w_up_scale", "w_down_scale",
                 "gate_bias", "up_bias")


def expert_scale_specs(expert_layout: str) -> tuple[P, P, P]:
    """Specs of the scales [E, out] of (w_gate, w_up, w_down): they follow their stack's expert
    and output splits (w_down's output, the hidden size, is never split)."""
    if expert_layout == "ep":
        return P(TP, None), P(TP, None), P(TP, None)
    return P(None, TP), P(None, TP), P()


def expert_bias_specs(expert_layout: str) -> tuple[P, P]:
    """Specs of gpt-oss's gate and up biases [E, F]: split like w_gate's and w_up's outputs."""
    if expert_layout == "ep":
        return P(TP, None), P(TP, None)
    return P(None, TP), P(None, TP)


@functools.cache
def attention_specs(plan: ShardingPlan) -> dict[str, P]:
    """shard_map specs of the attention seam: queries and outputs [T, Hq, D] over heads; the
    cache over its heads; new K/V [T, Hkv, D] over heads, or replicated when the cache is."""
    kv_new = P() if plan.kv_replicated else P(None, TP, None)
    return {"q": P(None, TP, None), "cache": P(TP), "kv_new": kv_new, "md": P(), "sinks": P(TP)}


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of (possibly sharded) arrays: its largest share."""
    per: dict = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)
