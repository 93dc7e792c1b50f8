"""Structured-output request fields -> `StructuredOutputsParams`: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (+ `guided_whitespace_pattern`) and its newer `structured_outputs` object. At most
one of them may ask for a constraint; each error is a 400 naming the field. The grammar is compiled
here, in the request's worker thread (cached by grammar), so the engine thread only looks it up."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.sampling_params import short_repr
from jaxinfer.structured.params import CONSTRAINTS, StructuredOutputsParams
from serve.errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _response_format(value: Any) -> StructuredOutputsParams | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a string 'type'", field)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field=field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'", field)
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: any JSON object then
            return StructuredOutputsParams(json_object=True, field=field)
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", field)
        return StructuredOutputsParams(json=schema, field=field)
    raise bad_request(f"response_format type {short_repr(kind)} is not supported (text, json_object, "
                      "json_schema)", field)


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", field)
    unknown = sorted(set(value) - {*CONSTRAINTS, "whitespace_pattern", "disable_any_whitespace"})
    if unknown:
        raise bad_request(f"structured_outputs: {short_repr(unknown)} are not supported (only "
                          f"{', '.join(CONSTRAINTS)}, whitespace_pattern)", field)
    kwargs = {k: v for k, v in value.items() if k != "disable_any_whitespace" and v is not None}
    if value.get("disable_any_whitespace") is False and kwargs.get("whitespace_pattern") is None:
        kwargs["whitespace_pattern"] = r"[\n\t ]*"  # vLLM: any whitespace unless disabled
    return StructuredOutputsParams(**kwargs, field=field)


def structured_params(body: dict) -> StructuredOutputsParams | None:
    """The request's constraint, or None; two constraints at once are refused."""
    found: list[StructuredOutputsParams] = []
    if body.get("response_format") is not None:
        found += filter(None, [_response_format(body["response_format"])])
    if body.get("structured_outputs") is not None:
        found += filter(None, [_structured_outputs(body["structured_outputs"])])
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(StructuredOutputsParams(**{kind: body[name]}, field=name))
    pattern = body.get("guided_whitespace_pattern")
    if pattern is not None:
        field = "guided_whitespace_pattern"
        if not isinstance(pattern, str):
            raise bad_request("guided_whitespace_pattern must be a string (a regex)", field)
        if len(found) != 1 or found[0].constraint()[0] not in ("json", "json_object"):
            raise bad_request("guided_whitespace_pattern applies to a JSON constraint only", field)
        found[0] = dataclasses.replace(found[0], whitespace_pattern=pattern)
    if len(found) > 1:
        raise bad_request(f"{found[1].field}: only one structured-output constraint per request "
                          f"(also given: {found[0].field})", found[1].field)
    if found:
        found[0].validate()
    return found[0] if found else None
