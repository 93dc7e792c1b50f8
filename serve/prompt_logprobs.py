"""vLLM's `prompt_logprobs` response field: per prompt token (null for the first) a map from token
id to {logprob, rank, decoded_token} holding the prompt token itself and its top alternatives."""

from __future__ import annotations

from jaxinfer.core.outputs import TokenLogprob
from serve.choices import safe_logprob, token_text


def vllm_prompt_logprobs(tokenizer, plp: list[TokenLogprob | None] | None) -> list | None:
    if plp is None:
        return None
    out: list[dict | None] = []
    for lp in plp:
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": safe_logprob(v), "rank": rank,
                            "decoded_token": token_text(tokenizer, tid)}
                 for rank, (tid, v) in enumerate(lp.top, start=1)}
        entry.setdefault(str(lp.token_id), {"logprob": safe_logprob(lp.logprob), "rank": lp.rank,
                                            "decoded_token": token_text(tokenizer, lp.token_id)})
        out.append(entry)
    return out
