"""Structured output: the packed bitmask against its numpy reference, the masked sampler variant, and
the demo model constrained offline and through the server (JSON schemas, regexes, choices, grammars,
mixed batches, the official openai client, 400s naming the field)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from jaxinfer.structured import StructuredOutputsParams
from jaxinfer.structured.bitmask import apply_token_bitmask, bitmask_words, unpack_bitmask
from jaxinfer.worker.sampler import FULL_SAMPLER, MASKED_SAMPLER, SamplingTensors, sample
from server_harness import DEMO, DEMO_ENGINE, check_error_shape, post_raw

pytest.importorskip("llguidance")

RECORD = {"type": "object", "additionalProperties": False,
          "required": ["name", "size", "ok", "kind"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z_]{1,8}$"},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["module", "class", "function"]}}}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 1, "maxItems": 4}
PROMPTS = ["import os\n", "def main():", "class Config:", "# settings\n", "data = ", "return "]


def random_bitmask(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """A random packed mask allowing at least one token per row."""
    bits = rng.random((rows, vocab)) < 0.3
    bits[np.arange(rows), rng.integers(0, vocab, rows)] = True
    padded = np.zeros((rows, bitmask_words(vocab) * 32), np.uint8)
    padded[:, :vocab] = bits
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4")


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 31), (5, 33), (8, 100), (2, 4101)])
def test_bitmask_apply_matches_the_reference(rows, vocab):
    rng = np.random.default_rng(vocab)
    mask = random_bitmask(rng, rows, vocab)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    allowed = unpack_bitmask(mask, vocab)
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    from llguidance.numpy import apply_token_bitmask_inplace  # the library's own reading
    ref = logits.copy()
    apply_token_bitmask_inplace(ref, mask)
    np.testing.assert_array_equal(got, ref)


def tensors(s: int, temperature, bitmask=None) -> SamplingTensors:
    return SamplingTensors(
        temperature=np.asarray(temperature, np.float32), top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32), seed=np.arange(s, dtype=np.uint32),
        out_pos=np.zeros(s, np.int32), min_tokens=np.zeros(s, np.int32),
        stop_ids=np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32), num_top_logprobs=np.zeros(s, np.int32),
        repetition_penalty=np.ones(s, np.float32), presence_penalty=np.zeros(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32), history=np.full((s, 4), -1, np.int32),
        prompt_len=np.zeros(s, np.int32), token_bitmask=bitmask)


def test_masked_sampler_samples_only_allowed_tokens_and_changes_nothing_else():
    s, v = 16, 300
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((s, v)).astype(np.float32) * 3)
    temps = [0.0, 1.0] * (s // 2)
    mask = random_bitmask(rng, s, v)
    masked = jax.jit(sample, static_argnums=2)
    out = masked(logits, tensors(s, temps, mask), MASKED_SAMPLER)
    allowed = unpack_bitmask(mask, v)
    tokens = np.asarray(out.tokens)
    assert allowed[np.arange(s), tokens].all()
    # greedy rows take the best allowed token; logprobs are of the constrained distribution
    best = np.where(allowed, np.asarray(logits), -np.inf).argmax(-1)
    assert (tokens[0::2] == best[0::2]).all()
    assert np.isfinite(np.asarray(out.logprob)).all()
    # an all-allowing mask is the full variant exactly
    everything = np.full((s, bitmask_words(v)), -1, np.int32)
    a = masked(logits, tensors(s, temps, everything), MASKED_SAMPLER)
    b = masked(logits, tensors(s, temps), FULL_SAMPLER)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.top_logprobs), np.asarray(b.top_logprobs))


# ---- the demo model, offline ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    from jaxinfer import LLM
    return LLM(model=str(DEMO), **DEMO_ENGINE)  # the demo server's shapes: compiled once


def validate(instance, schema) -> None:
    import jsonschema  # (the test extra)
    jsonschema.validate(instance, schema)


def so(**kwargs) -> SamplingParams:
    max_tokens = kwargs.pop("max_tokens", 48)
    return SamplingParams(max_tokens=max_tokens, temperature=kwargs.pop("temperature", 0.0),
                          seed=kwargs.pop("seed", None),
                          structured_outputs=StructuredOutputsParams(**kwargs))


def test_every_sampled_json_schema_output_validates(llm):
    # 24 sampled outputs (a batch of rows, each with its own matcher), every one valid: each
    # output is one more draw of the same code, and a hundred cost seconds of CPU more.
    schemas = [RECORD, DIGITS] * 12
    params = [so(json=schema, temperature=0.8, seed=i) for i, schema in enumerate(schemas)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = set()
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text  # the grammar completed, not max_tokens
        validate(json.loads(c.text), schema)
        texts.add(c.text)
    assert len(texts) > 10  # sampled, not one answer repeated


def test_regex_choice_and_grammar_constrain_the_demo_model(llm):
    cases = [(so(regex=r"[a-z]{3}_\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}_\d{2}", t)),
             (so(choice=["import", "def", "class"], temperature=1.0, seed=3),
              lambda t: t in ("import", "def", "class")),
             # GBNF (vLLM's guided_grammar) and Lark both compile
             (so(grammar='root ::= "def " [a-z_]+ "(" [a-z]* ")"'),
              lambda t: re.fullmatch(r"def [a-z_]+\([a-z]*\)", t)),
             (so(grammar='start: "x = " NUM\nNUM: /[0-9]{1,3}/'), lambda t: re.fullmatch(r"x = \d{1,3}", t)),
             (so(json_object=True, max_tokens=64), lambda t: isinstance(json.loads(t), dict))]
    outs = llm.generate(["def main():"] * len(cases), [p for p, _ in cases], use_tqdm=False)
    for out, (_, check) in zip(outs, cases):
        assert check(out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


FREE = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def alone(llm):
    """Three prompts' free greedy outputs (two tests compare with them)."""
    return llm.generate(PROMPTS[:3], FREE, use_tqdm=False)


def test_free_rows_of_a_mixed_batch_sample_what_they_sample_alone(llm, alone):
    free = FREE
    mixed = llm.generate(PROMPTS[:3] + PROMPTS[3:], [free] * 3 + [so(json=RECORD)] * 3, use_tqdm=False)
    for a, m in zip(alone, mixed[:3]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    for m in mixed[3:]:
        validate(json.loads(m.outputs[0].text), RECORD)
    # n > 1: each choice has its own matcher
    two = llm.generate(["x = "], SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5,
                                                structured_outputs=StructuredOutputsParams(json=DIGITS)),
                       use_tqdm=False)
    for c in two[0].outputs:
        validate(json.loads(c.text), DIGITS)


def test_grammar_starts_after_the_reasoning_end_marker(llm, alone):
    """The thinking is what the model samples unconstrained, up to and with the first occurrence
    of the end marker; the answer after it matches the schema. The marker here is two tokens the
    demo model emits greedily anyway (random weights never write `</think>`). The shapes are the
    mixed-batch test's: nothing new to compile."""
    free_ids = [o.outputs[0].token_ids for o in alone]
    # the first output with a token pair at 2 or later that does not occur before it: the marker
    k, at = next((k, i) for k, free in enumerate(free_ids) for i in range(2, len(free) - 1)
                 if all(free[j:j + 2] != free[i:i + 2] for j in range(i)))
    free, thinking = free_ids[k], at + 2
    gated = so(json=DIGITS, max_tokens=24, reasoning_end_token_ids=tuple(free[at:thinking]))
    # a marker the output never writes leaves the whole output unconstrained
    never = so(json=DIGITS, max_tokens=12, reasoning_end_token_ids=(free[0],) * 13)
    outs = [o.outputs[0] for o in llm.generate(
        PROMPTS[:3], [gated if r == k else never for r in range(3)], use_tqdm=False)]
    out = outs[k]
    assert list(out.token_ids[:thinking]) == list(free[:thinking])
    assert out.finish_reason == "stop"
    validate(json.loads(llm.engine.tokenizer.decode(out.token_ids[thinking:])), DIGITS)
    for r in set(range(3)) - {k}:
        assert list(outs[r].token_ids) == list(free_ids[r])


@pytest.mark.parametrize("params,message", [
    (StructuredOutputsParams(json={}, reasoning_end_token_ids=()), "reasoning_end_token_ids"),
    (StructuredOutputsParams(json={}, reasoning_end_token_ids=(10**9,)), "reasoning_end_token_ids"),
    (StructuredOutputsParams(regex="a("), "unclosed group"),
    (StructuredOutputsParams(json='{"type": "objec'), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "nonsense"),
    (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
    (StructuredOutputsParams(choice=[]), "choice"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "exactly one"),
])
def test_invalid_constraints_are_refused_naming_the_field(llm, params, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        llm.engine.add_request("bad", "x", SamplingParams(structured_outputs=params))
    assert e.value.param == "structured_outputs" and not llm.engine.has_unfinished_requests()


# ---- the demo model behind the server (conftest's demo_server) -------------------------------------

@pytest.fixture(scope="module")
def demo_client(demo_server):
    import openai
    return openai.OpenAI(base_url=demo_server.urls["main"] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_openai_client_json_schema_chat_and_completions(demo_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
    chat = demo_client.chat.completions.create(
        model="demo-target", messages=[{"role": "user", "content": "Describe os.path"}],
        response_format=fmt, max_tokens=48, temperature=0.7, seed=1, n=2)
    for choice in chat.choices:
        validate(json.loads(choice.message.content), RECORD)
        assert choice.finish_reason == "stop"
    comp = demo_client.completions.create(model="demo-target", prompt=PROMPTS[:2], max_tokens=24,
                                          temperature=0, extra_body={"guided_json": DIGITS})
    for choice in comp.choices:
        validate(json.loads(choice.text), DIGITS)
    stream = demo_client.chat.completions.create(
        model="demo-target", messages=[{"role": "user", "content": "pick"}], max_tokens=8, stream=True,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("alpha", "beta", "gamma")
    regex = demo_client.completions.create(model="demo-target", prompt="v = ", max_tokens=12,
                                           extra_body={"structured_outputs": {"regex": r"\d{1,3}\.\d"}})
    assert re.fullmatch(r"\d{1,3}\.\d", regex.choices[0].text)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern"),
])
def test_bad_constraints_get_a_400_naming_the_field(demo_server, body, param):
    status, _, raw = post_raw(demo_server.urls["main"], "/v1/completions", json.dumps(
        {"model": "demo-target", "prompt": "x", "max_tokens": 4, **body}).encode())
    check_error_shape(raw, status, param)
    assert status == 400


def test_constrained_rows_beside_speculating_rows_keep_their_grammar():
    """A grammar's row never gets proposals, but it can share a step with rows that do: that step
    is a verification step, and its sampler must still apply the row's bitmask."""
    from jaxinfer import LLM
    spec = LLM(model=str(DEMO), **{**DEMO_ENGINE, "max_num_seqs": 8}, speculative_method="ngram",
               num_speculative_tokens=3, speculative_min_acceptance=0.0)
    code = "def add(x, y):\n    return x + y\n\n" * 4
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cases = [(so(regex=r"[a-z]{3}_\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}_\d{2}", t)),
             (so(json=DIGITS), lambda t: validate(json.loads(t), DIGITS) is None),
             (so(choice=["import", "def", "class"], temperature=1.0, seed=3),
              lambda t: t in ("import", "def", "class"))]
    outs = spec.generate([code] * 3 + ["def main():"] * len(cases),
                         [free] * 3 + [p for p, _ in cases], use_tqdm=False)
    m = spec.engine.spec.metrics
    assert m.drafts > 0 and m.accepted > 0  # the free rows speculated in the same steps
    for out, (_, check) in zip(outs[3:], cases):
        assert check(out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
