"""A streaming text splitter driven by markers: the engine of every reasoning parser.

The model's output arrives as text deltas whose boundaries fall anywhere, inside a marker too
(`</th` + `ink>`). The splitter keeps a small buffer: text that cannot be (the start of) a marker
the current state listens for goes out at once, to the state's channel (reasoning, content, or
nowhere); a tail that could still become a marker waits for the next delta. So any re-chunking of
one text gives the same reasoning and the same content, and a whole text (`split`) is simply one
delta: streamed and non-streamed answers agree by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

REASONING, CONTENT, DROP = "reasoning", "content", "drop"


@dataclasses.dataclass(frozen=True)
class State:
    """Where text goes while in this state, and which marker leads to which state. `prefix_only`:
    the markers count only at the very start of the state's text (a leading `<think>`); anything
    else moves on to `otherwise` at once."""
    channel: str
    markers: dict[str, str]
    prefix_only: bool = False
    otherwise: str | None = None
    # A marker's state may depend on the text after it (harmony's channel name): called with the
    # text up to `until`, it names the next state.
    header_until: str | None = None
    header_state: Callable[[str], str] | None = None


class MarkerSplitter:
    """One choice's split: `feed(delta)` and then `finish()`, each returning (reasoning, content)."""

    def __init__(self, states: dict[str, State], start: str):
        self._states = states
        self._state = start
        self._buf = ""
        self._in_header = False  # reading a header (text up to `header_until`)

    def _longest_marker_prefix(self, markers) -> int:
        """The longest tail of the buffer that is a proper prefix of one of `markers`."""
        best = 0
        for m in markers:
            for k in range(min(len(m) - 1, len(self._buf)), best, -1):
                if m.startswith(self._buf[-k:]):
                    best = k
                    break
        return best

    def _step(self, out: dict[str, list[str]], final: bool) -> bool:
        """Consume what the buffer decides; False once it must wait for more text."""
        state = self._states[self._state]
        if self._in_header:
            i = self._buf.find(state.header_until)
            if i < 0:
                if final:
                    self._buf = ""
                return False
            header, self._buf = self._buf[:i], self._buf[i + len(state.header_until):]
            self._in_header = False
            self._state = state.header_state(header)
            return True
        if state.prefix_only:
            for marker, nxt in state.markers.items():
                if self._buf.startswith(marker):
                    self._buf = self._buf[len(marker):]
                    self._state = nxt
                    return True
                if marker.startswith(self._buf) and not final:
                    return False
            self._state = state.otherwise
            return True
        hit = None
        for marker in state.markers:
            i = self._buf.find(marker)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, marker)
        if hit is not None:
            i, marker = hit
            out[state.channel].append(self._buf[:i])
            self._buf = self._buf[i + len(marker):]
            nxt = state.markers[marker]
            if nxt == "header":
                self._in_header = True
            else:
                self._state = nxt
            return True
        keep = 0 if final else self._longest_marker_prefix(state.markers)
        out[state.channel].append(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _run(self, final: bool) -> tuple[str, str]:
        out: dict[str, list[str]] = {REASONING: [], CONTENT: [], DROP: []}
        while self._step(out, final):
            pass
        return "".join(out[REASONING]), "".join(out[CONTENT])

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back goes to the current state's channel."""
        return self._run(final=True)

    @property
    def in_reasoning(self) -> bool:
        return self._states[self._state].channel == REASONING
