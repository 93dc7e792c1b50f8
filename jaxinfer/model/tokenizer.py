"""Tokenizer: HF `tokenizers` (tokenizer.json), special tokens, EOS ids, the chat template (rendered
as transformers renders it: chat_template.py), and an incremental detokenizer for streaming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from jaxinfer.errors import ConfigError, TokenizerError
from jaxinfer.model.chat_template import compile_template, render_chat_template
from jaxinfer.model.hub import resolve_model

# tokenizer_config.json's special tokens, which transformers passes to every chat template.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


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


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: tuple[int, ...] = (),
                 chat_template: str | dict[str, str] | None = None,
                 add_bos_token: bool | None = None, special_tokens: dict[str, str] | None = None):
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        if eos_token and (eid := tokenizer.token_to_id(eos_token)) is not None and eid not in ids:
            ids.append(eid)
        self.eos_token_ids = tuple(ids)
        # One template, or several by name ("default", "tool_use", ...), as tokenizer_config has.
        self.chat_template = chat_template
        # The template variables transformers takes from the tokenizer's special tokens map.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        for key, value in (("bos_token", bos_token), ("eos_token", eos_token)):
            if value is not None:
                self.special_tokens.setdefault(key, value)
        # Add BOS ourselves only when the tokenizer's post-processor does not (HF's add_bos_token).
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        self._prepend_bos = bool(add_bos_token and self.bos_token_id is not None
                                 and (not probe or probe[0] != self.bos_token_id))

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
            template = {t["name"]: t["template"] for t in template}
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        eos = gen.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(tok, bos_token=_token_str(tcfg.get("bos_token")),
                   eos_token=_token_str(tcfg.get("eos_token")), eos_token_ids=eos_ids,
                   chat_template=template, add_bos_token=tcfg.get("add_bos_token"),
                   special_tokens={k: _token_str(tcfg.get(k)) for k in SPECIAL_TOKEN_KEYS})

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

    def backend_json(self) -> str:
        """tokenizer.json's content as the tokenizers library serializes it (grammar libraries
        build their token tables from it)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = False,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """The conversation rendered as transformers' `apply_chat_template(..., tokenize=False)`
        renders it (chat_template.py): sandboxed, a hostile or failing template raises
        TokenizerError. `kwargs` are extra template variables (e.g. enable_thinking)."""
        template = self.chat_template
        if isinstance(template, dict):  # transformers' choice among named templates
            template = template.get("tool_use" if tools is not None and "tool_use" in template
                                    else "default")
        if not template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json 'chat_template' "
                                 "or chat_template.jinja); use /v1/completions instead")
        return render_chat_template(template, messages, self.special_tokens,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    documents=documents, **kwargs)


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


def load_tokenizer(model_path: str | Path, tokenizer: str | None = None,
                   chat_template: str | None = None) -> Tokenizer | None:
    """The tokenizer of `tokenizer` (--tokenizer: a directory or hub id; default the model
    directory) with `chat_template` (--chat-template: a file or the template itself) applied. A
    checkpoint without tokenizer.json (e.g. a test fixture) serves token ids only: None."""
    tok_dir = Path(resolve_model(tokenizer) if tokenizer else model_path)
    if tokenizer and not (tok_dir / "tokenizer.json").is_file():
        raise ConfigError(f"--tokenizer '{tok_dir}' has no tokenizer.json")
    tok = Tokenizer.from_dir(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
    if chat_template:
        if tok is None:
            raise ConfigError(f"--chat-template needs a tokenizer; '{tok_dir}' has no tokenizer.json")
        path = Path(chat_template)
        if path.is_file():
            tok.chat_template = path.read_text()
        elif "{" in chat_template:  # the template itself, as vLLM also accepts
            tok.chat_template = chat_template
        else:
            raise ConfigError(f"--chat-template '{chat_template}' is neither a file nor a template")
        compile_template(tok.chat_template)  # a template that does not parse fails now
    return tok
