"""Tensor and data parallelism on two H200s, one script, one run: correctness first, then every
figure beside its anchor.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite multi-gpu -- [--sections ...]
        [--deadline-s 400] [--limits llama8b_tp2=90,...] [--save [DIR]]

Sections (each in its own process, so a crash or a timeout keeps the others' figures; they share
one persistent compilation cache; with `--save` the record is rewritten after each):
  allreduce   the anchor: one `psum` over the two GPUs inside a chain of 64 (a 32-layer decode
              step has 64), 8 KB (one token's hidden state) and 2 MB; µs per psum.
  allreduce_oneshot  the same with XLA's one-shot all-reduce kernel (NVLink peer reads) in place
              of NCCL for the messages it takes.
  parity      the bundled demo model (trained, so its greedy tokens are not near-ties) with the
              mosaic kernels: greedy continuations at TP = 1 and TP = 2, how many are identical.
  llama8b_tp1 Llama-3-8B shape, dummy bf16, one GPU: batch-1 TPOT (512-token prompt; the
              difference between a 145- and a 17-token generation, over 128).
  llama8b_tp2 the same at TP = 2, then c = 256 random 512 in / 256 out, output tok/s.
  llama8b_dp2 two TP = 1 replicas (one per GPU) behind one front end, c = 256 512/256.
  llama70b_tp2  Llama-3-70B shape, dummy bf16, TP = 2: batch-1 output tok/s and c = 64 512/256.
  (Batch-1 figures run the engine's default: since 2026-12-02 the on-device decode loop, 8 steps
  a call for <= 8 sequences, overlapped with the host's processing of the previous loop.)
  llama8b_tp1_*, llama8b_tp2_*  batch-1 variants (VARIANTS): single decode steps ("steps"),
              XLA's command buffers off ("nocb") or taking the collectives ("cmdbuf"), XLA's
              one-shot all-reduce kernel ("oneshot"), the decode loop asked for explicitly
              ("loop8"), the launcher thread ("async").
  llama8b_tp2_procs  batch-1 TPOT at TP = 2 with one process per GPU (jax.distributed on
              localhost, `--num-processes 2`): each process's host thread launches one GPU's work.
  moe_layouts the routed experts of the Qwen3-30B-A3B shape, decode (64 tokens) and prefill
              (2048), on one GPU and at TP = 2 in both expert layouts ("ep": experts split over
              the GPUs, "tp": inside every expert), the all-reduce included: µs per layer.
Every engine is built with the limits of its largest workload (a batch-1 decode therefore runs in
the 8-row decode bucket) and compiles lazily; each concurrency run is preceded by an untimed run
of other prompts of the same length with fewer output tokens, which compiles the shapes the timed
run meets without putting the timed prompts in the prefix cache (each throughput figure carries its
window's `_prefix_hit_rate`, 0 here, and `_buckets_compiling`).
"Ready" is weights loaded + the first batch-1 request served (its compiles included).
`--save DIR` writes DIR/multi_gpu_h200x2.json through `results_io` (`config.sections` keeps each
section's wall time and, when it failed, its stderr).

Timing on two H200s (2026-12-01): allreduce 11 s, parity 57 s, llama8b_tp1 41 s, llama8b_tp2
130 s (53 s batch-1 only), each batch-1 variant 45-75 s (traced), llama8b_dp2 118 s, llama70b_tp2
217 s. The whole list does not fit one 10-minute call: split it over calls.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.common import child
from jaxinfer.bench.common import timed_generate
from jaxinfer.bench.presets import LLAMA3_8B, LLAMA3_70B
from jaxinfer.bench.suites.multi_gpu_moe import section_moe_layouts
from jaxinfer.bench.timed_window import TimedWindow, fresh_prompts
from jaxinfer.bench.profile.trace_tp_step import TRACE_XLA_FLAGS
from jaxinfer.paths import REPO_ROOT


NAME = "multi_gpu_h200x2"
GRACE_S = 5  # past a section's time limit: its stack dump, then it is killed
REQUIRED = ("llama8b_tp1_bs1_tpot_ms", "llama8b_tp2_bs1_tpot_ms", "llama8b_tp2_c256_out_tok_s",
            "llama8b_dp2_c256_out_tok_s", "llama70b_tp2_bs1_out_tok_s", "llama70b_tp2_c64_out_tok_s")
ONE_GPU_C256_OUT_TOK_S = 8470.0  # bench_throughput on one H200, c = 256, bf16 (2026-11-30)
IN_LEN, OUT_LEN = 512, 256
BACKEND = os.environ.get("BENCH_BACKEND", "mosaic")  # `reference` smoke-tests the script on a CPU


# ---- sections (run inside a child process) ------------------------------------------------------
def section_allreduce(_: dict, name: str = "psum") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxinfer.parallel.sharding import build_mesh

    mesh = build_mesh(2)
    out = {}
    for label, nbytes in (("8kb", 8 << 10), ("2mb", 2 << 20)):
        n = nbytes // 2  # bf16

        def chain(x):
            for _ in range(64):  # each psum's input depends on the previous one's output
                x = jax.lax.psum(x, "tp") * jnp.bfloat16(0.5)
            return x

        f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp")))
        x = jax.device_put(jnp.ones((1, 2 * n), jnp.bfloat16),
                           jax.sharding.NamedSharding(mesh, P(None, "tp")))
        jax.block_until_ready(f(x))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t0)
        out[f"{name}_{label}_us"] = round(float(np.median(times)) / 64 * 1e6, 2)
    out["machine"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    return out


def section_allreduce_oneshot(cfg: dict) -> dict:
    """allreduce with XLA's one-shot all-reduce kernel for small messages on one host
    (SECTION_XLA_FLAGS): each GPU reads its peers' buffers over NVLink and sums, instead of NCCL."""
    return section_allreduce(cfg, "oneshot_psum")


def _llm(model: str, **kw):
    from jaxinfer import LLM
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", attention_backend=BACKEND, warmup=kw.pop("warmup", False),
              compilation_cache_dir=kw.pop("cache_dir"), **kw)
    return llm, time.perf_counter() - t0


def section_parity(cfg: dict) -> dict:
    from jaxinfer import SamplingParams
    text = (REPO_ROOT / "checkpoints" / "heldout_sample.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 24, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm, _ = _llm(str(REPO_ROOT / "checkpoints" / "demo-target"), tensor_parallel_size=tp,
                      max_num_seqs=8, max_num_batched_tokens=256, num_blocks=1024,
                      cache_dir=cfg["cache_dir"])
        tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
    return {"parity_tp2_identical_greedy": same, "parity_of": len(prompts)}


def _random_prompts(vocab: int, n: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, IN_LEN).tolist() for _ in range(n)]


def _batch1(llm, cfg: dict, label: str, figures) -> dict:
    """figures(batch-1 TPOT in ms, seconds of the first request with its compiles) -> the
    section's figures, printed at once (kept if what follows fails), then with the flat figures of
    a device trace of cfg["trace_steps"] decode steps (profile/trace_tp_step.py's summary; the whole
    of it in $OUT/trace_<label>.json)."""
    prompt = _random_prompts(llm.engine.cfg.vocab_size, 1)

    def run(n: int) -> float:
        return timed_generate(llm, prompt, n)

    first = run(17)
    short = min(run(17) for _ in range(2))
    long = min(run(145) for _ in range(2))
    out = figures(1e3 * (long - short) / 128, first)
    print(json.dumps(out), flush=True)
    return {**out, **_trace(lambda: run(cfg["trace_steps"]), cfg, label)}


def _trace(run, cfg: dict, label: str) -> dict:
    steps = cfg["trace_steps"]
    if not steps:
        return {}
    import jax

    from jaxinfer.bench.profile.trace_tp_step import print_summary, summarize
    trace_dir = Path(tempfile.mkdtemp(prefix=f"trace-{label}-"))
    with jax.profiler.trace(str(trace_dir)):
        run()
    summary = {"label": label, **summarize(str(trace_dir), steps)}
    out_dir = Path(os.environ.get("OUT", tempfile.gettempdir()))
    (out_dir / f"trace_{label}.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    flat = {}
    for _, d in sorted(summary["devices"].items())[:1]:  # the first GPU's timeline
        for key in ("period_us", "busy_us_per_step", "idle_us_per_step", "nccl_us_per_step"):
            if key in d:
                flat[f"{label}_trace_{key}"] = d[key]
    return flat


def _throughput(llm, concurrency: int, warm_out: int, label: str, in_len: int = IN_LEN,
                out_len: int = OUT_LEN) -> dict:
    """`{label}_out_tok_s`: output tok/s of `concurrency` random `in_len`-token prompts generating
    `out_len` tokens each, all submitted at once, after an untimed run of *other* prompts of the
    same length generating `warm_out` (it compiles the shapes the timed run meets and leaves
    nothing in the prefix cache that the timed prompts could hit); with the timed window's
    `{label}_prefix_hit_rate` (0 unless the engine reused something) and
    `{label}_buckets_compiling` (timed_window.py)."""
    from jaxinfer import SamplingParams
    vocab = llm.engine.cfg.vocab_size
    llm.generate(fresh_prompts(vocab, concurrency, in_len, seed=0),
                 SamplingParams(max_tokens=warm_out, ignore_eos=True, temperature=0), use_tqdm=False)
    prompts = fresh_prompts(vocab, concurrency, in_len, seed=1)
    window = TimedWindow(llm.engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=out_len, ignore_eos=True,
                                                temperature=0), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    return {f"{label}_out_tok_s": round(tok_s, 1), **window.figures(label)}


def _engine_kw(cfg: dict, seqs: int) -> dict:
    blocks = seqs * -(-(IN_LEN + OUT_LEN + 16) // 16) + 64
    return dict(load_format="dummy", max_num_seqs=seqs, max_num_batched_tokens=2048,
                max_model_len=1024, num_blocks=blocks, cache_dir=cfg["cache_dir"])


def section_llama8b_tp1(cfg: dict) -> dict:
    llm, load_s = _llm(cfg["llama8b"], tensor_parallel_size=1, **_engine_kw(cfg, 256))
    return _batch1(llm, cfg, "llama8b_tp1", lambda tpot, first: {
        "llama8b_tp1_bs1_tpot_ms": round(tpot, 3), "llama8b_tp1_ready_s": round(load_s + first, 1)})


def section_llama8b_tp2(cfg: dict, prefix: str = "llama8b_tp2", **engine) -> dict:
    llm, load_s = _llm(cfg["llama8b"], tensor_parallel_size=2, **_engine_kw(cfg, 256), **engine)
    out = _batch1(llm, cfg, prefix, lambda tpot, first: {
        f"{prefix}_bs1_tpot_ms": round(tpot, 3), f"{prefix}_ready_s": round(load_s + first, 1),
        f"{prefix}_load_s": round(load_s, 1)})
    print(json.dumps(out), flush=True)  # kept if the throughput run times out
    if cfg["throughput"]:
        out.update(_throughput(llm, 256, 64, f"{prefix}_c256"))
    return out


# Batch-1 variants of llama8b_tp1/tp2: name -> (TP, engine keywords, XLA flags its process adds).
NO_CMDBUF = "--xla_gpu_enable_command_buffer="
ONESHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
VARIANTS = {"llama8b_tp1_steps": (1, {"decode_steps_per_call": 1}, ""),
            "llama8b_tp2_steps": (2, {"decode_steps_per_call": 1}, ""),
            "llama8b_tp2_cmdbuf": (2, {}, "--xla_gpu_enable_command_buffer=+COLLECTIVES"),
            "llama8b_tp2_oneshot": (2, {}, ONESHOT),
            "llama8b_tp2_loop8": (2, {"decode_steps_per_call": 8}, ""),
            "llama8b_tp2_cmdbuf_loop8": (2, {"decode_steps_per_call": 8},
                                         "--xla_gpu_enable_command_buffer=+COLLECTIVES"),
            "llama8b_tp1_nocb": (1, {}, NO_CMDBUF),
            "llama8b_tp2_nocb": (2, {}, NO_CMDBUF),
            "llama8b_tp2_nocb_async": (2, {"async_launch": True}, NO_CMDBUF),
            "llama8b_tp2_nocb_oneshot": (2, {}, f"{NO_CMDBUF} {ONESHOT}"),
            "llama8b_tp2_loop8_nocb": (2, {"decode_steps_per_call": 8}, NO_CMDBUF)}


def section_variant(cfg: dict, name: str) -> dict:
    """A batch-1 variant (VARIANTS): XLA's command buffers (CUDA graphs) off or taking the
    collectives, XLA's one-shot all-reduce kernel, the on-device decode loop (8 steps per dispatch),
    the launcher thread."""
    tp, engine, _ = VARIANTS[name]
    llm, load_s = _llm(cfg["llama8b"], tensor_parallel_size=tp, **_engine_kw(cfg, 256), **engine)
    return _batch1(llm, cfg, name, lambda tpot, first: {
        f"{name}_bs1_tpot_ms": round(tpot, 3), f"{name}_ready_s": round(load_s + first, 1)})


def section_llama8b_tp2_proc(cfg: dict) -> dict:
    """One process of llama8b_tp2_procs: TP = 2 over two processes (jax.distributed on
    localhost), this one driving the GPU its CUDA_VISIBLE_DEVICES names."""
    pid = cfg["process_id"]
    llm, load_s = _llm(cfg["llama8b"], tensor_parallel_size=2, **_engine_kw(cfg, 256),
                       coordinator_address=f"127.0.0.1:{cfg['port']}", num_processes=2,
                       process_id=pid)
    out = _batch1(llm, {**cfg, "trace_steps": 0}, "llama8b_tp2_procs", lambda tpot, first: {
        "llama8b_tp2_procs_bs1_tpot_ms": round(tpot, 3),
        "llama8b_tp2_procs_ready_s": round(load_s + first, 1)})
    return out if pid == 0 else {}


def section_llama8b_tp2_procs(cfg: dict) -> dict:
    """TP = 2 with one process per GPU (`--num-processes 2`, the multi-host path on one host): each
    host thread launches one device's kernels, where one process launches both (issue 21's batch-1
    question: the TP = 2 step is bound by the host's launches). Both processes run the same
    requests (replicated scheduling); process 0 reports."""
    import socket
    import subprocess
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for pid in range(2):
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        if env.get("JAX_PLATFORMS", "").startswith("cpu"):  # one CPU device per process
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(pid)
        argv = [sys.executable, "-m", __spec__.name, "--run-section", "llama8b_tp2_proc", "--config",
                json.dumps({**cfg, "process_id": pid, "port": port})]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=REPO_ROOT, env=env))
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a TP process failed (rc {p.returncode}):\n{err[-3000:]}")
    return _last_json(outs[0][0])


def section_llama8b_dp2(cfg: dict) -> dict:
    llm, load_s = _llm(cfg["llama8b"], data_parallel_size=2, **_engine_kw(cfg, 256))
    return {**_throughput(llm, 256, 64, "llama8b_dp2_c256"), "llama8b_dp2_load_s": round(load_s, 1)}


def section_llama70b_tp2(cfg: dict) -> dict:
    llm, load_s = _llm(cfg["llama70b"], tensor_parallel_size=2, **_engine_kw(cfg, 64))
    out = _batch1(llm, cfg, "llama70b_tp2", lambda tpot, first: {
        "llama70b_tp2_bs1_out_tok_s": round(1e3 / tpot, 2), "llama70b_tp2_bs1_tpot_ms": round(tpot, 3),
        "llama70b_tp2_ready_s": round(load_s + first, 1), "llama70b_tp2_load_s": round(load_s, 1)})
    print(json.dumps(out), flush=True)
    if cfg["throughput"]:
        out.update(_throughput(llm, 64, 24, "llama70b_tp2_c64"))
    return out


SECTIONS = {"allreduce": (section_allreduce, 60),
            "allreduce_oneshot": (section_allreduce_oneshot, 60), "parity": (section_parity, 90),
            "llama8b_tp1": (section_llama8b_tp1, 90), "llama8b_tp2": (section_llama8b_tp2, 200),
            "llama8b_dp2": (section_llama8b_dp2, 200), "llama70b_tp2": (section_llama70b_tp2, 400),
            "moe_layouts": (section_moe_layouts, 120),
            "llama8b_tp2_procs": (section_llama8b_tp2_procs, 150),
            "llama8b_tp2_proc": (section_llama8b_tp2_proc, 150),  # (one of llama8b_tp2_procs')
            **{name: (functools.partial(section_variant, name=name), 120) for name in VARIANTS}}
# Environment of a section's process beyond the driver's.
# XLA flags a section's process adds to $XLA_FLAGS.
SECTION_XLA_FLAGS = {"allreduce_oneshot": ONESHOT,
                     **{name: flags for name, (_, _, flags) in VARIANTS.items() if flags}}


# ---- the driver -------------------------------------------------------------------------------
def _last_json(text: str) -> dict:
    merged: dict = {}
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                merged.update(json.loads(line))
            except json.JSONDecodeError:
                pass
    return merged


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--deadline-s", type=float, default=400.0)
    ap.add_argument("--limits", default="",
                    help="per-section time limits overriding the defaults: name=seconds,...")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="after each batch-1 TPOT, trace this many decode steps and summarise the "
                         "device and host timelines (jaxinfer/bench/profile/trace_tp_step.py)")
    ap.add_argument("--batch1-only", action="store_true",
                    help="skip the concurrency runs of llama8b_tp2 and llama70b_tp2")
    ap.add_argument("--run-section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, NAME)
    args = ap.parse_args(argv)
    if args.run_section:
        fn = SECTIONS[args.run_section][0]
        print(json.dumps(fn(json.loads(args.config))), flush=True)
        return

    start = time.perf_counter()
    limits = {name: float(sec) for name, sec in
              (item.split("=") for item in args.limits.split(",") if item)}
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-mgpu-"))
    cfg = {"cache_dir": str(work / "cc"), "throughput": not args.batch1_only,
           "trace_steps": args.trace_steps}
    shapes = (("llama8b", LLAMA3_8B), ("llama70b", LLAMA3_70B))
    if os.environ.get("BENCH_TINY_SHAPES"):  # a CPU smoke run of the script (BENCH_BACKEND=reference)
        shapes = tuple((name, {**shape, "hidden_size": 256, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024})
                       for name, shape in shapes)
    for name, shape in shapes:
        (work / name).mkdir()
        (work / name / "config.json").write_text(json.dumps(shape))
        cfg[name] = str(work / name)
    # jax is not imported here (results_io.machine() would start a backend): the sections'
    # processes own the GPUs and report the machine.
    config = {"input_len": IN_LEN, "output_len": OUT_LEN, "dtype": "bfloat16", "weights": "dummy",
              "attention_backend": BACKEND, "max_num_batched_tokens": 2048,
              "jax": importlib.metadata.version("jax"),
              "one_gpu_c256_reference_out_tok_s": ONE_GPU_C256_OUT_TOK_S, "sections": {}}
    metrics: dict = {}
    machine = results_io.machine()
    base_flags = os.environ.get("XLA_FLAGS", "")
    for name in args.sections.split(","):
        limit = limits.get(name, SECTIONS[name][1])
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 30:
            config["sections"][name] = "skipped: call deadline"
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", __spec__.name, "--run-section", name, "--config", json.dumps(cfg)]
        flags = [base_flags, SECTION_XLA_FLAGS.get(name, "")]
        flags += [TRACE_XLA_FLAGS] if args.trace_steps else []  # traced as it runs untraced
        os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)
        stdout, stderr, rc = child(cmd, min(limit, left), grace_s=GRACE_S)
        entry_flags = os.environ["XLA_FLAGS"]
        os.environ["XLA_FLAGS"] = base_flags
        got = _last_json(stdout)
        if "machine" in got:
            machine["device"] = got.pop("machine")
        metrics.update(got)
        entry = {"wall_s": round(time.perf_counter() - t0, 1), "rc": rc, "xla_flags": entry_flags}
        if rc != 0:
            entry["stderr_tail"] = stderr[-2500:]
        config["sections"][name] = entry
        print(f"== {name}: {json.dumps(got)} {json.dumps(entry)[:2500]}", flush=True)
        for line in stdout.splitlines()[-60:]:  # what the section printed besides its figures
            if not line.startswith("{"):
                print(f"   | {line}", flush=True)
        _derive(metrics)
        for key in REQUIRED:  # a figure a section did not reach stays visible, as null
            metrics.setdefault(key, None)
        if args.save:  # after every section: a later one's timeout keeps the earlier figures
            results_io.save(args.save, args.name or NAME, config=config, metrics=metrics,
                            machine_info=machine)
    print_table(metrics)


def _derive(m: dict) -> None:
    if m.get("llama8b_tp1_bs1_tpot_ms") and m.get("llama8b_tp2_bs1_tpot_ms"):
        m["llama8b_tp2_over_tp1_tpot"] = round(m["llama8b_tp2_bs1_tpot_ms"]
                                               / m["llama8b_tp1_bs1_tpot_ms"], 3)
    if m.get("llama8b_dp2_c256_out_tok_s"):
        m["llama8b_dp2_over_one_gpu"] = round(m["llama8b_dp2_c256_out_tok_s"]
                                              / ONE_GPU_C256_OUT_TOK_S, 3)
    if "psum_8kb_us" in m:  # what XLA's all-reduce alone adds to a 32-layer batch-1 step
        m["psum_8kb_x64_per_step_ms"] = round(64 * m["psum_8kb_us"] / 1e3, 3)
    for size in ("8kb", "2mb"):
        if m.get(f"psum_{size}_us") and m.get(f"oneshot_psum_{size}_us"):
            m[f"oneshot_over_psum_{size}"] = round(m[f"oneshot_psum_{size}_us"]
                                                   / m[f"psum_{size}_us"], 3)


def print_table(m: dict) -> None:
    print("\nmetric | value")
    for k, v in m.items():
        print(f"{k} | {v}")


if __name__ == "__main__":
    main()
