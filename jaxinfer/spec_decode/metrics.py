"""Speculative decoding's Prometheus counters, vLLM's names under `jaxinfer:`: drafts (rows that
carried proposals), draft tokens, accepted tokens, and accepted tokens by position (label
`position`: how often the proposal at that position was accepted)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, num_speculative_tokens: int):
        name, r = model_name, registry

        def counter(metric, doc, labels=()):
            return Counter(metric, doc, ["model_name", *labels], registry=r)

        self.num_drafts = counter("jaxinfer:spec_decode_num_drafts",
                                  "Sequence steps that verified proposals").labels(name)
        self.num_draft_tokens = counter("jaxinfer:spec_decode_num_draft_tokens",
                                        "Proposed tokens verified").labels(name)
        self.num_accepted_tokens = counter("jaxinfer:spec_decode_num_accepted_tokens",
                                           "Proposed tokens accepted").labels(name)
        per_pos = counter("jaxinfer:spec_decode_num_accepted_tokens_per_pos",
                          "Proposed tokens accepted, by position", ("position",))
        self.per_position = [per_pos.labels(name, str(i)) for i in range(num_speculative_tokens)]
        # Totals of this engine (benchmarks read them without parsing Prometheus text).
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """One verification step: per row, proposals made and accepted (rows without proposals
        are left out by the caller)."""
        if not num_drafts.size:
            return
        drafts, tokens, accepted = int(num_drafts.size), int(num_drafts.sum()), int(num_accepted.sum())
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(tokens)
        self.num_accepted_tokens.inc(accepted)
        self.drafts += drafts
        self.draft_tokens += tokens
        self.accepted += accepted
        # a row that accepted a proposals accepted positions 0 .. a - 1
        accepted_at = (np.arange(len(self.per_position))[None, :] < num_accepted[:, None]).sum(0)
        for pos, count in enumerate(accepted_at):
            if count:
                self.per_position[pos].inc(int(count))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0
