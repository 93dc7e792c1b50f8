"""Speculative decoding: time per output token with and without speculation, acceptance, and the
overhead of the default policy at a large batch.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite spec-decode -- \
        [--sections demo,ngram_edit,crossover,llama8b] [--k 4] [--output-len 128] [--save [DIR]]
        [--merge benchmarks/results/spec_decode_h200.json]

Sections (one process; each engine is dropped before the next is built; lazily compiled shapes
are shared by engines of the same model, and every workload runs twice untimed first with prefix
caching off, so the timed pass repeats its schedule and no compilation is timed):
  demo        the demo target alone and with the demo draft (--speculative-model), c = 1, greedy,
              prompts cut from checkpoints/heldout_sample.txt: TPOT of each, the acceptance rate;
  eagle       the demo target alone and with its EAGLE-3 head (--demo-eagle, method eagle3,
              --eagle-k proposals, default 5), c = 1: demo_c1_tpot_ms_eagle / _nospec,
              demo_eagle_mean_accepted_len (tokens emitted per verifying row-step: 1 + accepted
              proposals), the acceptance rate, demo_eagle_spec_loop_iters_per_dispatch
              (verifying iterations per verifying dispatch: > 1 when the on-device
              speculative loop ran, spec_decode/spec_loop.py);
  eagle_crossover  the same pair under the default policy (threshold 16, acceptance gate) at
              c = 1, 4, 16, 64 (--eagle-crossover): TPOT and output throughput of each;
  ngram_edit  the demo target alone and with n-gram prompt lookup, c = 1, greedy, an editing
              workload: "rewrite this function" prompts that contain the code being rewritten;
  crossover   demo target alone and with the demo draft, the batch-size policy and the acceptance
              gate off, c = 1, 2, 4, 8, 16, 32 (--crossover): TPOT and output throughput of each,
              with over without (the crossover behind --speculative-disable-by-batch-size);
  llama8b     a Llama-3-8B-shaped target (random bf16 weights) with a Llama-3.2-1B-shaped draft
              (random weights: acceptance is meaningless, this measures overhead only), c = 64
              (64 prompts x 128 in / 64 out): output throughput without speculation and under the
              default policy: output throughput with over without;
  llama8b_nogate  the same with the acceptance gate off (--speculative-min-acceptance 0: the
              batch-size threshold alone), against llama8b's baseline of the same run.
TPOT = (last token time - first token time) / (tokens - 1) per request, averaged. `--save` writes
spec_decode_<gpu>.json (`results_io`) after each measurement, so a run cut short keeps what it
measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.paths import REPO_ROOT


DEMO = REPO_ROOT / "checkpoints" / "demo-target"
DEMO_DRAFT = REPO_ROOT / "checkpoints" / "demo-draft"
DEMO_EAGLE = REPO_ROOT / "checkpoints" / "demo-eagle3"
HELDOUT = REPO_ROOT / "checkpoints" / "heldout_sample.txt"
LLAMA32_1B = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  tie_word_embeddings=True)


def demo_prompts(n: int, chars: int = 700) -> list[str]:
    text = HELDOUT.read_text()
    step = max((len(text) - chars) // max(n - 1, 1), 1)
    return [text[i * step:i * step + chars] for i in range(n)]


def edit_prompts(n: int) -> list[str]:
    """Each method of the held-out sample's class, to be rewritten: the prompt holds the code."""
    lines = HELDOUT.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("    def ")]
    funcs = ["\n".join(lines[a:b]).rstrip() for a, b in zip(starts, starts[1:] + [len(lines)])]
    funcs = [f for f in funcs if 150 <= len(f) <= 1200] or funcs
    out = []
    for i in range(n):
        code = funcs[i % len(funcs)]
        first = code.splitlines()[0]
        out.append(f"# Rewrite this function with clearer names:\n{code}\n\n"
                   f"# Rewritten:\n{first}\n")
    return out


def engine(model, **kwargs):
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    # No prefix caching: the timed pass repeats the untimed one's schedule (hence its shapes).
    args = dict(model=str(model), warmup=False, compilation_cache_dir=None, num_blocks=4096,
                enable_prefix_caching=False)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def timed_run(e, prompts, output_len: int, concurrency: int) -> dict:
    """All prompts, `concurrency` at a time (greedy, fixed length): mean TPOT and throughput."""
    from jaxinfer.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    pending = list(enumerate(prompts))
    start = time.perf_counter()
    while pending or e.has_unfinished_requests():
        while pending and len(e.requests) < concurrency:
            i, p = pending.pop(0)
            e.add_request(f"q{i}", p, params)
        for out in e.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id], counts[out.request_id] = now, n
            tokens[out.request_id] = out.outputs[0].token_ids
    wall = time.perf_counter() - start
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    return dict(tpot_ms=round(1e3 * sum(tpot) / len(tpot), 3),
                output_tok_s=round(sum(counts.values()) / wall, 1),
                tokens=[tokens[r] for r in sorted(tokens)])


def measure(e, prompts, output_len: int, concurrency: int) -> dict:
    for _ in range(2):  # compiles every shape the workload uses
        timed_run(e, prompts, output_len, concurrency)
    spec = e.spec and e.spec.metrics
    before = (spec.draft_tokens, spec.accepted, spec.drafts) if spec else (0, 0, 0)
    dispatches = verify_dispatches(e)
    out = timed_run(e, prompts, output_len, concurrency)
    if spec:
        (loops, singles, per_loop), (loops0, singles0, _) = verify_dispatches(e), dispatches
        loops, singles = loops - loops0, singles - singles0
        # verifying iterations per verifying dispatch: 1 without the on-device loop
        out["spec_loop_iters_per_dispatch"] = round(
            (loops * per_loop + singles) / max(loops + singles, 1), 3)
        drafted, accepted = spec.draft_tokens - before[0], spec.accepted - before[1]
        out["acceptance_rate"] = round(accepted / drafted, 4) if drafted else 0.0
        steps = spec.drafts - before[2]  # row-steps that verified proposals
        out["mean_accepted_len"] = round(1 + accepted / steps, 3) if steps else 1.0
    return out


def verify_dispatches(e) -> tuple[int, int, int]:
    """(on-device loops, single verifying steps, iterations per loop) dispatched so far."""
    step = e.spec and e.spec.step
    if not step:
        return 0, 0, 0
    loop = step.loop
    return (loop.dispatches if loop else 0, step.single_steps,
            loop.iterations if loop else 0)


def identical(a: dict, b: dict) -> str:
    """How many requests' greedy outputs agree (bf16 kernels: the verification path's logits may
    differ from the decode path's in the last bit, which can flip a near tie)."""
    ta, tb = a["tokens"], b["tokens"]
    return f"{sum(x == y for x, y in zip(ta, tb))}/{len(ta)}"


def drop(e) -> None:
    del e
    gc.collect()


def with_and_without(a, prompts, concurrency: int, **spec) -> tuple[dict, dict]:
    """The workload on the demo target alone, then with `spec` (speculative-decoding flags)."""
    out = []
    for kwargs in ({}, spec):
        e = engine(a.demo_target, max_num_seqs=max(concurrency, 8), **kwargs)
        out.append(measure(e, prompts, a.output_len, concurrency))
        drop(e)
    return out[0], out[1]


def compare_c1(a, m: dict, prefix: str, prompts, **spec) -> float:
    base, fast = with_and_without(a, prompts, 1, **spec)
    m.update({f"{prefix}_c1_tpot_ms_nospec": base["tpot_ms"],
              f"{prefix}_acceptance_rate": fast["acceptance_rate"],
              f"{prefix}_over_nospec_tpot": round(fast["tpot_ms"] / base["tpot_ms"], 3),
              f"{prefix}_greedy_identical": identical(base, fast)})
    return fast["tpot_ms"]


def section_demo(a, m: dict) -> None:
    m["demo_c1_tpot_ms_draft"] = compare_c1(a, m, "demo", demo_prompts(a.num_prompts),
                                            speculative_model=str(a.demo_draft),
                                            num_speculative_tokens=a.k)


def eagle_flags(a) -> dict:
    return dict(speculative_config=json.dumps({"method": "eagle3", "model": str(a.demo_eagle),
                                               "num_speculative_tokens": a.eagle_k}),
                spec_loop_iterations=a.spec_loop_iterations)


def section_eagle(a, m: dict) -> None:
    base, fast = with_and_without(a, demo_prompts(a.num_prompts), 1, **eagle_flags(a))
    m.update({"demo_c1_tpot_ms_nospec": base["tpot_ms"], "demo_c1_tpot_ms_eagle": fast["tpot_ms"],
              "demo_eagle_over_nospec_tpot": round(fast["tpot_ms"] / base["tpot_ms"], 3),
              "demo_eagle_mean_accepted_len": fast["mean_accepted_len"],
              "demo_eagle_acceptance_rate": fast["acceptance_rate"],
              "demo_eagle_k": a.eagle_k, "demo_eagle_greedy_identical": identical(base, fast),
              "demo_eagle_spec_loop_iters_per_dispatch": fast["spec_loop_iters_per_dispatch"]})


def section_eagle_crossover(a, m: dict) -> None:
    ratio = {}
    for c in a.eagle_crossover:
        base, spec = with_and_without(a, demo_prompts(2 * c), c, **eagle_flags(a))
        for key, run in (("nospec", base), ("eagle", spec)):
            m[f"eagle_crossover_c{c}_tpot_ms_{key}"] = run["tpot_ms"]
            m[f"eagle_crossover_c{c}_output_tok_s_{key}"] = run["output_tok_s"]
        m[f"eagle_crossover_c{c}_mean_accepted_len"] = spec["mean_accepted_len"]
        m[f"eagle_crossover_c{c}_spec_loop_iters_per_dispatch"] = spec[
            "spec_loop_iters_per_dispatch"]
        ratio[f"c{c}"] = round(spec["output_tok_s"] / base["output_tok_s"], 3)
        m["eagle_crossover_spec_over_nospec"] = dict(ratio)
        print(f"eagle crossover c={c}: tpot {base['tpot_ms']} -> {spec['tpot_ms']} ms, "
              f"throughput x{ratio[f'c{c}']}", flush=True)
        a.checkpoint()


def section_ngram_edit(a, m: dict) -> None:
    m["ngram_edit_c1_tpot_ms"] = compare_c1(a, m, "ngram_edit", edit_prompts(a.num_prompts),
                                            speculative_method="ngram", num_speculative_tokens=a.k)


def section_crossover(a, m: dict) -> None:
    ratio = {}
    for c in a.crossover:
        base, spec = with_and_without(a, demo_prompts(2 * c), c,
                                      speculative_model=str(a.demo_draft),
                                      num_speculative_tokens=a.k,
                                      speculative_disable_by_batch_size=10**6,
                                      speculative_min_acceptance=0.0)
        for key, run in (("nospec", base), ("draft", spec)):
            m[f"crossover_demo_c{c}_tpot_ms_{key}"] = run["tpot_ms"]
            m[f"crossover_demo_c{c}_output_tok_s_{key}"] = run["output_tok_s"]
        m[f"crossover_demo_c{c}_acceptance_rate"] = spec["acceptance_rate"]
        ratio[f"c{c}"] = round(spec["output_tok_s"] / base["output_tok_s"], 3)
        m["crossover_demo_draft_spec_over_nospec"] = dict(ratio)
        print(f"crossover c={c}: tpot {base['tpot_ms']} -> {spec['tpot_ms']} ms, throughput "
              f"x{ratio[f'c{c}']}", flush=True)
        a.checkpoint()


def llama8b_runs(a, m: dict, variants: dict) -> None:
    """The c = 64 workload on the 8B-shaped target: `variants` maps a metric key to the engine's
    speculative flags beside the draft (None: no speculation); each is saved as soon as it is measured."""
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = Path(tmp) / "llama8b", Path(tmp) / "llama1b"
        for d, cfg in ((target, LLAMA3_8B), (draft, LLAMA32_1B)):
            d.mkdir()
            (d / "config.json").write_text(json.dumps(cfg))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, 120000, 128).tolist() for _ in range(64)]
        common = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=64,
                      max_num_batched_tokens=512, max_model_len=1024, num_blocks=6144)
        for key, extra in variants.items():
            spec = {} if extra is None else dict(speculative_model=str(draft),
                                                 num_speculative_tokens=a.k, **extra)
            e = engine(target, **spec, **common)
            run = measure(e, prompts, 64, 64)
            m[f"llama8b_c64_output_tok_s_{key}"] = run["output_tok_s"]
            base = m.get("llama8b_c64_output_tok_s_nospec")
            if e.spec is not None:
                if base:
                    m[f"llama8b_c64_{key}_over_nospec"] = round(run["output_tok_s"] / base, 3)
                m[f"llama8b_c64_{key}_drafts_all_passes"] = e.spec.metrics.drafts
                m[f"llama8b_c64_{key}_gate_closings"] = e.spec.speculator.gate.closings
            print(f"llama8b {key}: {json.dumps({k: v for k, v in m.items() if 'llama8b' in k})}",
                  flush=True)
            a.checkpoint()
            drop(e)


def section_llama8b(a, m: dict) -> None:
    # The default policy: "spec" -> llama8b_c64_spec_over_nospec, the key.
    llama8b_runs(a, m, {"nospec": None, "spec": {}})


def section_llama8b_nogate(a, m: dict) -> None:
    """The batch-size policy alone (acceptance gate off), against section llama8b's baseline."""
    llama8b_runs(a, m, {"spec_nogate": dict(speculative_min_acceptance=0.0)})


SECTIONS = {"demo": section_demo, "eagle": section_eagle, "eagle_crossover": section_eagle_crossover,
            "ngram_edit": section_ngram_edit, "crossover": section_crossover,
            "llama8b": section_llama8b, "llama8b_nogate": section_llama8b_nogate}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="demo,ngram_edit,crossover,llama8b")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--demo-target", type=Path, default=DEMO, help="the demo target's directory")
    p.add_argument("--demo-draft", type=Path, default=DEMO_DRAFT, help="the demo draft's directory")
    p.add_argument("--demo-eagle", type=Path, default=DEMO_EAGLE,
                   help="the demo target's EAGLE-3 head (HF format)")
    p.add_argument("--eagle-k", type=int, default=5, help="proposals per step of the eagle sections")
    p.add_argument("--spec-loop-iterations", type=int, default=None,
                   help="--spec-loop-iterations of the eagle sections (default: the engine's)")
    p.add_argument("--eagle-crossover", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16, 64])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--crossover", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="an earlier record of this benchmark: its metrics are kept beside this "
                        "run's (sections run in several device calls); the config names it")
    results_io.add_save_arg(p, "spec_decode_<gpu>")
    a = p.parse_args(argv)
    import jax
    metrics: dict = {}
    merged = None
    if a.merge:
        earlier = json.loads(Path(a.merge).read_text())
        metrics.update(earlier["metrics"])
        merged = {k: earlier[k] for k in ("date", "commit", "command")}
    def checkpoint() -> None:
        """Save what is measured so far: a run cut short keeps it."""
        if a.save:
            results_io.save(a.save, a.name or f"spec_decode_{results_io.device_slug()}",
                            config=dict(k=a.k, output_len=a.output_len, num_prompts=a.num_prompts,
                                        crossover=a.crossover, demo_target=str(a.demo_target),
                                        demo_draft=str(a.demo_draft), sections=a.sections,
                                        demo_eagle=str(a.demo_eagle), eagle_k=a.eagle_k,
                                        spec_loop_iterations=a.spec_loop_iterations,
                                        eagle_crossover=a.eagle_crossover,
                                        backend=jax.devices()[0].platform, merged_from=merged),
                            metrics=metrics)
    a.checkpoint = checkpoint
    for name in a.sections.split(","):
        t0 = time.perf_counter()
        SECTIONS[name](a, metrics)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s: {json.dumps(metrics)}", flush=True)
        checkpoint()


if __name__ == "__main__":
    main()
