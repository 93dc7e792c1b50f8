"""A choice's output text: incremental detokenization, stop strings, and held-back text.

Stop strings are matched on the detokenized text, so one split across several tokens ("##" + "#")
still stops generation, and it is never streamed: while the text ends with something that could be
the start of a stop string, that tail is held back until the next tokens decide it.
"""

from __future__ import annotations

from jaxinfer.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str],
                 include_stop_str: bool, skip_special_tokens: bool):
        # Without a tokenizer (token-id-only use of the engine) there is no text and no stop strings.
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
                      if tokenizer is not None else None)
        self.stops = list(stop)
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.include_stop_str = include_stop_str
        self.text = ""      # decoded text (cut at a stop string once one is found)
        self.emitted = 0    # characters of `text` already handed out
        self.final = False  # no more text will come: stop holding back

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Decode one more token. Returns the stop string it completed (text then ends there), or
        None. `check_stop` is False while the choice is still short of min_tokens."""
        if self.detok is None or self.final:
            return None
        delta = self.detok.add(token_id)
        if not delta:
            return None
        prev_len = len(self.text)
        self.text += delta
        if not (check_stop and self.stops):
            return None
        start = max(0, prev_len - self.max_stop_len + 1)
        hit: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i != -1 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return None
        i, s = hit
        # Text before `emitted` is already out (only possible for a stop that began before
        # min_tokens was reached); never take it back.
        end = i + len(s) if self.include_stop_str else i
        self.text = self.text[:max(end, self.emitted)]
        self.final = True
        return s

    def finish(self) -> None:
        """The choice ended for another reason: release the held-back text."""
        self.final = True

    def _holdback(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        text = self.text
        for k in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def take_new_text(self) -> str:
        """Text that became final since the previous call."""
        end = len(self.text) if self.final or not self.stops else len(self.text) - self._holdback()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    @property
    def emitted_text(self) -> str:
        return self.text[:self.emitted]
