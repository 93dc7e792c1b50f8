"""The offline API: `LLM(model=dir).generate(prompts, SamplingParams(...))` and `LLM.chat`, a
front end that adds requests to an engine (one LLMEngine, or data-parallel replicas) and runs it
to completion."""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.pooling import (check_dimensions, check_embedding_engine, finish_embedding,
                                     pooling_config)
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.frontends.factory import create_engine
from jaxinfer.core.outputs import RequestOutput
from jaxinfer.errors import InvalidRequestError
from jaxinfer.lora_request import LoRARequest
from jaxinfer.sampling_params import SamplingParams

class LLM:
    """Offline batch generation: `LLM(model=dir).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, *, engine: EngineClient | None = None, **kwargs):
        if engine is None:
            args = EngineArgs(**({"model": model} if model else {}), **kwargs)
            engine = create_engine(args)
        self.engine: EngineClient = engine
        self._counter = 0

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); returns one final RequestOutput per prompt,
        in prompt order, with every choice's full text and token ids. `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts",
                                      param="sampling_params")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"{len(loras)} LoRA requests for {len(prompts)} prompts",
                                      param="lora_request")
        ids, finals = [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, prompt, p, priority[i] if priority else 0,
                                    final_output_only=True, lora_request=loras[i])
            ids.append(rid)
        wanted = set(ids)
        from tqdm import tqdm
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req")
        for out in self.engine.run_to_completion():
            if out.finished and out.request_id in wanted:
                finals[out.request_id] = out
                bar.update(1)
        bar.close()
        failed = dict(self.engine.take_failed())
        for rid in ids:
            if rid in failed:  # (the engine freed it; the others are done)
                raise failed[rid]
        return [finals[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content} messages) or to a list
        of them: each is rendered with the model's chat template (`chat_template_kwargs` are extra
        template variables, e.g. enable_thinking) and generated like `generate`'s prompts."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; this model has none", param="messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        # The template holds BOS and the other special tokens itself, as in vLLM.
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(
                       conv, add_generation_prompt=add_generation_prompt, **kwargs),
                   add_special_tokens=False) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: str | list[int] | list[str] | list[list[int]], *,
              pooling: str | None = None, normalize: bool | None = None, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[np.ndarray]:
        """One float32 embedding per prompt: the final hidden states pooled ("last", "mean" or
        "cls"), truncated to `dimensions` (Matryoshka models only) and L2-normalized. Defaults:
        the model's sentence-transformers configuration, else last-token pooling, normalized."""
        check_embedding_engine(self.engine.config)
        cfg = pooling_config(self.engine.config.model.model)
        check_dimensions(cfg, dimensions, self.engine.cfg.hidden_size)
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling or cfg.method)
        outs = self.generate(prompts, params, use_tqdm)
        keep = cfg.normalize if normalize is None else normalize
        return [finish_embedding(o.embedding, keep, dimensions) for o in outs]

    def update_weights(self, params) -> None:
        """New weights for the next `generate` (see LLMEngine.update_weights)."""
        self.engine.update_weights(params)

    def update_lora(self, name: str, params: dict) -> None:
        """New weights for a loaded LoRA adapter, in place (see LLMEngine.update_lora)."""
        self.engine.update_lora(name, params)

    def sleep(self) -> None:
        """Release the KV cache's device memory until `wake()` (see LLMEngine.sleep)."""
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()
