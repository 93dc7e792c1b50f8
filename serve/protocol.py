"""Request parsing and validation: JSON body -> prompt token ids + SamplingParams, with vLLM's field
names. Everything a client can get wrong is checked here, before any engine request exists, so every
mistake is a 400 naming the field; request_fields.py lists vLLM's fields and refuses those that ask
for what this server lacks; unknown fields are ignored with a log line, as vLLM does."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from jaxinfer.lora_request import LoRARequest
from jaxinfer.sampling_params import MAX_LOGPROBS, SamplingParams, short_repr
from serve.app_keys import BODY_TIMEOUT
from serve.choices import new_response_id
from serve.errors import APIError, bad_request
from serve.json_body import BODY_PARSER, read_body
from serve.limits import RequestLimits, check_sequence_count, check_stop, check_strings, check_text_length
from serve.request_fields import EXTENSION_FIELDS, SAMPLING_FIELDS, check_fields
from serve.reasoning.request import ReasoningRequest, constrain_answer_only, reasoning_request
from serve.structured import structured_params
from serve.tools import ToolOptions, ToolRequest, template_message, tool_request

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "chat_template_kwargs", "return_token_strs"})


@dataclasses.dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""
    prompts: list[list[int]]          # token ids, one engine request per prompt
    prompt_texts: list[str]           # the prompts as text (for `echo`)
    params: SamplingParams
    stream: bool
    include_usage: bool               # stream_options.include_usage: a final usage-only chunk
    continuous_usage: bool            # stream_options.continuous_usage_stats: usage in every chunk
    echo: bool
    top_logprobs: int | None          # alternatives to report per token; None = no logprobs
    # Completions with max_tokens 0: score the prompt only (lm-eval's echo-only requests); the
    # engine samples one token, which the response leaves out.
    generate_nothing: bool = False
    priority: int = 0                 # the scheduler's: lower runs earlier
    request_id: str | None = None     # the client's id for the response (vLLM's `request_id`)
    tools: ToolRequest | None = None  # chat `tools` / `tool_choice` (serve/tools.py)
    reasoning: ReasoningRequest | None = None  # chat with --reasoning-parser (serve/reasoning/)
    lora_request: LoRARequest | None = None  # the LoRA adapter `model` names (None: the base)

    @property
    def num_seqs(self) -> int:
        """The sequences it starts (n x prompts), counted before the engine validates n: an
        invalid n counts 1 here, and the engine refuses it naming the field."""
        n = self.params.n
        valid = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        return len(self.prompts) * (n if valid else 1)

    def model_name(self, base: str) -> str:
        """The response's `model`: the adapter's name for a request that picked one (as vLLM),
        else `base` (the engine's model name)."""
        return base if self.lora_request is None else self.lora_request.lora_name

    def ids(self, prefix: str) -> tuple[str, str]:
        """(engine request id, response id). The engine's stay unique whatever `request_id` a client
        sends; the response shows the client's."""
        engine_id = new_response_id(prefix)
        return engine_id, engine_id if self.request_id is None else f"{prefix}-{self.request_id}"


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (read within --body-timeout, parsed off the event loop)."""
    raw = await read_body(request, request.app[BODY_TIMEOUT])
    return await request.app[BODY_PARSER].parse(raw)


def check_model(body: dict, served_names: list[str]) -> None:
    """`model` is an identifier compared with the served names, never used as a path."""
    model = body.get("model")
    if model is not None and model not in served_names:
        name = model if isinstance(model, str) and len(model) <= 200 else short_repr(model, 200)
        raise APIError(404, f"The model `{name}` does not exist.", "model")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}={value!r}: must be true or false", name)
    return value


def check_token_ids(ids: list, vocab_size: int, field: str, max_len: int | None = None) -> list[int]:
    if max_len is not None and len(ids) > max_len:
        raise bad_request(f"{field}: {len(ids)} token ids, more than the server takes ({max_len})", field)
    for t in ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad_request(f"{field}: token id {short_repr(t)} is outside the vocabulary "
                              f"[0, {vocab_size})", field)
    return ids


def parse_prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a list of
    token-id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, list) for p in value):
            for p in value:
                if not p or not all(_is_int(t) for t in p):
                    raise bad_request("prompt: every token-id list must be a non-empty list of integers",
                                      "prompt")
            return list(value)
    if value is None:
        raise bad_request("prompt is required", "prompt")
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      f"token-id lists (got {type(value).__name__}{' (empty)' if value == [] else ''})",
                      "prompt")


def normalize_messages(value: Any) -> list[dict]:
    """Chat messages for the template: content given as a list of parts is joined to one string
    (text parts only; this server serves text models)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only parts of type 'text' are supported",
                                      "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string, a list of text parts or null",
                              "messages")
        # null content: dropped for the template, as transformers does
        out.append(template_message({**msg, "content": content}))
    return out


def render_chat(tokenizer, body: dict, max_model_len: int, tools: list[dict] | None = None) -> str:
    """The body's `messages` through the chat template, with its `add_generation_prompt` (default
    true) and `chat_template_kwargs` (extra template variables, never the two set here). Messages
    too long to fit the context in any tokenization are refused before rendering, the rendered text
    before tokenizing."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = {"messages", "add_generation_prompt", "tools", "documents"} & set(kwargs)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    messages = normalize_messages(body.get("messages"))
    check_text_length(sum(len(m["content"] or "") for m in messages), tokenizer, max_model_len, "messages")
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list)
                                      and all(isinstance(d, dict) for d in documents)):
        raise bad_request("documents must be a list of objects", "documents")
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=bool_field(body, "add_generation_prompt", True),
        tools=tools, documents=documents or None, **kwargs)
    check_text_length(len(text), tokenizer, max_model_len, "messages")
    return text


def _top_logprobs(body: dict, chat: bool) -> int | None:
    if chat:  # chat: logprobs is a bool, top_logprobs the number of alternatives
        want = bool_field(body, "logprobs", False)
        top = body.get("top_logprobs")
        if top is not None and not want:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if not want:
            return None
        top = 0 if top is None else top
        field = "top_logprobs"
    else:
        top = body.get("logprobs")
        if top is None:
            return None
        field = "logprobs"
    if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"{field}={top!r}: must be an integer from 0 to {MAX_LOGPROBS}", field)
    return top


def sampling_params(body: dict, *, max_tokens: Any, top_logprobs: int | None,
                    prompt_logprobs: Any = None, structured=None) -> SamplingParams:
    """SamplingParams from the body, as sent: the engine validates them where the request enters it
    (SamplingParams.validate, the context length), naming the field of the first bad one (a 400)."""
    kwargs = {name: body[name] for name in SAMPLING_FIELDS + EXTENSION_FIELDS
              if body.get(name) is not None}
    params = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=top_logprobs,
                            prompt_logprobs=prompt_logprobs, structured_outputs=structured)
    return params


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise bad_request("stream_options can only be set when stream=true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return (bool_field(opts, "include_usage", False),
            bool_field(opts, "continuous_usage_stats", False))


def parse_generation(body: dict, engine, limits: RequestLimits, *, chat: bool,
                     tool_options: ToolOptions = ToolOptions(), reasoning_parser=None) -> GenerationRequest:
    """Validate a completions (chat=False) or chat (chat=True) body against the served model. Runs
    in a worker thread (it tokenizes): every size is bounded before the work it would cost."""
    check_strings(body, engine.tokenizer, engine.max_model_len)
    check_fields(body, chat, reasoning=reasoning_parser is not None)
    check_model(body, engine.model_names)
    check_stop(body.get("stop"), limits)
    tokenizer, vocab_size, max_len = engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len
    stream = bool_field(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    echo = bool_field(body, "echo", False)
    top_logprobs = _top_logprobs(body, chat)
    bool_field(body, "parallel_tool_calls", False)
    if not isinstance(body.get("user", ""), (str, type(None))):
        raise bad_request("user must be a string", "user")
    tools = tool_request(body, tool_options) if chat else None
    if chat:
        check_sequence_count(1, body.get("n"), limits)
        text = render_chat(tokenizer, body, max_len, tools.tools if tools else None)
        # The template already holds BOS and the other special tokens: none are added unless asked
        # for, as in vLLM.
        prompts = [tokenizer.encode(text, add_special_tokens=bool_field(body, "add_special_tokens", False))]
        texts = [text]
        # Chat's default is "until the context is full"; max_completion_tokens supersedes max_tokens.
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = body.get(field)
        if _is_int(max_tokens) and max_tokens < 1:  # (named as sent, not as the engine calls it)
            raise bad_request(f"{field} must be an integer from 1 (got {max_tokens})", field)
    else:
        add_special = bool_field(body, "add_special_tokens", True)
        prompts, texts = [], []
        parsed = parse_prompts(body.get("prompt"))
        check_sequence_count(len(parsed), body.get("n"), limits)
        for p in parsed:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt is empty", "prompt")
                check_text_length(len(p), tokenizer, max_len, "prompt")
        for p in parsed:
            if isinstance(p, str):
                prompts.append(tokenizer.encode(p, add_special_tokens=add_special))
                texts.append(p)
            else:
                prompts.append(check_token_ids(p, vocab_size, "prompt", max_len))
                texts.append(tokenizer.decode(p, skip_special_tokens=False))
        max_tokens = body.get("max_tokens", 16)
        if _is_int(max_tokens) and max_tokens < 1 and not (max_tokens == 0 and echo):
            raise bad_request(f"max_tokens must be an integer from 1, or 0 with echo (the prompt "
                              f"scored, nothing generated); got {max_tokens}", "max_tokens")
    prompts, texts = _truncate(body, tokenizer, prompts, texts, max_len)
    generate_nothing = not chat and max_tokens == 0 and _is_int(max_tokens)
    # echo with logprobs reports the prompt tokens' logprobs too (vLLM: prompt_logprobs defaults
    # to logprobs then).
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and echo and not chat:
        prompt_logprobs = top_logprobs
    structured = structured_params(body)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            raise bad_request(f"tool_choice={short_repr(body.get('tool_choice'))} constrains the output "
                              f"itself: drop {structured.field}", "tool_choice")
        structured = tools.structured
    if structured is not None:
        engine.grammars.compile(structured)  # here, off the event loop; the engine finds it cached
    reasoning = reasoning_request(body, reasoning_parser, texts[0]) if chat else None
    structured = constrain_answer_only(structured, reasoning, tokenizer)
    params = sampling_params(body, max_tokens=1 if generate_nothing else max_tokens,
                             top_logprobs=top_logprobs,
                             prompt_logprobs=prompt_logprobs, structured=structured)
    if reasoning is not None and reasoning.parser.keeps_special_tokens:
        params.skip_special_tokens = False  # the parser reads the markers
    _check_best_of(body, params.n)
    return GenerationRequest(prompts, texts, params, stream, include_usage, continuous_usage, echo,
                             top_logprobs, generate_nothing, _priority(body), _request_id(body), tools,
                             reasoning, engine.lora_requests.get(body.get("model")))


def _truncate(body: dict, tokenizer, prompts: list[list[int]], texts: list[str],
              max_len: int) -> tuple[list[list[int]], list[str]]:
    """`truncate_prompt_tokens`: keep each prompt's last k tokens (vLLM truncates on the left)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return prompts, texts
    if not _is_int(k) or not 1 <= k <= max_len:
        raise bad_request(f"truncate_prompt_tokens={short_repr(k)}: must be an integer from 1 to the "
                          f"maximum context length ({max_len})", "truncate_prompt_tokens")
    out_ids, out_texts = [], []
    for ids, text in zip(prompts, texts):
        if len(ids) > k:
            ids = ids[-k:]
            text = tokenizer.decode(ids, skip_special_tokens=False)
        out_ids.append(ids)
        out_texts.append(text)
    return out_ids, out_texts


def _check_best_of(body: dict, n: int) -> None:
    """best_of equal to n asks for nothing more than n; a larger one would need ranking by logprob."""
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of={short_repr(best_of)}: only best_of equal to n ({n}) is supported",
                          "best_of")


def _priority(body: dict) -> int:
    value = body.get("priority")
    if value is None:
        return 0
    if not _is_int(value) or not -2**31 <= value < 2**31:
        raise bad_request(f"priority={short_repr(value)}: must be a 32-bit integer", "priority")
    return value


def _request_id(body: dict) -> str | None:
    value = body.get("request_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= 128 or not value.isprintable():
        raise bad_request("request_id must be a printable string of 1 to 128 characters", "request_id")
    return value
