"""The disaggregation checks that need two devices, run in one subprocess of tests/test_disagg.py
with 2 CPU devices (jax fixes its device count when it starts). Prints one JSON object: per check,
the values the test compares.

    python tests/disagg_checks.py
"""

import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from cpu_devices import start_jax  # noqa: E402

jax = start_jax(2)

import numpy as np  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.frontends.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.errors import ConfigError  # noqa: E402

MODEL = str(HERE / "fixtures" / "models" / "llama")
# A small pool (24 blocks of 4 = 96 tokens) under 4 sequences of up to 64 tokens: both sides
# preempt. Prompts share a 24-token prefix: prefix-cache hits on the prefill side, and blocks the
# decode side already holds are not moved.
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, long_prefill_chunk=16,
              num_blocks=24, block_size=4, max_model_len=64, warmup=False,
              compilation_cache_dir=None)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 380, 24).tolist()
    prompts = [prefix + rng.integers(0, 380, int(k)).tolist() for k in (1, 5, 9, 3, 7, 2, 6, 4)]
    prompts += [[7], rng.integers(0, 380, 13).tolist()]  # a one-token prompt; no shared prefix
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    params = [greedy] * len(prompts)
    # Long distinct prompts, chunked, that fill the prefill pool part-way through: it preempts.
    prompts += [rng.integers(0, 380, 42).tolist() for _ in range(3)]
    params += [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 3
    params[3] = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # ends on prefill
    params[5] = SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True, logprobs=2)
    return prompts, params


def kv_state(engine) -> dict:
    kv = engine.scheduler.kv
    return {"requests": kv.request_ids(), "used_blocks": kv.pool.num_used_blocks,
            "cached_blocks": kv.num_cached_blocks}


def drive(engine, prompts, params, aborts: dict[str, str]) -> tuple[dict, dict]:
    """Add the first 3 requests, step, then the rest; abort the requests of `aborts` at their stage
    ("waiting": right after being added; "transfer": while their KV is between the engines;
    "decode": after 3 decode-side tokens). Returns each request's tokens and finish reason."""
    tokens, finish, where = {}, {}, {}
    stage = {rid: s for rid, s in aborts.items()}

    def collect(outs):
        for out in outs:
            if out.outputs:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
                if out.outputs[0].finish_reason:
                    finish[out.request_id] = out.outputs[0].finish_reason

    def add(i):
        rid = f"r{i}"
        engine.add_request(rid, prompts[i], params[i])
        if stage.get(rid) == "waiting":
            collect([engine.abort(rid)])
            where[rid] = "waiting"

    for i in range(3):
        add(i)
    steps = 0
    while engine.has_unfinished_requests():
        collect(engine.step())
        steps += 1
        if steps > 3000:
            raise RuntimeError(f"no progress after {steps} steps: {engine.requests}")
        if steps == 2:
            for i in range(3, len(prompts)):
                add(i)
        for rid, s in stage.items():
            if rid in finish or rid in where:
                continue
            transit = getattr(engine, "_transit", {})
            if (s == "transfer" and rid in transit) or (
                    s == "decode" and rid in getattr(engine, "decode", engine).requests
                    and len(tokens.get(rid, [])) >= 4):
                collect([engine.abort(rid)])
                where[rid] = s
    return {"tokens": tokens, "finish": finish, "aborted_at": where}


def parity_checks(out: dict) -> None:
    prompts, params = workload()
    colocated = LLM(MODEL, **ENGINE)
    out["colocated"] = drive(colocated.engine, prompts, params, {})
    out["colocated_kv"] = kv_state(colocated.engine)
    llm = LLM(MODEL, **ENGINE, disaggregate=True)
    engine = llm.engine
    aborts = {"r6": "waiting", "r7": "transfer", "r2": "decode"}
    out["disagg"] = drive(engine, prompts, params, aborts)
    out["prefill_kv"] = kv_state(engine.prefill)
    out["decode_kv"] = kv_state(engine.decode)
    out["transit"] = list(engine._transit)
    out["devices"] = [sorted(d.id for d in e.runner.plan.mesh.devices.flat)
                      for e in (engine.prefill, engine.decode)]
    out["preemptions"] = [e.scheduler.num_preemptions for e in (engine.prefill, engine.decode)]
    out["prefix_hits"] = engine.prefill.scheduler.kv.stats.hits
    out["driver"] = engine.driver.per_step_ms()
    text = generate_latest(engine.metrics.registry).decode()
    out["metrics"] = [line for line in text.splitlines()
                      if line.startswith(("jaxinfer:kv_transfer", "jaxinfer:queue_depth",
                                          "jaxinfer:generation_tokens_total",
                                          "jaxinfer:request_success_total"))]
    # The server's path: AsyncEngine around the disaggregated engine, one request to the end and
    # one cancelled mid-stream (a client disconnect).
    out["async"] = asyncio.run(_through_async_engine(engine, prompts[0], params[0]))
    out["after_async_kv"] = [kv_state(engine.prefill), kv_state(engine.decode)]
    # n = 2: the prompt computed once on the prefill devices, each choice handed over.
    n2 = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)
    out["n2"] = {name: [c.token_ids for c in e.generate([prompts[1]], n2, use_tqdm=False)[0].outputs]
                 for name, e in (("colocated", colocated), ("disagg", llm))}
    out["after_n2_kv"] = [kv_state(engine.prefill), kv_state(engine.decode)]


async def _through_async_engine(engine, prompt, params) -> dict:
    async_engine = AsyncEngine(engine=engine)
    await async_engine.start()
    tokens = []
    async for o in async_engine.generate(prompt, params, "async-0"):
        tokens = o.outputs[0].token_ids
    got = 0
    async for o in async_engine.generate(prompt, params, "async-1"):
        got = len(o.outputs[0].token_ids)
        if got >= 3:
            break  # leaving the generator aborts the request, as a disconnect does
    await asyncio.sleep(0.2)
    await async_engine.shutdown()
    return {"tokens": tokens, "cancelled_after": got}


def server_checks(out: dict) -> None:
    """`jaxinfer serve`'s app over a disaggregated engine: a completion, a stream the client drops
    after two chunks (its blocks freed on both sides), the transfer metrics on /metrics."""
    from jaxinfer.engine.args import EngineArgs
    from server_harness import ServerThread, make_tiny_model_dir, server_args

    def post(url: str, body: dict):
        return urllib.request.urlopen(urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}), timeout=120)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model_dir(model_dir)
        engine_args = EngineArgs(model=str(model_dir), served_model_name="tiny", dtype="float32",
                                 max_model_len=128, block_size=16, num_blocks=64, max_num_seqs=4,
                                 max_num_batched_tokens=64, compilation_cache_dir="",
                                 attention_backend="reference", warmup=False, disaggregate=True)
        st = ServerThread(engine_args, {"main": server_args()}).start()
        try:
            url = st.urls["main"] + "/v1/completions"
            req = {"model": "tiny", "prompt": "Hello world, once upon a time", "temperature": 0,
                   "ignore_eos": True, "max_tokens": 12}
            reply = json.loads(post(url, req).read())
            out["server_completion"] = [reply["usage"]["completion_tokens"],
                                        reply["choices"][0]["finish_reason"]]
            stream = post(url, {**req, "max_tokens": 100, "stream": True})
            chunks = 0
            while chunks < 2:
                chunks += stream.readline().startswith(b"data: ")
            stream.close()  # the client goes away mid-stream

            async def pools():
                e = st.engine.engine
                return [e.prefill.scheduler.kv.request_ids(), e.decode.scheduler.kv.request_ids(),
                        list(e._transit)]
            deadline = time.monotonic() + 30
            while any(st.call(pools())) and time.monotonic() < deadline:
                time.sleep(0.2)
            out["server_pools_after_disconnect"] = st.call(pools())
            text = urllib.request.urlopen(st.urls["main"] + "/metrics", timeout=30).read().decode()
            out["server_metrics"] = [line for line in text.splitlines()
                                     if line.startswith(("jaxinfer:kv_transfers_total",
                                                         "jaxinfer:request_success_total"))]
        finally:
            st.stop()


def refusal_checks(out: dict) -> None:
    refusals = {}
    for name, extra in {"dp2": dict(data_parallel_size=2), "tp2": dict(tensor_parallel_size=2),
                        "overlap": dict(prefill_devices="0", decode_devices="0"),
                        "too_many": dict(decode_tensor_parallel_size=2),
                        "prefill_tp3": dict(prefill_tensor_parallel_size=3),
                        "role_without": dict(disaggregate=False, decode_devices="1")}.items():
        kw = {**ENGINE, "disaggregate": True, **extra}
        try:
            LLM(MODEL, **kw)
            refusals[name] = None
        except ConfigError as e:
            refusals[name] = str(e)
    out["refusals"] = refusals


def page_kind_checks(out: dict) -> None:
    """DeepSeek-V2's latent pages (K only) and Gemma 2's windowed layers (one KV group once
    disaggregated): greedy tokens handed over = colocated."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 380, int(k)).tolist() for k in (21, 6, 13)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = {**ENGINE, "num_blocks": 64}  # (Gemma 2 colocated: two groups' blocks)
    for family in ("deepseek_v2", "gemma2"):
        model = str(HERE / "fixtures" / "models" / family)
        got = [[o.outputs[0].token_ids for o in LLM(model, **engine, **extra).generate(
            prompts, greedy, use_tqdm=False)]
            for extra in ({}, {"disaggregate": True})]
        out[f"page_kind_{family}"] = got


def main() -> None:
    out: dict = {"devices": jax.device_count()}
    parity_checks(out)
    page_kind_checks(out)
    server_checks(out)
    refusal_checks(out)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
