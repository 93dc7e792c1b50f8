"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them.

Model templates are written against transformers' jinja2 environment, so this mirrors it
(transformers/utils/chat_template_utils.py): an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` block
(transformers marks assistant spans with it; here it renders its body), jinja's default undefined
(a missing variable is falsy, as templates that test `tools is defined` expect), a `tojson` filter
that neither escapes HTML nor non-ASCII characters and takes `indent` / `separators` /
`sort_keys`, and the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` that
refuses underscore attributes. The inputs are prepared as there: keys whose value is None are
dropped from each message, everything the template sees is rebuilt from plain JSON types,
`reasoning_content` / `thinking` / `reasoning` are aliased to each other, and the variables are
the tokenizer's special tokens (`bos_token`, `eos_token`, ...) overridden by the caller's extra
kwargs, then `messages`, `tools`, `documents` and `add_generation_prompt`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxinfer.errors import TokenizerError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attributes (a sandbox escape route)."""

    def __init__(*args, **kwargs):  # jinja's Namespace takes self positionally too
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace "
                f"({name!r})")


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    # strftime_now resolves `_strftime_now` per call, so tests can fix the date under a cached
    # template
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: _strftime_now(f),
                       dict=_TemplateDict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from None


def _plain(value: Any) -> Any:
    """The value rebuilt from JSON types only (subclasses stripped, anything else a placeholder),
    so the sandboxed template never sees a caller's objects and their methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list) -> list[dict]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"chat message {i} is not an object: {message!r}")
        message = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def render_chat_template(source: str, messages: list[dict],
                         special_tokens: Mapping[str, str] | None = None, /, *,
                         add_generation_prompt: bool = False, tools: list[dict] | None = None,
                         documents: list[dict] | None = None, **kwargs: Any) -> str:
    """One conversation through the template, as `tokenizer.apply_chat_template(messages,
    tools=..., documents=..., add_generation_prompt=..., tokenize=False, **kwargs)` renders it.
    `kwargs` are any other template variables (a client's chat_template_kwargs: every name but the
    four set here is allowed). Template errors (including `raise_exception`) raise
    TokenizerError."""
    if _RESERVED & kwargs.keys():
        raise TokenizerError(f"template variables {sorted(_RESERVED & kwargs.keys())} are set from "
                             f"the request itself")
    template = compile_template(source)
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise TokenizerError("tools must be JSON schemas (objects)")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TokenizerError("documents must be objects (with 'title' and 'text')")
    variables = _plain({**(special_tokens or {}), **kwargs})
    try:
        return template.render(messages=_prepare_messages(messages), tools=_plain(tools),
                               documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except TokenizerError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        raise TokenizerError(f"chat template failed to render: {e}") from None
