"""An inter-token-latency target for decoding streams (`--itl-target-ms`): the scheduler's cap on
the tokens of a step that decodes (`Scheduler.max_step_tokens_while_decoding`), set after every
processed step from step times the engine measures as it runs. Sarathi-Serve's stall-free batching
(OSDI 2024), its token budget derived online instead of from an offline profile.

A step that decodes is every running stream's inter-token gap, so it may carry only the prompt
tokens that keep it under the target. A long prompt keeps advancing: the cap is never below the
step's decodes + MIN_PREFILL_TOKENS (the scheduler gives prompts at least a quarter of it), or,
where no step with prompt tokens fits the target, such a step runs at least once in every
MAX_STEPS_WITHOUT_PROMPTS + 1 (a duty cycle that keeps the steps' mean within the target).

`StepTimeModel` is the measurement (step seconds vs scheduled tokens); `ItlTarget` turns a target
into the largest token count predicted to fit it, rounded down to the runner's token bucket when
it reaches one (a step is padded to its bucket: a cap on a bucket fills it, one past it pays for
the next). "auto" targets AUTO_FACTOR x the predicted time of a step of decodes alone, of the
batch the running sequences and the waiting ones that decode right after one prompt chunk make
(at most max_num_seqs; Scheduler.num_waiting_to_decode): the gap the streams will have once
those run. Counting only the running ones throttled a burst of short requests into a trickle of
admissions: the batch stayed half full, about a quarter of the throughput lost at saturation
(host_path_h100.json's served c = 256). Long prompts are not counted (they prefill for many
steps first), so a prefill burst is still held to the streams' gap.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import math
import statistics

from jaxinfer.errors import ConfigError

AUTO = "auto"
AUTO_FACTOR = 2.0  # "auto": a decoding step may take this many idle decode steps' time
MIN_PREFILL_TOKENS = 4  # the cap leaves prompts at least this beside the step's decodes
# ...or, where no step with prompt tokens fits the target, prompts skip at most this many steps
MAX_STEPS_WITHOUT_PROMPTS = 7
WINDOW = 8  # recent steps kept per size class; medians, so one slow step moves nothing
OUTLIER_FACTOR = 4.0  # a step this many times its prediction is not kept alone (a compile)


class StepTimeModel:
    """Seconds of a step vs its scheduled tokens, fitted online from the recent steps.

    Steps are grouped by size class (tokens in (2^(k-1), 2^k], the runner's token buckets); each
    class is a point (median tokens, median seconds) of its last WINDOW steps, and the times are
    made non-decreasing in tokens. `predict(x)` reads that curve: linear between points, below
    the first proportional to it (a step's time per token never grows with its tokens), above the
    last with the last segment's slope (at least flat; proportional when there is one point) but
    only up to twice its tokens: past that it is unknown (None). So a cap grows towards larger
    steps a doubling at a time, and a step slower than predicted costs at most about twice the
    largest step measured (whose time fitted the target)."""

    def __init__(self, window: int = WINDOW):
        self._steps: dict[int, collections.deque] = {}
        self._window = window
        self._curve: tuple[list[float], list[float]] | None = None
        self._slow_last = False

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` scheduled tokens took `seconds`. One over OUTLIER_FACTOR x the
        prediction is not kept unless the step before was one too: a lone slow step is a compile
        (a sampler variant's) or the host stalled, and one kept where the cap then never goes
        again would hold the cap down for good (the curve only rises with tokens)."""
        expected = self.predict(tokens)
        slow = expected is not None and seconds > OUTLIER_FACTOR * expected
        lone, self._slow_last = slow and not self._slow_last, slow
        if lone:
            return
        size_class = (max(tokens, 1) - 1).bit_length()
        steps = self._steps.get(size_class)
        if steps is None:
            steps = self._steps[size_class] = collections.deque(maxlen=self._window)
        steps.append((tokens, seconds))
        self._curve = None

    def curve(self) -> tuple[list[float], list[float]]:
        """The size classes' points, ascending in tokens, times non-decreasing."""
        if self._curve is None:
            xs, ts, top = [], [], 0.0
            for k in sorted(self._steps):
                steps = self._steps[k]
                top = max(top, statistics.median_low(t for _, t in steps))
                xs.append(statistics.median([x for x, _ in steps]))
                ts.append(top)
            self._curve = (xs, ts)
        return self._curve

    def predict(self, tokens: float) -> float | None:
        xs, ts = self.curve()
        if not xs:
            return None
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs) and xs[i] == tokens:
            return ts[i]
        if i == 0:
            return ts[0] * tokens / xs[0]
        if i < len(xs):
            return ts[i - 1] + (ts[i] - ts[i - 1]) * (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        if tokens > 2 * xs[-1]:
            return None
        return ts[-1] + self._last_slope() * (tokens - xs[-1])

    def _last_slope(self) -> float:
        xs, ts = self.curve()
        if len(xs) == 1:
            return ts[0] / xs[0]
        return (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step is predicted to compute in `seconds` (None: nothing measured)."""
        xs, ts = self.curve()
        if not xs:
            return None
        if seconds < ts[0]:
            return int(xs[0] * seconds / ts[0])
        i = bisect.bisect_right(ts, seconds) - 1  # the last point within
        if i + 1 < len(xs):
            x0, x1, t0, t1 = xs[i], xs[i + 1], ts[i], ts[i + 1]
            return int(x0 + (x1 - x0) * (seconds - t0) / (t1 - t0))
        slope = self._last_slope()
        reach = 2 * xs[-1] if slope <= 0 else xs[-1] + (seconds - ts[-1]) / slope
        return int(min(reach, 2 * xs[-1]))


def parse_itl_target(value: str) -> float | str | None:
    """--itl-target-ms: milliseconds, "auto", or "off" (None)."""
    text = value.strip().lower()
    if text in ("off", "none"):
        return None
    if text == AUTO:
        return AUTO
    try:
        return check_itl_target(float(text))
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a positive number of milliseconds, 'auto' or 'off'") from None


def check_itl_target(target):
    """An EngineArgs.itl_target_ms value, checked."""
    if target is None or target == AUTO:
        return target
    if (isinstance(target, bool) or not isinstance(target, (int, float))
            or not 0 < target < math.inf):
        raise ConfigError(f"--itl-target-ms {target!r}: must be a positive number of "
                          f"milliseconds, 'auto' or 'off'")
    return float(target)


def padded_tokens(buckets, sched) -> int:
    """The tokens of the executable a step runs in (the runner's bucket; buckets.py)."""
    if sched.prefills or sched.num_proposed:
        sizes, n = buckets.token_buckets, sched.num_tokens
    else:
        sizes, n = buckets.decode_buckets, len(sched.decodes)
    return sizes[min(bisect.bisect_left(sizes, n), len(sizes) - 1)]


class ItlTarget:
    """The cap on a decoding step's tokens: `static_cap` (--max-step-tokens-while-decoding, None:
    none), lowered to what fits `target` (ms, AUTO, or None: off) by the measured step times."""

    def __init__(self, target: float | str | None, static_cap: int | None, buckets,
                 model: StepTimeModel | None = None, max_num_seqs: int | None = None):
        self.target = check_itl_target(target)
        self.max_num_seqs = max_num_seqs
        self.static_cap = static_cap
        self.buckets = buckets
        self.model = model or StepTimeModel()
        self._last_ready: float | None = None
        self._shapes_seen: set[tuple[bool, int]] = set()
        self._steps_without_prompts = 0

    @classmethod
    def for_engine(cls, scheduler, buckets) -> "ItlTarget":
        """From the engine's SchedulerConfig. A multi-process engine runs the same schedule on
        every process, which times measured on each would break: "auto" is off there, and a
        target an error."""
        import jax
        target = scheduler.itl_target_ms
        if target is not None and jax.process_count() > 1:
            if target != AUTO:
                raise ConfigError(f"--itl-target-ms {target}: a multi-process engine schedules "
                                  f"every step alike on each process; step times measured on "
                                  f"each would differ (use --max-step-tokens-while-decoding)")
            target = None
        return cls(target, scheduler.max_step_tokens_while_decoding, buckets,
                   max_num_seqs=scheduler.max_num_seqs)

    def step_done(self, handle, num_running: int, num_waiting: int = 0) -> int | None:
        """Record a processed step (runner.StepHandle); the cap for the steps to come, for its
        decodes (or, when it had none, the `num_running` sequences) with `num_waiting` more to
        admit."""
        ready = handle.ready_time
        if ready is not None:
            # The device starts a step once it is dispatched and the previous one is done, so
            # back-to-back steps are timed from one's result to the next's: the streams' gap.
            start = handle.dispatch_time
            if self._last_ready is not None:
                start = max(start, self._last_ready)
            self._last_ready = ready
            shape = (bool(handle.sched.prefills), padded_tokens(self.buckets, handle.sched))
            if shape not in self._shapes_seen:  # (without warm-up: the step that compiled it)
                self._shapes_seen.add(shape)
            elif not handle.is_loop:  # (a decode loop's time is several steps')
                self.model.observe(handle.sched.num_tokens, ready - start)
        return self.cap(len(handle.sched.decodes) or num_running, num_waiting)

    def target_seconds(self, num_decodes: int, num_waiting: int = 0) -> float | None:
        if self.target is None:
            return None
        if self.target != AUTO:
            return self.target / 1e3
        batch = num_decodes + num_waiting
        if self.max_num_seqs is not None:
            batch = min(batch, self.max_num_seqs)
        xs, _ = self.model.curve()
        if xs:  # a doubling past the largest step measured at most: the curve reaches that far
            batch = min(batch, max(num_decodes, int(2 * xs[-1])))
        idle = self.model.predict(max(batch, 1))
        return None if idle is None else AUTO_FACTOR * idle

    def cap(self, num_decodes: int, num_waiting: int = 0) -> int | None:
        """Most tokens of a step with `num_decodes` decodes (0: no prompt tokens), `num_waiting`
        sequences waiting to be admitted."""
        target = self.target_seconds(num_decodes, num_waiting) if num_decodes else None
        if target is None:
            return self.static_cap
        fit = self.model.tokens_within(target) or 0
        floor = num_decodes + MIN_PREFILL_TOKENS
        if fit >= floor:
            self._steps_without_prompts = 0
            # The bucket below, unless prompts' share of it (the scheduler gives them at least a
            # quarter of the cap) would spill the step past it anyway.
            bucket = self._fill_bucket(fit, down=True)
            fits = bucket - num_decodes >= max(bucket // 4, MIN_PREFILL_TOKENS)
            cap = bucket if fits else fit
        else:
            cap = self._duty_cycle(num_decodes, self._fill_bucket(floor, down=False), target)
        return cap if self.static_cap is None else min(cap, self.static_cap)

    def _fill_bucket(self, tokens: int, down: bool) -> int:
        """The token bucket at or below (`down`) or above `tokens`; `tokens` itself below the
        smallest bucket (going down) or past the largest (going up)."""
        sizes = self.buckets.token_buckets
        if down:
            i = bisect.bisect_right(sizes, tokens)
            return sizes[i - 1] if i else tokens
        i = bisect.bisect_left(sizes, tokens)
        return sizes[i] if i < len(sizes) else tokens

    def _duty_cycle(self, num_decodes: int, prompt_step: int, target: float) -> int:
        """Even the smallest step with prompt tokens (`prompt_step` tokens) is predicted past the
        target: run it once every `period` steps and decode alone between, so that the steps'
        mean stays within the target: period = (prompt step - decode step) / (target - decode
        step), at most MAX_STEPS_WITHOUT_PROMPTS + 1; every step when the decodes alone miss it."""
        decode = self.model.predict(num_decodes)
        prompt = self.model.predict(prompt_step)
        if decode is None or decode >= target:
            period = 1
        elif prompt is None:
            period = MAX_STEPS_WITHOUT_PROMPTS + 1
        else:
            period = min(math.ceil((prompt - decode) / (target - decode)),
                         MAX_STEPS_WITHOUT_PROMPTS + 1)
        self._steps_without_prompts += 1
        if self._steps_without_prompts >= period:
            self._steps_without_prompts = 0
            return prompt_step
        return 0
