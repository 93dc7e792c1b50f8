"""The attention references (pallas_kernels/attention/reference.py) jitted, for the kernel tests.
Run eagerly, each of a reference's ops and its lax.map body compile apart for every new shape:
about four times the jitted cost (a prefill case: ~60 s eager, ~16 s jitted on the loaded CI
machine)."""

import jax

from pallas_kernels.attention import reference

_VARIANT = ("scale", "softcap", "window")

ragged_prefill_reference = jax.jit(reference.ragged_prefill_reference, static_argnames=_VARIANT)
paged_decode_reference = jax.jit(reference.paged_decode_reference, static_argnames=_VARIANT)
causal_attention_reference = jax.jit(reference.causal_attention_reference,
                                     static_argnames=(*_VARIANT, "causal"))
