"""An ordinary step is two dispatches: its forward cuts its inputs from the one packed buffer and
hands the sampler's on (step_programs.packed_forward, packed_sample), with no unpacking call of
its own; the on-device decode loop is one. And warm-up compiles the forward once per bucket, no
more often than before the packed buffer went into the programs."""

from __future__ import annotations

from jaxinfer.parallel import transfer
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import StructuredOutputsParams
from test_engine_support import assert_all_free, make_engine, prompt_ids, run_all


def test_an_ordinary_step_dispatches_two_compiled_programs(monkeypatch):
    engine = make_engine(warmup=True, decode_steps_per_call=3)
    runner, programs = engine.runner, engine.runner.programs
    # The forward (the costly compile) once per step bucket, as before (3 here: mixed 16 and 32,
    # decode 8); the sampler once per row count and variant; no other table holds a forward.
    compiled = {name: len(table) for name, table in programs.compiled.items()}
    buckets = runner.buckets
    assert compiled["packed forward"] == len(buckets.token_buckets) + len(buckets.decode_buckets)
    assert compiled["packed forward"] == 3
    assert compiled["packed sample"] == 3 * len(buckets.decode_buckets)
    assert compiled["decode loop"] == 2 * len(runner.loop_buckets)
    assert {name for name, n in compiled.items() if n} == {
        "packed forward", "packed sample", "decode loop", "copy"}, compiled
    calls: list[tuple[str, bool]] = []  # (program, whether warm-up compiled the one it ran)
    run = programs.run

    def spy_run(name, *args, key=None, **static):
        calls.append((name, key is not None and key in programs.compiled[name]))
        return run(name, *args, key=key, **static)

    put_tree = transfer.put_tree  # the unpacking jit of a placed batch
    monkeypatch.setattr(programs, "run", spy_run)
    monkeypatch.setattr(transfer, "put_tree", lambda *a: calls.append(("unpack", False))
                        or put_tree(*a))
    per_step: list[list[tuple[str, bool]]] = []
    execute = runner.execute

    def counted(sched):
        calls.clear()
        handle = execute(sched)
        per_step.append(list(calls))
        return handle

    monkeypatch.setattr(runner, "execute", counted)
    # Every sampler variant: base (greedy, seeded), full (logprobs, top-k, penalties), masked.
    kinds = [SamplingParams(max_tokens=8, temperature=0.0),
             SamplingParams(max_tokens=7, temperature=0.8, seed=1),
             SamplingParams(max_tokens=6, temperature=0.7, top_k=5, logprobs=2),
             SamplingParams(max_tokens=6, repetition_penalty=1.3, frequency_penalty=0.5),
             SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
                 regex="[a-z ]+"))]
    finished = set()
    for i, params in enumerate(kinds):
        engine.add_request(f"r{i}", prompt_ids(70 + i, 3 + 4 * i), params)
        finished |= {o.request_id for o in engine.step() if o.finished}
    finished |= set(run_all(engine))
    # Then decodes alone, unconstrained: on-device loops.
    for i in range(2):
        engine.add_request(f"loop{i}", prompt_ids(80 + i, 5), SamplingParams(max_tokens=12))
    finished |= set(run_all(engine))
    assert finished == {f"r{i}" for i in range(len(kinds))} | {"loop0", "loop1"}
    names = [tuple(name for name, _ in step) for step in per_step]
    assert set(names) == {("packed forward", "packed sample"), ("decode loop",)}, per_step
    # Each step ran the executables warm-up compiled for its bucket and variant.
    assert all(compiled for step in per_step for _, compiled in step), per_step
    assert_all_free(engine)
