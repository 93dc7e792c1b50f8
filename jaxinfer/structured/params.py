"""`StructuredOutputsParams`: what a request's output must match, with vLLM's field names (its
`StructuredOutputsParams`, formerly `GuidedDecodingParams`). Exactly one constraint is set."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxinfer.errors import InvalidRequestError

# Most choices a `choice` constraint may list, and the most characters a constraint may hold: a
# grammar is compiled on the host, so its size is bounded like every other size a client controls.
MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 1 << 20
MAX_REASONING_END_TOKENS = 64  # the longest reasoning end marker, in tokens

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None      # a JSON schema (object or its text)
    regex: str | None = None            # the whole output matches this regex
    choice: list[str] | None = None     # the output is one of these strings
    grammar: str | None = None          # a Lark or GBNF (llama.cpp / vLLM EBNF) grammar
    json_object: bool | None = None     # any JSON object
    whitespace_pattern: str | None = None  # JSON: the regex of whitespace between tokens
    # A reasoning model's output thinks first: the constraint applies to the answer only, from the
    # token after the first occurrence of these token ids (the reasoning parser's end marker, e.g.
    # `</think>`); before it sampling is unconstrained. None: the constraint applies from the first
    # output token.
    reasoning_end_token_ids: tuple[int, ...] | None = None
    # The request field it came from, for error messages ("response_format", "guided_json", ...).
    field: str = dataclasses.field(default="structured_outputs", compare=False)

    def constraint(self) -> tuple[str, Any]:
        """(kind, value) of the one constraint set; InvalidRequestError naming `field` otherwise."""
        given = [(k, getattr(self, k)) for k in CONSTRAINTS
                 if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.field}: exactly one of {', '.join(CONSTRAINTS)} must be set "
                f"(got {', '.join(k for k, _ in given) or 'none'})", param=self.field)
        return given[0]

    def validate(self) -> None:
        """Types and sizes (the grammar itself is checked when it is compiled)."""
        kind, value = self.constraint()
        bad = None
        if kind == "json":
            if isinstance(value, dict):
                text = json.dumps(value)
            elif isinstance(value, str):
                text = value
            else:
                bad = "a JSON schema must be an object or its JSON text"
            if bad is None and len(text) > MAX_CONSTRAINT_CHARS:
                bad = f"the schema is longer than {MAX_CONSTRAINT_CHARS} characters"
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                bad = f"{kind} must be a non-empty string"
            elif len(value) > MAX_CONSTRAINT_CHARS:
                bad = f"{kind} is longer than {MAX_CONSTRAINT_CHARS} characters"
        elif kind == "choice":
            if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                bad = f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings"
            elif sum(map(len, value)) > MAX_CONSTRAINT_CHARS:
                bad = f"the choices hold more than {MAX_CONSTRAINT_CHARS} characters"
        elif value is not True:
            bad = "json_object must be true or false"
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            bad = "whitespace_pattern must be a string"
        end = self.reasoning_end_token_ids
        if end is not None and not (
                isinstance(end, tuple) and 1 <= len(end) <= MAX_REASONING_END_TOKENS
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in end)):
            bad = (f"reasoning_end_token_ids must be a tuple of 1 to {MAX_REASONING_END_TOKENS} "
                   "token ids")
        if bad:
            raise InvalidRequestError(f"{self.field}: {bad}", param=self.field)

    def cache_key(self) -> tuple:
        """Equal for requests that compile to the same grammar."""
        kind, value = self.constraint()
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        return kind, value, self.whitespace_pattern


# vLLM's older name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams
