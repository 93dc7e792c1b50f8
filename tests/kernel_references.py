"""The attention and recurrent-layer references (pallas_kernels/{attention,ssm}/reference.py)
jitted, for the kernel tests. Run eagerly, each of a reference's ops and its lax.map body compile
apart for every new shape: about four times the jitted cost (a prefill case: ~60 s eager, ~16 s
jitted on the loaded CI machine)."""

import jax

from pallas_kernels.attention import reference
from pallas_kernels.ssm import reference as ssm

_VARIANT = ("scale", "softcap", "window")

ragged_prefill_reference = jax.jit(reference.ragged_prefill_reference, static_argnames=_VARIANT)
paged_decode_reference = jax.jit(reference.paged_decode_reference, static_argnames=_VARIANT)
causal_attention_reference = jax.jit(reference.causal_attention_reference,
                                     static_argnames=(*_VARIANT, "causal"))

gdn_recurrent_reference = jax.jit(ssm.gdn_recurrent_reference, static_argnames="use_qk_l2norm")
gdn_chunked_reference = jax.jit(ssm.gdn_chunked_reference,
                                static_argnames=("use_qk_l2norm", "chunk_size"))
gdn_decode_reference = jax.jit(ssm.gdn_decode_reference, static_argnames="use_qk_l2norm")
ssd_recurrent_reference = jax.jit(ssm.ssd_recurrent_reference)
ssd_chunked_reference = jax.jit(ssm.ssd_chunked_reference, static_argnames="chunk_size")
ssd_decode_reference = jax.jit(ssm.ssd_decode_reference)
causal_conv1d_recurrent_reference = jax.jit(ssm.causal_conv1d_recurrent_reference,
                                            static_argnames="activation")
causal_conv1d_reference = jax.jit(ssm.causal_conv1d_reference, static_argnames="activation")
causal_conv1d_update_reference = jax.jit(ssm.causal_conv1d_update_reference,
                                         static_argnames="activation")
