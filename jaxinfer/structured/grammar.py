"""Grammars through llguidance: compile a request's `StructuredOutputsParams` once (cached by
grammar), give each sequence its own matcher, and fill the token bitmasks of a step's constrained
rows.

Why llguidance (of llguidance, xgrammar and outlines-core): it installs as one wheel with no
dependencies (xgrammar pulls torch and the CUDA libraries; outlines-core handles regexes and JSON
schemas but no context-free grammars), it takes JSON schemas, regexes, Lark and GBNF grammars,
builds its tokenizer from the `tokenizer.json` the engine already loads, computes a mask in tens of
microseconds without a per-grammar token-table precomputation, and bounds a grammar's cost with
parser limits, so a hostile schema cannot stall the host. It is imported only when the first
structured request arrives: a machine without it serves everything else.

A matcher lives on the host with its sequence and advances with each accepted token; the bitmask it
fills for the next token allows EOS only where the grammar accepts."""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from jaxinfer.errors import InvalidRequestError
from jaxinfer.structured.bitmask import allow_all
from jaxinfer.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (a template matcher each)


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the GPU image, say
        raise InvalidRequestError("structured output needs the llguidance package, which this server "
                                  "lacks (pip install llguidance)", param="structured_outputs") from None
    return llguidance


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token: int) -> None:
        """Advance by a sampled token; a token the grammar refuses (never sampled under the mask)
        raises, failing only this request."""
        if not self._m.consume_token(token):
            raise ValueError(f"token {token} does not continue the grammar: {self._m.get_error()}")

    @property
    def terminated(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return self._m.is_stopped()

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the next token's mask into row `row` of a C-contiguous int32 bitmask."""
        if not (bitmask.dtype == np.int32 and bitmask.flags.c_contiguous and 0 <= row < len(bitmask)):
            raise ValueError("fill_mask needs a C-contiguous int32 bitmask and a row inside it")
        row_bytes = bitmask.shape[1] * 4
        self._m.unsafe_compute_mask_ptr(bitmask.ctypes.data + row * row_bytes, row_bytes)


class AfterReasoningMatcher:
    """A matcher whose grammar starts after the reasoning: until the output has generated the
    reasoning end marker (token ids), every token is allowed and none reaches the grammar; the
    token after the marker is the grammar's first (vLLM's reasoning + structured outputs)."""

    __slots__ = ("_grammar", "_end", "_tail", "started")

    def __init__(self, grammar: GrammarMatcher, end_token_ids: tuple[int, ...]):
        self._grammar = grammar
        self._end = list(end_token_ids)
        self._tail: list[int] = []  # the last len(end) tokens while reasoning
        self.started = False

    def accept(self, token: int) -> None:
        if self.started:
            self._grammar.accept(token)
            return
        self._tail = (self._tail + [token])[-len(self._end):]
        self.started = self._tail == self._end

    @property
    def terminated(self) -> bool:
        return self.started and self._grammar.terminated

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        if self.started:
            self._grammar.fill_mask(bitmask, row)
        else:
            bitmask[row] = -1


class CompiledGrammar:
    """A grammar compiled against the engine's tokenizer; `new_matcher` is cheap (a copy). With
    `reasoning_end` (token ids), each matcher starts after the output's reasoning."""

    def __init__(self, template, reasoning_end: tuple[int, ...] | None = None):
        self._template = template
        self.reasoning_end = reasoning_end

    def new_matcher(self) -> GrammarMatcher | AfterReasoningMatcher:
        matcher = GrammarMatcher(self._template.deep_copy())
        return matcher if self.reasoning_end is None else AfterReasoningMatcher(matcher, self.reasoning_end)

    def after_reasoning(self, end_token_ids: tuple[int, ...] | None) -> "CompiledGrammar":
        """This grammar, applied after the reasoning end marker `end_token_ids` (None: from the
        first token)."""
        return self if end_token_ids is None else CompiledGrammar(self._template, tuple(end_token_ids))


class _DecodedTokens:
    """What llguidance's TokenizerWrapper reads, for a tokenizer whose tokenizer.json it cannot
    interpret: each token's bytes as the token decodes alone (exact for tokenizers whose tokens are
    whole characters)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tok = tokenizer
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")
                       for i in range(min(vocab_size, tokenizer.vocab_size))]
        self.special_token_ids = list(eos_token_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer; thread-safe (the server compiles in its
    worker threads, the engine looks the result up when the request is added)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lltok = None
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        if self._lltok is None:
            llg = _llguidance()
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer; this model has none",
                                          param="structured_outputs")
            try:
                source = self.tokenizer.backend_json()
                self._lltok = llg.LLTokenizer(source, n_vocab=self.vocab_size,
                                              eos_token=list(self.eos_token_ids))
            except ValueError:  # a decoder llguidance cannot read: each token's text instead
                source = llg.TokenizerWrapper(_DecodedTokens(self.tokenizer, self.vocab_size,
                                                             self.eos_token_ids))
                self._lltok = llg.LLTokenizer(source, n_vocab=self.vocab_size)
        return self._lltok

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params` (from the cache when compiled before). An invalid
        schema, regex or grammar raises InvalidRequestError naming `params.field`."""
        params.validate()
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = CompiledGrammar(self._build(params))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, params: StructuredOutputsParams):
        llg = _llguidance()
        lltok = self._ll_tokenizer()
        kind, value = params.constraint()
        field = params.field

        def bad(why: str):
            why = why if len(why) <= 400 else why[:400] + "..."
            raise InvalidRequestError(f"{field}: {why}", param=field)

        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as e:
                        bad(f"the JSON schema is not valid JSON: {e}")
                if not isinstance(schema, (dict, bool)):
                    bad("a JSON schema must be an object")
                # Compact JSON (vLLM's disable_any_whitespace) unless a whitespace pattern is
                # given: free whitespace lets a small model spend its tokens on blank lines.
                options = ({"whitespace_pattern": params.whitespace_pattern}
                           if params.whitespace_pattern is not None else {"whitespace_flexible": False})
                grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
            else:
                grammar = llg.grammar_from(kind, value if kind != "choice" else json.dumps(value))
        except ValueError as e:
            bad(f"invalid {kind}: {e}")
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            bad(f"invalid {kind}: {messages[0] if messages else 'rejected by the grammar compiler'}")
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            bad(f"invalid {kind}: {matcher.get_error()}")
        return matcher


def fill_bitmasks(bitmask: np.ndarray, rows: list[tuple[GrammarMatcher, int]]) -> None:
    """Write each (matcher, row)'s next-token mask into `bitmask` (int32[S, W], C-contiguous). One
    row after another: a mask costs microseconds, and llguidance's thread pool (LLExecutor) measured
    10-30x slower than this loop for 64 rows on a 2-core host."""
    for matcher, row in rows:
        matcher.fill_mask(bitmask, row)


def step_bitmask(rows, num_seqs: int, vocab_size: int) -> np.ndarray:
    """The bitmask of a step's rows (ScheduledSeqs, padded to `num_seqs`): each constrained row
    that samples gets its matcher's mask, every other row allows everything."""
    mask = allow_all(num_seqs, vocab_size)
    fill_bitmasks(mask, [(e.seq.grammar, r) for r, e in enumerate(rows)
                         if e.emits and e.seq.grammar is not None])
    return mask
