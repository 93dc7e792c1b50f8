"""--max-step-tokens-while-decoding: a step that decodes holds at most that many tokens, decodes
included, and prompt tokens get at least a quarter of it (so a long prompt's chunk no longer stalls
the running streams, and admissions go on beside many decodes); a step without decodes still takes
a whole chunk; greedy tokens are those of the unbounded scheduler."""

from __future__ import annotations

import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import ConfigError
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine, prompt_ids, run_all

GREEDY = dict(temperature=0.0, ignore_eos=True)
CAP = 8
# Staggered arrivals: a long prompt alone, six short ones, then two long ones beside seven decodes.
WORKLOAD = [(prompt_ids(700 + i, 30 if i in (0, 7, 8) else 3), 12 if i < 7 else 6)
            for i in range(9)]


def run(engine):
    """Greedy tokens of WORKLOAD, two requests added per step; and every step's
    (decode rows, prompt tokens) as scheduled."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append((len(out.decodes), sum(p.num_tokens for p in out.prefills)))
        return out

    engine.scheduler.schedule = recording
    for i, (prompt, n) in enumerate(WORKLOAD):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, **GREEDY))
        if i % 2:
            engine.step()
    out = run_all(engine)
    return [out[f"r{i}"][0][0] for i in range(len(WORKLOAD))], steps


def test_a_decoding_step_takes_at_most_the_prefill_budget_with_the_same_tokens():
    expected, free_steps = run(make_engine())
    assert max(p for d, p in free_steps if d) > CAP  # unbounded: big chunks beside decodes
    tokens, steps = run(make_engine(max_step_tokens_while_decoding=CAP))
    assert tokens == expected
    assert all(p <= max(CAP - d, CAP // 4) for d, p in steps if d)
    assert any(d + p == CAP for d, p in steps if d and p)  # filled up to the bound
    assert any(d >= CAP - 1 and p == CAP // 4 for d, p in steps)  # the prompts' floor
    assert max(p for d, p in steps if not d) > CAP  # no decodes: the whole chunk still goes
    assert len(steps) > len(free_steps)


def test_the_budget_flag_is_checked():
    with pytest.raises(ConfigError, match="max-step-tokens-while-decoding"):
        EngineArgs(model="tiny", max_step_tokens_while_decoding=0)
