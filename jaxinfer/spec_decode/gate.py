"""The acceptance gate: speculation pauses while its proposals are almost never accepted.

A verifying step costs more than a plain one (the proposer's work, k + 1 scored positions per
row, no host/device overlap) and pays back only through accepted proposals. A draft that does not
match the target (another domain, a random-weight stand-in) makes every speculating step a loss,
and at the tail of a large batch, where the batch-size policy switches speculation back on, that
loss is most of what speculation costs. So the gate keeps the acceptance rate of the recent
verified proposals (at least `WINDOW_TOKENS` of them, over at least `WINDOW_STEPS` steps) and
closes while it is below `min_acceptance` (`--speculative-min-acceptance`); once closed it opens
again after `PROBE_AFTER_STEPS` processed steps with an empty window, so a draft that starts to
match again (new requests, another domain) gets speculated with again.
"""

from __future__ import annotations

from collections import deque

# Verified proposals the rate is judged on: enough that one unlucky row does not close the gate.
WINDOW_TOKENS = 64
# Verifying steps the rate is judged on. Rows admitted together meet their least predictable
# tokens together, right after their prompts (the demo's EAGLE-3 head: 9-10% of the proposals of
# a batch's first 1-4 steps, 33-38% over its first 16, 46-58% over whole requests), and 4 rows
# propose 64 tokens in 3 steps, 16 rows in one: judged on tokens alone the gate closes on the
# start of a batch, for longer than its requests run.
WINDOW_STEPS = 16
# Processed steps a closed gate waits before it lets speculation try again.
PROBE_AFTER_STEPS = 256


class AcceptanceGate:
    def __init__(self, min_acceptance: float):
        self.min_acceptance = min_acceptance
        self._window: deque[tuple[int, int]] = deque()  # (proposed, accepted) per verified step
        self._proposed = self._accepted = 0
        self._closed_for = 0  # processed steps left before the gate opens again
        self.closings = 0     # how often it closed (tests, benchmarks)

    @property
    def open(self) -> bool:
        return self._closed_for == 0

    def observe(self, proposed: int, accepted: int) -> None:
        """One processed step: its verified proposals and how many were accepted (0, 0 when it
        speculated on nothing)."""
        if not self.open:
            self._closed_for -= 1
            return
        if not proposed:
            return
        self._window.append((proposed, accepted))
        self._proposed += proposed
        self._accepted += accepted
        while (len(self._window) > WINDOW_STEPS
               and self._proposed - self._window[0][0] >= WINDOW_TOKENS):
            p, a = self._window.popleft()
            self._proposed -= p
            self._accepted -= a
        if (self._proposed >= WINDOW_TOKENS and len(self._window) >= WINDOW_STEPS
                and self._accepted < self.min_acceptance * self._proposed):
            self._closed_for = PROBE_AFTER_STEPS
            self.closings += 1
            self._window.clear()
            self._proposed = self._accepted = 0
