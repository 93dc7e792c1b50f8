"""Triton-lowered Pallas flash prefill (portable path)."""


def flash_prefill_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, *, scale,
                         softcap=None):
    raise NotImplementedError("flash_prefill_triton is not written yet")
