"""Speculative decoding wired into one engine: the scheduler's policy and proposer, the runner's
verifying step, the metrics, and the engine's one rule: while a step may speculate, the engine
processes the previous step before scheduling (proposals need every token on the host, and a
verification step's token count is known only once it is processed)."""

from __future__ import annotations

import logging

import numpy as np

from jaxinfer.errors import ConfigError
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.eagle import EagleProposer
from jaxinfer.spec_decode.metrics import SpecDecodeMetrics
from jaxinfer.spec_decode.ngram import NgramProposer
from jaxinfer.spec_decode.proposer import Speculator
from jaxinfer.spec_decode.spec_loop import AUTO_SPEC_LOOP_ITERATIONS, SpecLoop, SpecLoopHandle
from jaxinfer.spec_decode.target_step import SpeculativeStep

log = logging.getLogger(__name__)


class Speculation:
    def __init__(self, config: SpeculativeConfig, scheduler, runner, metrics: SpecDecodeMetrics,
                 draft=None, loop_iterations: int | None = None):
        """`draft`: a loaded `spec_decode.draft.DraftModel` (method draft_model) or
        `spec_decode.eagle.EagleProposer` (eagle3, mtp), else None. `loop_iterations`: verifying
        iterations per on-device loop of an EagleProposer (spec_loop.py; None:
        AUTO_SPEC_LOOP_ITERATIONS, or none over state-space layers, whose states roll back
        between host-driven verifying steps; 1: none)."""
        self.config = config
        if config.method in ("draft_model", "eagle3", "mtp") and draft is None:
            raise ConfigError("--speculative-model: no draft model was loaded (build the engine "
                              "with LLMEngine.from_engine_args, or pass draft=)")
        proposer = draft if draft is not None else NgramProposer(config.prompt_lookup_min,
                                                                 config.prompt_lookup_max)
        if draft is not None:
            draft.attach(runner, scheduler.kv.num_blocks, runner.kv_cache[0][0].dtype,
                         config.num_speculative_tokens)
        self.speculator = Speculator(config, proposer)
        scheduler.enable_speculation(self.speculator)
        step = SpeculativeStep(runner, config.num_speculative_tokens, draft)
        if loop_iterations is None:
            loop_iterations = AUTO_SPEC_LOOP_ITERATIONS
            if isinstance(draft, EagleProposer) and scheduler.kv.rolls_back_states:
                log.info("speculative decoding over state-space layers: host-driven verifying "
                         "steps (no on-device loop: a state rolls back between steps)")
                loop_iterations = 1
        if isinstance(draft, EagleProposer) and loop_iterations > 1:
            step.loop = SpecLoop(runner, draft, config.num_speculative_tokens, loop_iterations)
            self.speculator.iterations = loop_iterations
        runner.enable_speculation(step)
        self.step = step
        self.metrics = metrics

    def active(self, num_running: int, num_waiting: int) -> bool:
        return self.speculator.active(num_running, num_waiting)

    def record(self, handle) -> None:
        """A processed step's acceptance counts into the metrics and the acceptance gate."""
        if not handle.sched.num_proposed:
            self.speculator.gate.observe(0, 0)
            return
        if isinstance(handle, SpecLoopHandle):
            self._record_loop(handle)
            return
        tokens = handle.result().tokens  # [K + 1, rows]
        rows = [r for r, e in enumerate(handle.sched.decodes) if e.proposal]
        num_drafts = np.array([len(handle.sched.decodes[r].proposal) for r in rows])
        emitted = (tokens[:, rows] >= 0).sum(axis=0)
        self.metrics.record(num_drafts, emitted - 1)
        self.speculator.gate.observe(int(num_drafts.sum()), int((emitted - 1).sum()))

    def _record_loop(self, handle: SpecLoopHandle) -> None:
        """A loop's iterations, each as the verifying step it stands for; its rows' head position."""
        handle.result()
        draft_computed, proposed, accepted = handle.extras
        for entry, dc in zip(handle.sched.decodes, draft_computed):
            entry.seq.draft_computed = int(dc)
        for num, acc in zip(proposed, accepted):
            ran = num > 0
            self.metrics.record(num[ran], acc[ran])
            self.speculator.gate.observe(int(num.sum()), int(acc.sum()))
