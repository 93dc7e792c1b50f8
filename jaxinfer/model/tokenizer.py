"""Tokenizer: HF `tokenizers` (tokenizer.json), special tokens, EOS ids, the chat template rendered
in a sandboxed jinja2 environment, and an incremental detokenizer for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from jaxinfer.errors import TokenizerError


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"'{path}' is not valid JSON: {e}") from None


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise TokenizerError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: tuple[int, ...] = (),
                 chat_template: str | None = None, add_bos_token: bool | None = None):
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        if eos_token and (eid := tokenizer.token_to_id(eos_token)) is not None and eid not in ids:
            ids.append(eid)
        self.eos_token_ids = tuple(ids)
        self.chat_template = chat_template
        # Add BOS ourselves only when the tokenizer's post-processor does not (HF's add_bos_token).
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        self._prepend_bos = bool(add_bos_token and self.bos_token_id is not None
                                 and (not probe or probe[0] != self.bos_token_id))
        self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"'{path}' not found: jaxinfer needs a fast tokenizer (tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load '{path}': {e}") from None
        tcfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        eos = gen.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(tok, bos_token=_token_str(tcfg.get("bos_token")),
                   eos_token=_token_str(tcfg.get("eos_token")), eos_token_ids=eos_ids,
                   chat_template=template, add_bos_token=tcfg.get("add_bos_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_chars_per_token(self) -> int:
        """An upper bound on how many characters of input text one token can stand for: the longest
        vocabulary string (a byte-level token's string has one character per byte it covers, so at
        least as many as the characters it covers), doubled when a normalizer may merge characters.
        So a text longer than this x N characters has more than N tokens, known without encoding it."""
        if getattr(self, "_max_chars", None) is None:
            longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
            self._max_chars = max(longest, 1) * (2 if self._tok.normalizer is not None else 1)
        return self._max_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages with the model's chat template in a sandbox (no attribute access to Python
        internals, no file or module access): a hostile template fails with TokenizerError."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json 'chat_template' "
                                 "or chat_template.jinja); use /v1/completions instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.StrictUndefined)
            env.globals.update(raise_exception=_raise_exception,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt))
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"chat template does not parse: {e}") from None
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError) as e:
            raise TokenizerError(f"chat template failed to render: {e}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, the way vLLM does: decode a short window
    of recent tokens and emit only the text past what was already emitted, holding back while the
    window ends in an incomplete UTF-8 character (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        # Decode from a few tokens back so that word-boundary spaces come out right.
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (possibly '')."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""
