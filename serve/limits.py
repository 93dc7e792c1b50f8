"""Per-request size limits, each a server flag with a default, each refused with a 400 that names the
field and the flag: stop strings (count and length), prompts per request, sequences (n x prompts)
per request, and the length of prompt text in characters before it is tokenized.

The character bound is what keeps a big prompt cheap to refuse: one token stands for at most
`Tokenizer.max_chars_per_token` characters, so a text longer than that x max_model_len has more
tokens than the context holds, and is refused without tokenizing it (tokenizing 30 MB takes a minute
and gigabytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from aiohttp import web

from serve.errors import bad_request

DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_CHARS = 1024
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_SEQS_PER_REQUEST = 256

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestLimits":
        return cls(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)})



LIMITS: web.AppKey[RequestLimits] = web.AppKey("limits")  # --max-stop-strings etc.

def add_limit_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                   help="most `stop` strings per request (default: %(default)s)")
    g.add_argument("--max-stop-string-chars", type=int, default=DEFAULT_MAX_STOP_STRING_CHARS,
                   help="longest `stop` string, in characters (default: %(default)s)")
    g.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="most prompts in one /v1/completions request (default: %(default)s)")
    g.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                   help="most sequences (n x prompts) one request may start (default: %(default)s)")


def check_limit_args(args: argparse.Namespace) -> None:
    for f in dataclasses.fields(RequestLimits):
        if getattr(args, f.name) < 1:
            raise ValueError(f"--{f.name.replace('_', '-')} must be >= 1, got {getattr(args, f.name)}")


def check_stop(value: Any, limits: RequestLimits) -> None:
    """Bound `stop` before SamplingParams sees it (its own check is for types and emptiness): every
    stop string is matched against every new piece of text, so their number and length are costs."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        return  # SamplingParams names the field and the type
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop: {len(stops)} stop strings, more than the server's limit of "
                          f"{limits.max_stop_strings} (--max-stop-strings)", "stop")
    for s in stops:
        if isinstance(s, str) and len(s) > limits.max_stop_string_chars:
            raise bad_request(f"stop: a stop string of {len(s)} characters, longer than the server's "
                              f"limit of {limits.max_stop_string_chars} (--max-stop-string-chars)", "stop")


def check_sequence_count(num_prompts: int, n: Any, limits: RequestLimits) -> None:
    if num_prompts > limits.max_prompts_per_request:
        raise bad_request(f"prompt: {num_prompts} prompts in one request, more than the server's limit "
                          f"of {limits.max_prompts_per_request} (--max-prompts-per-request)", "prompt")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 \
            and n * num_prompts > limits.max_seqs_per_request:
        raise bad_request(f"n: n={n} x {num_prompts} prompts = {n * num_prompts} sequences, more than the "
                          f"server's limit of {limits.max_seqs_per_request} per request "
                          f"(--max-seqs-per-request)", "n")


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    return tokenizer.max_chars_per_token * max_model_len


def check_text_length(text_len: int, tokenizer, max_model_len: int, field: str) -> None:
    """Refuse a text that cannot fit the context, from its length alone (before tokenizing)."""
    bound = max_prompt_chars(tokenizer, max_model_len)
    if text_len > bound:
        raise bad_request(
            f"{field}: {text_len} characters cannot fit this model's maximum context length of "
            f"{max_model_len} tokens (one token covers at most {tokenizer.max_chars_per_token} "
            f"characters, so at most {bound} characters fit)", field)


def check_strings(body: dict, tokenizer, max_model_len: int) -> None:
    """Every string in the body (keys too, at any depth): one longer than any text that fits the
    context is refused from its length (before anything scans or tokenizes it), and one holding a
    lone UTF-16 surrogate (JSON lets `"\\ud800"` through; no tokenizer or UTF-8 encoder takes it)
    is refused too. Either is a 400 naming the top-level field. Walks without recursion."""
    bound = max_prompt_chars(tokenizer, max_model_len)
    for key, value in body.items():
        stack = [key, value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if len(v) > bound:
                    check_text_length(len(v), tokenizer, max_model_len, key)
                if not v.isascii() and _SURROGATE.search(v):
                    raise bad_request(f"{key}: contains a lone UTF-16 surrogate (not a valid Unicode "
                                      f"character)", key)
            elif isinstance(v, list):
                stack.extend(x for x in v if isinstance(x, (str, list, dict)))
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(x for x in v.values() if isinstance(x, (str, list, dict)))
