"""The LoRA delta of a mixed batch: y += s * (x A[slot]) B[slot], each token with its row's slot.

`lora_delta` is the XLA path: the shrink runs against every slot's A at once ([T, N+1, R], N+1
small), each token keeps its own slot's R columns (the others zeroed), and one matmul against the
slots' B matrices laid end to end ([(N+1) R, out]) expands it: the zeroed columns add exactly zero,
so a row of no adapter (slot 0, zeros) gets its base output bit for bit, and the shapes never
depend on which slots the batch uses. Both sides select rather than multiply by zero: the other
slots' shrink columns are dropped by a `where`, and B's non-finite entries are replaced by zeros
before the expand (0 x NaN is NaN), so a slot holding NaN or inf never reaches a row of another
slot (tests/test_lora_hard_edges.py); the select is one elementwise pass over B per projection.
It costs (N+1) R (in + out) multiply-adds per token (at N = 8, R = 16 on Llama-3-8B's seven
projections about 5 % of the base model's) and reads every slot's weights once per step.

`--lora-impl pallas` (the kernel table's `LoraDelta` slot) runs the Triton kernels of
pallas_kernels/lora/segment_matmul.py instead: `forward` groups the step's tokens by slot once
(`LoraDelta.step_slots`), and each projection's shrink and expand read only the slots its rows use, the
expand adding onto y in place. A projection whose shapes the kernels do not take (`supported`)
falls back to `lora_delta`. Off the GPU the kernels run in the Pallas interpreter (tests). They
need no select: a tile multiplies only its own slot's weights and padding rows are masked on the
store, so a poisoned slot reaches no row of another there either.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.lora.segment_matmul import (SegmentPlan, block_m_for, lora_shrink_expand,
                                                segment_plan, supported)

LORA_IMPLS = ("xla", "pallas")  # --lora-impl


class GroupedSlots(NamedTuple):
    """A step's slots (i32[T]) with their grouping for the Pallas kernels."""
    slot: jax.Array
    plan: SegmentPlan


def group_slots(slot: jax.Array, num_slots: int) -> GroupedSlots:
    """`slot` grouped once for every projection of the step (`num_slots`: the stacks' slots)."""
    return GroupedSlots(slot, segment_plan(slot, num_slots, block_m_for(slot.shape[0])))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slot: jax.Array) -> jax.Array:
    """x [T, in]; a [N+1, in, R]; b [N+1, R, out] (scale folded in); slot i32[T] -> f32 [T, out]."""
    n1, _, r = a.shape
    xa = jnp.einsum("ti,nir->tnr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    own = slot[:, None] == jnp.arange(n1, dtype=slot.dtype)  # [T, N+1]
    xa = jnp.where(own[:, :, None], xa, 0.0).astype(x.dtype).reshape(x.shape[0], n1 * r)
    # Every token's zeroed columns meet every slot's B: 0 x inf is NaN, so a non-finite weight is
    # selected away rather than multiplied by zero (a slot's own rows see it as 0; loading refuses
    # such adapters, this keeps the other rows exact should one reach a slot anyway).
    b = b.reshape(n1 * r, -1).astype(x.dtype)
    b = jnp.where(jnp.isfinite(b), b, jnp.zeros((), b.dtype))
    return jnp.dot(xa, b, preferred_element_type=jnp.float32)


def lora_delta_gather(x: jax.Array, a: jax.Array, b: jax.Array, slot: jax.Array) -> jax.Array:
    """The plain reference: each token's slot gathered, float32 throughout (tests)."""
    xf = x.astype(jnp.float32)
    xa = jnp.einsum("ti,tir->tr", xf, a[slot].astype(jnp.float32))
    return jnp.einsum("tr,tro->to", xa, b[slot].astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class LoraDelta:
    """The kernel table's LoRA slot: --lora-impl (one of LORA_IMPLS) and whether the Pallas
    kernels run in their interpreter (off the GPU)."""
    impl: str = "xla"
    interpret: bool = True

    def step_slots(self, slot: jax.Array, num_slots: int) -> jax.Array | GroupedSlots:
        """The step's slots as this implementation takes them: grouped once for the kernels."""
        return group_slots(slot, num_slots) if self.impl == "pallas" else slot

    def __call__(self, module, slot, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """`y` (the projection `name` of `x`, inside flax `module`) plus its LoRA delta, when the
        "lora" variables hold a stack for it and the step carries slots; else `y`. Grouped slots
        (`step_slots`) take the kernels where their shapes are `supported`."""
        if slot is None or not module.has_variable("lora", name):
            return y
        w = module.get_variable("lora", name)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(slot, GroupedSlots):
            if supported(x2.shape[1], w["A"].shape[2], w["B"].shape[2]):
                return lora_shrink_expand(x2, w["A"], w["B"], y.reshape(x2.shape[0], -1),
                                          slot.plan, interpret=self.interpret).reshape(y.shape)
            slot = slot.slot
        d = lora_delta(x2, w["A"], w["B"], slot.reshape(-1))
        return y + d.reshape(*lead, -1).astype(y.dtype)
