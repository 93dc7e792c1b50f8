"""The tensor/data-parallel checks that need several devices, run in subprocesses of
tests/test_parallel.py with 8 CPU devices (jax fixes its device count when it starts, and the rest
of the suite runs on one), a few checks each (its PARTS). Prints one JSON object: per check, the
values the test compares.

    python tests/parallel_checks.py [CHECK ...]
"""

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cpu_devices import start_jax  # noqa: E402

jax = start_jax(8)

import asyncio  # noqa: E402
import dataclasses  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from prometheus_client import generate_latest  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.frontends.async_engine import AsyncEngine  # noqa: E402
from jaxinfer.worker.kv.device_cache import allocate_kv_cache  # noqa: E402
from jaxinfer.core.kv_cache import KVCacheGroups  # noqa: E402
from jaxinfer.errors import ConfigError  # noqa: E402
from jaxinfer.model.config import load_config  # noqa: E402
from lora_parallel_checks import lora_checks  # noqa: E402
from hybrid_parallel_checks import hybrid_checks  # noqa: E402
from jaxinfer.model.transformer import forward, init_params, param_shapes  # noqa: E402
from jaxinfer.model.weights import load_params, save_orbax  # noqa: E402
from jaxinfer.parallel.kernels import shard_kernels  # noqa: E402
from jaxinfer.parallel.sharding import ShardingPlan, build_mesh, per_device_bytes  # noqa: E402
from jaxinfer.worker.activation_bytes import step_activation_bytes  # noqa: E402
from jaxinfer.model.kernel_table import REFERENCE_KERNELS  # noqa: E402
from pallas_kernels.attention.metadata import AttentionMetadata  # noqa: E402

FIXTURES = HERE / "fixtures" / "models"
# One fixture per family (the *_fused ones are the same models in another file layout); mistral's
# and qwen3's layers are llama's and qwen3_moe's parts (their rope and head_dim are no sharding's
# concern), so they are not run apart.
FAMILIES = ["llama", "qwen2", "mixtral", "qwen3_moe"]
MOE_FAMILIES = ["mixtral", "qwen3_moe"]
# Windowed families (sinks sharded by head, gpt-oss's expert biases split with their stacks).
WINDOWED = ["gemma2", "gemma3", "gpt_oss"]
# (TP size, expert layout, the families checked so): see model_checks.
# MLA families (one latent KV head: every device keeps the whole latent cache).
MLA = ["deepseek_v2", "deepseek_v3"]
# TP sizes over the fixtures' 2 KV heads (KV heads replicated) are the widened models' TP = 8.
MODEL_LAYOUTS = [(2, "tp", FAMILIES + WINDOWED + ["deepseek_v3"]),
                 (2, "ep", ["qwen3_moe", "gpt_oss", "deepseek_v2"]), (4, "ep", ["mixtral"])]
WIDE_FAMILIES = ["llama", "qwen2", "qwen3_moe"]
BLOCK, NUM_BLOCKS, STEPS = 4, 16, 8
_step = jax.jit(forward, static_argnames=("cfg", "kernels"))


def greedy(cfg, params, plan, prompt, steps: int) -> tuple[list[int], np.ndarray]:
    """Prefill `prompt` through a shuffled block table, then decode `steps` - 1 tokens one at a time;
    returns the tokens and the prefill's last logits. Every call has the prefill's shapes (a decode
    is one token padded to the prompt's length), so each model and mesh compiles once."""
    kernels = shard_kernels(REFERENCE_KERNELS, plan)
    # Windowed models in the KV manager's layout: a table per KV group, layers of different
    # groups sharing cache arrays at disjoint blocks (jaxinfer/core/kv_cache/kv_groups.py).
    groups = KVCacheGroups.for_model(cfg)
    cache = allocate_kv_cache(cfg, NUM_BLOCKS, BLOCK, jnp.float32, num_heads=plan.stored_kv_heads,
                              sharding=plan.kv_cache, num_slots=groups.num_slots)
    n, total = len(prompt), len(prompt) + steps
    nb = -(-total // BLOCK)
    table = np.random.default_rng(n).permutation(NUM_BLOCKS)[:groups.num_groups * nb]
    table = table.reshape(groups.num_groups, nb)
    slots = (table[:, np.arange(total) // BLOCK] * BLOCK + np.arange(total) % BLOCK).astype(np.int32)
    tables = jnp.asarray(table[:, None], jnp.int32)
    if groups.kv_layout is None:
        slots, tables = slots[0], tables[0]

    def run(ids, first_pos, count):
        pad = n - count
        md = AttentionMetadata(np.concatenate([slots[..., first_pos:first_pos + count],
                                               np.full(slots.shape[:-1] + (pad,), -1)], axis=-1),
                               jnp.array([0, count], jnp.int32),
                               jnp.array([first_pos + count], jnp.int32), tables,
                               kv_layout=groups.kv_layout)
        positions = np.concatenate([np.arange(first_pos, first_pos + count), np.zeros(pad, int)])
        return _step(params, cfg, jnp.asarray(np.concatenate([ids, np.zeros(pad, int)]), jnp.int32),
                     jnp.asarray(positions, jnp.int32), cache, md, kernels,
                     jnp.array([count - 1]))

    logits, cache = run(np.asarray(prompt), 0, n)
    first = np.asarray(logits[0])
    tokens = [int(first.argmax())]
    for pos in range(n, total - 1):
        logits, cache = run(np.array([tokens[-1]]), pos, 1)
        tokens.append(int(np.asarray(logits[0]).argmax()))
    return tokens, first


def model_checks(out: dict) -> None:
    """Greedy tokens, weights loaded straight into their shards (TP = 1's are the fixtures' golden
    tokens, which tests/test_hf_parity.py checks): TP = 2 on every family (the windowed Gemma 2/3
    and gpt-oss too; not mistral and qwen3, see FAMILIES); the MoE families with experts split
    over the devices (expert layout "ep") at 2 and 4 devices (gpt-oss at 2). TP = 1 and 8 on
    llama, qwen2 and qwen3_moe widened to 8 query heads (random weights generated sharded): TP = 8
    > their 2 KV heads (replicated KV), on the families whose parameters hold every kind a dense
    or MoE layer has (qwen2: biases, tied embeddings; qwen3_moe: q/k norms, experts, a dense
    layer)."""
    for fam in FAMILIES + WINDOWED + MLA:
        cfg = load_config(FIXTURES / fam)
        prompt = np.load(FIXTURES / fam / "golden.npz")["greedy_prompt"]
        layouts = [(tp, layout) for tp, layout, families in MODEL_LAYOUTS if fam in families]
        for tp, layout in layouts:
            plan = ShardingPlan(build_mesh(tp), cfg, layout)
            params = load_params(FIXTURES / fam, cfg, jnp.float32, progress=False,
                                 shardings=plan.params(param_shapes(cfg, jnp.float32)))
            tokens, logits = greedy(cfg, params, plan, prompt, STEPS)
            key = f"{fam}/tp{tp}" + ("-ep" if layout == "ep" else "")
            out[key] = {"tokens": tokens, "logits": logits.tolist()}
        if fam not in WIDE_FAMILIES:
            continue
        wide = dataclasses.replace(cfg, num_heads=8)
        for tp in (1, 8):
            plan = ShardingPlan(build_mesh(tp), wide)
            params = init_params(wide, jax.random.key(1), jnp.float32, std=0.1,
                                 shardings=plan.params(param_shapes(wide, jnp.float32)))
            tokens, logits = greedy(wide, params, plan, prompt, STEPS)
            out[f"{fam}-wide/tp{tp}"] = {"tokens": tokens, "logits": logits.tolist()}


def shard_checks(out: dict) -> None:
    """Each device holds exactly its slice: safetensors and orbax loads onto a TP = 4 mesh against
    the single-device load, and the cache/param specs the plan gives."""
    cfg = load_config(FIXTURES / "qwen3_moe")
    plan = ShardingPlan(build_mesh(4), cfg, "tp")
    shardings = plan.params(param_shapes(cfg, jnp.float32))
    whole = load_params(FIXTURES / "qwen3_moe", cfg, jnp.float32, progress=False)
    sharded = load_params(FIXTURES / "qwen3_moe", cfg, jnp.float32, progress=False,
                          shardings=shardings)
    with tempfile.TemporaryDirectory() as tmp:
        save_orbax(whole, tmp)
        restored = load_params(tmp, cfg, jnp.float32, load_format="orbax", shardings=shardings)
    mismatches, split = [], 0
    for name, tree in (("safetensors", sharded), ("orbax", restored)):
        for (path, ref), leaf in zip(jax.tree_util.tree_leaves_with_path(whole),
                                     jax.tree_util.tree_leaves(tree)):
            ref = np.asarray(ref)
            split += leaf.addressable_shards[0].data.size < ref.size
            for shard in leaf.addressable_shards:
                if not np.array_equal(np.asarray(shard.data), ref[shard.index]):
                    mismatches.append(f"{name} {jax.tree_util.keystr(path)} on {shard.device}")
    # The memory planner's per-device inputs: this device's weight bytes, the step's activations.
    llama = load_config(FIXTURES / "llama")
    planned = {}
    for tp in (1, 2):
        plan2 = ShardingPlan(build_mesh(tp), llama)
        weights = load_params(FIXTURES / "llama", llama, jnp.float32, progress=False,
                              shardings=plan2.params(param_shapes(llama, jnp.float32)))
        planned[tp] = [per_device_bytes(weights), step_activation_bytes(
            llama, weights, REFERENCE_KERNELS, kv_dtype=jnp.float32, block_size=BLOCK, max_model_len=64,
            max_num_seqs=8, max_num_batched_tokens=64, plan=plan2)]
    out["planner"] = planned
    out["shards"] = {"mismatches": mismatches, "split_leaves": split,
                     "k_proj": str(shardings["layers_0"]["attn"]["k_proj"]["kernel"].spec),
                     "w_down": str(shardings["layers_0"]["moe"]["w_down"].spec),
                     "w_down_ep": str(ShardingPlan(plan.mesh, cfg, "ep").param(
                         ("layers_0", "moe", "w_down"), (8, 24, 64)).spec),
                     "stored_kv_heads": plan.stored_kv_heads}


def engine_checks(out: dict) -> None:
    """LLM(...) end to end: TP = 1 vs DP = 2 x TP = 2 (mixtral: MoE, a request of each prompt,
    greedy; each replica is the TP = 2 engine, on a sub-mesh: DP = 2 at TP = 1 is the same
    replica code over sub-meshes of one device, not run apart), and the flags' refusals."""
    golden = np.load(FIXTURES / "mixtral" / "golden.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)] + [golden["greedy_prompt"].tolist()]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    # No decode loop: its compile under TP is the costliest here, and tokens are the same with
    # it (tests/test_decode_loop.py); sampler_layout_checks compiles it at TP = 2.
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64,
              block_size=4, warmup=False, compilation_cache_dir=None, decode_steps_per_call=1)
    for tp, dp in ((1, 1), (2, 2)):
        llm = LLM(str(FIXTURES / "mixtral"), tensor_parallel_size=tp, data_parallel_size=dp, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        entry = {"tokens": [o.outputs[0].token_ids for o in outs]}
        if dp > 1:  # each replica served some of the requests, on its own devices
            entry["per_replica"] = [r.metrics.generation_tokens._value.get()
                                    for r in llm.engine.replicas]
            entry["devices"] = [sorted(d.id for d in r.runner.plan.mesh.devices.flat)
                                for r in llm.engine.replicas]
            entry["merged_metrics"] = [line for line in generate_latest(
                llm.engine.metrics.registry).decode().splitlines()
                if line.startswith("jaxinfer:generation_tokens_total")]
            entry["async_tokens"] = asyncio.run(_through_async_engine(llm.engine, prompts[3],
                                                                      params))
            # update_weights reaches every replica (the same weights, from the host: same tokens)
            llm.update_weights(jax.tree.map(np.asarray, llm.engine.replicas[0].runner.params))
            again = llm.generate(prompts[:2], params, use_tqdm=False)
            entry["after_update"] = [[o.outputs[0].token_ids for o in again],
                                     [o.weight_version for o in again],
                                     [r.weight_version for r in llm.engine.replicas]]
        out[f"engine/tp{tp}dp{dp}"] = entry
    llama = load_config(FIXTURES / "llama")
    llama_tp1_checks(out)
    lg = np.load(FIXTURES / "llama" / "golden.npz")
    # An fp8 cache under TP = 2 (each device quantizes and reads its own KV heads with the
    # layer's scales) against one device.
    out["llama/fp8"] = {tp: [o.outputs[0].token_ids for o in LLM(
        str(FIXTURES / "llama"), tensor_parallel_size=tp, kv_cache_dtype="fp8", **kw).generate(
            [lg["greedy_prompt"].tolist(), lg["prompt_1"].tolist()], params, use_tqdm=False)]
        for tp in (1, 2)}
    refusals = {}
    for name, extra in {"tp3": dict(tensor_parallel_size=3), "tp16": dict(tensor_parallel_size=16),
                        "dp3tp4": dict(tensor_parallel_size=4, data_parallel_size=3),
                        "tp0": dict(tensor_parallel_size=0)}.items():
        try:
            LLM(str(FIXTURES / "llama"), **kw, **extra)
            refusals[name] = None
        except ConfigError as e:
            refusals[name] = str(e)
    out["refusals"] = refusals
    out["llama_heads"] = [llama.num_heads, llama.num_kv_heads]


def llama_tp1_checks(out: dict) -> None:
    """The single-device reference of the TP = 2 runs on the llama fixture (two processes, the
    sampler layouts, speculation): its prompts' greedy tokens through LLM(...) on one device."""
    lg = np.load(FIXTURES / "llama" / "golden.npz")
    outs = LLM(str(FIXTURES / "llama"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
               num_blocks=64, block_size=4, warmup=False, compilation_cache_dir=None,
               decode_steps_per_call=1).generate(
        [lg["greedy_prompt"].tolist(), lg["prompt_1"].tolist()],
        SamplingParams(max_tokens=len(lg["greedy_tokens"]), temperature=0, ignore_eos=True),
        use_tqdm=False)
    out["llama/engine_tp1"] = [o.outputs[0].token_ids for o in outs]


async def _through_async_engine(engine, prompt, params) -> list[int]:
    """One request through the server's AsyncEngine wrapped around the data-parallel engine."""
    async_engine = AsyncEngine(engine=engine)
    await async_engine.start()
    tokens = []
    async for out in async_engine.generate(prompt, params, "async-0"):
        tokens = out.outputs[0].token_ids
    await async_engine.shutdown()
    return tokens


def executable_cache_checks(out: dict) -> None:
    """DP = 2 x TP = 2 with warm-up and an executable cache, started twice: the second start loads
    every step (replica 2's onto its own sub-mesh, devices 2-3) and decodes the same tokens. No
    decode loop (its TP compile is the costliest step; the loop's own caching is
    tests/test_executable_cache.py's). Run without jax's persistent cache (test_parallel.py's
    cache_lora part): the executable cache stores nothing while that is on."""
    lg = np.load(FIXTURES / "llama" / "golden.npz")
    prompts = [lg["greedy_prompt"].tolist(), lg["prompt_1"].tolist()]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as cache_dir:
        for start in ("cold", "warm"):
            llm = LLM(str(FIXTURES / "llama"), tensor_parallel_size=2, data_parallel_size=2,
                      dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64,
                      block_size=4, compilation_cache_dir=cache_dir, decode_steps_per_call=1)
            outs = llm.generate(prompts, params, use_tqdm=False)
            for r in llm.engine.replicas:  # (buckets may compile in the background)
                r.runner.compiler.wait()
            caches = [r.runner.executable_cache for r in llm.engine.replicas]
            out[f"exe_cache/{start}"] = {"tokens": [o.outputs[0].token_ids for o in outs],
                                         "hits": [c.hits for c in caches],
                                         "misses": [c.misses for c in caches]}


def sampler_layout_checks(out: dict) -> None:
    """The TP = 2 engine's compiled steps, per sampler layout (parallel/sampling_logits.py: rows
    gathered whole, or split over tp, forced here by a zero gather limit): the collectives inside
    a conditional or while loop of each sampler, decode forward and decode loop; and the greedy
    tokens of the prompts of "llama/engine_tp1"."""
    from jaxinfer.parallel import sampling_logits
    from jaxinfer.bench.profile.hlo_collectives import collectives_in_control_flow
    from jaxinfer.worker.programs import shared_jit
    lg = np.load(FIXTURES / "llama" / "golden.npz")
    prompts = [lg["greedy_prompt"].tolist(), lg["prompt_1"].tolist()]
    params = SamplingParams(max_tokens=len(lg["greedy_tokens"]), temperature=0, ignore_eos=True)
    default = sampling_logits.REPLICATE_MAX_BYTES
    # The default layout last, its compiled steps kept for spec_decode_checks.
    for layout, limit in (("rows", 0), ("replicated", default)):
        sampling_logits.REPLICATE_MAX_BYTES = limit
        shared_jit.cache_clear()  # traced anew under this limit
        try:
            llm = LLM(str(FIXTURES / "llama"), tensor_parallel_size=2, dtype="float32",
                      max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64, block_size=4,
                      decode_steps_per_call=2, compilation_cache_dir=None)
            runner = llm.engine.runner
            runner.compiler.wait()  # (the decode loops compile in the background)
            found = {}
            for kind, table in (("sample", runner.programs.compiled["packed sample"]),
                                ("loop", runner.programs.compiled["decode loop"]),
                                ("forward", runner.programs.compiled["packed forward"])):
                for key, exe in table.items():
                    sites = collectives_in_control_flow(exe.as_text())
                    found[f"{kind} {key}"] = {
                        "conditional": [str(x) for x in sites if any(
                            i.startswith("conditional") for i in x.inside)],
                        "while": [str(x) for x in sites if any(i.startswith("while")
                                                               for i in x.inside)]}
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
            out[f"sampler_layout/{layout}"] = {"sites": found, "tokens": tokens}
        finally:
            sampling_logits.REPLICATE_MAX_BYTES = default
            if limit != default:
                shared_jit.cache_clear()


def _compiled_once(fn, name: str, found: dict):
    """The jitted `fn` run through its ahead-of-time compiled executable, one per call signature,
    each one's collectives inside control flow kept in `found`: the check reads the HLO of exactly
    what ran, compiled once."""
    from jaxinfer.bench.profile.hlo_collectives import collectives_in_control_flow
    executables = {}

    def call(*args, **static):
        key = (str(jax.tree_util.tree_map(lambda a: (np.shape(a), str(getattr(a, "sharding", ""))),
                                          args)), tuple(sorted(static.items())))
        if key not in executables:
            exe = executables[key] = fn.lower(*args, **static).compile()
            sites = collectives_in_control_flow(exe.as_text())
            variant = static.get("variant")
            label = "" if variant is None else " full" if variant.advanced else " base"
            found[f"{name} {len(found)}{label}"] = {
                "conditional": [str(x) for x in sites if any(i.startswith("conditional")
                                                             for i in x.inside)],
                "while": [str(x) for x in sites if any(i.startswith("while") for i in x.inside)]}
        return executables[key](*args)
    return call


def _spec_llm(model_dir, tp: int, **extra):
    return LLM(str(model_dir), tensor_parallel_size=tp, dtype="float32", max_num_seqs=4,
               max_num_batched_tokens=16, num_blocks=64, block_size=4, compilation_cache_dir=None,
               warmup=False, speculative_min_acceptance=0.0, **extra)


def _head_kv_diff(one, two) -> float:
    """The largest difference between two engines' EAGLE-3 / MTP head KV caches (K and V)."""
    a, b = (jax.tree_util.tree_leaves(e.engine.spec.speculator.proposer.kv_cache)
            for e in (one, two))
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max(initial=0)) for x, y in zip(a, b))


def spec_decode_checks(out: dict) -> None:
    """Speculative decoding at TP = 2, n-gram, a draft model (the llama fixture proposing for
    itself, split over the same two devices) and an EAGLE-3 head (random, replicated over them),
    per sampler layout as in `sampler_layout_checks`: the collectives inside a conditional or
    while loop of each verification step, draft loop, draft catch-up and speculative loop that
    ran (one request asks for logprobs: the full sampler variant), and the greedy tokens of the
    prompts of "llama/engine_tp1"; the head's KV cache against the same head's on one device.
    The engine flags are the sampler check's, so the forwards it compiled apply again (in one
    process, or through jax's persistent cache)."""
    from jaxinfer.parallel import sampling_logits
    from jaxinfer.spec_decode import eagle_head
    from jaxinfer.worker.programs import shared_jit
    from test_eagle3 import random_head
    lg = np.load(FIXTURES / "llama" / "golden.npz")
    prompts = [lg["greedy_prompt"].tolist(), lg["prompt_1"].tolist()]
    params = [SamplingParams(max_tokens=len(lg["greedy_tokens"]), temperature=0, ignore_eos=True,
                             logprobs=n) for n in (None, 2)]
    head_dir = tempfile.mkdtemp(prefix="eagle_tp_")
    head_cfg, head_params = random_head(load_config(FIXTURES / "llama"))
    eagle_head.save_head(head_params, head_cfg,
                         json.loads((FIXTURES / "llama" / "config.json").read_text()), head_dir)
    methods = {"ngram": dict(speculative_method="ngram"),
               "draft": dict(speculative_model=str(FIXTURES / "llama")),
               "eagle3": dict(speculative_method="eagle3", speculative_model=head_dir)}
    one_device = _spec_llm(FIXTURES / "llama", 1, num_speculative_tokens=3, **methods["eagle3"])
    one_device.generate(prompts, params, use_tqdm=False)
    default = sampling_logits.REPLICATE_MAX_BYTES
    for layout, limit in (("replicated", default), ("rows", 0)):
        sampling_logits.REPLICATE_MAX_BYTES = limit
        try:
            for method, extra in methods.items():
                shared_jit.cache_clear()  # traced anew under this limit
                llm = _spec_llm(FIXTURES / "llama", 2, num_speculative_tokens=3, **extra)
                programs, found = llm.engine.runner.programs.jitted, {}
                for program, name in (("verify", "verify"), ("draft propose", "draft_loop"),
                                      ("draft catch-up", "catch_up"), ("spec loop", "spec_loop"),
                                      ("eagle catch-up", "catch_up")):
                    if program in programs:
                        programs[program] = _compiled_once(programs[program], name, found)
                tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
                m = llm.engine.spec.metrics
                out[f"spec/{method}/{layout}"] = {"sites": found, "tokens": tokens,
                                                  "drafts": m.drafts, "accepted": m.accepted,
                                                  "draft_tokens": m.draft_tokens}
                if method == "eagle3":
                    out[f"spec/{method}/{layout}"]["head_kv_diff"] = _head_kv_diff(one_device, llm)
        finally:
            sampling_logits.REPLICATE_MAX_BYTES = default
            shared_jit.cache_clear()


def mtp_checks(out: dict) -> None:
    """DeepSeek-V3's MTP module (tests/test_mtp.py's fixture) proposing at TP = 2 and on one
    device: the greedy tokens of each and the largest difference between their module's KV."""
    from test_mtp import _with_mtp_module
    model = _with_mtp_module(Path(tempfile.mkdtemp(prefix="mtp_tp_")) / "dsv3_mtp")
    golden = np.load(model / "golden.npz")
    params = SamplingParams(max_tokens=len(golden["greedy_tokens"]), temperature=0,
                            ignore_eos=True)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    llms = [_spec_llm(model, tp, speculative_config=spec) for tp in (1, 2)]
    tokens = [llm.generate([golden["greedy_prompt"].tolist()], params,
                           use_tqdm=False)[0].outputs[0].token_ids for llm in llms]
    out["spec/mtp"] = {"tokens": tokens, "golden": golden["greedy_tokens"].tolist(),
                       "drafts": [llm.engine.spec.metrics.drafts for llm in llms],
                       "head_kv_diff": _head_kv_diff(*llms)}


def quant_shard_checks(out: dict) -> None:
    """FP8 weights quantized on load (safetensors and dummy) onto a TP = 2 mesh against the
    single-device load (the row-parallel channel maximum is reduced across the shards), and the
    shape of device 0's slice of each weight and scale of layer 0 (tests/test_parallel.py)."""
    for family, fmt in (("llama", "safetensors"), ("qwen3_moe", "safetensors"), ("llama", "dummy")):
        cfg = dataclasses.replace(load_config(FIXTURES / family), quantization="fp8")
        plan = ShardingPlan(build_mesh(2), cfg)
        sharded = load_params(FIXTURES / family, cfg, jnp.float32, fmt, progress=False,
                              shardings=plan.params(param_shapes(cfg, jnp.float32)))
        single = load_params(FIXTURES / family, cfg, jnp.float32, fmt, progress=False)
        same = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda a, b: a.dtype == b.dtype and bool((np.asarray(a) == np.asarray(b)).all()),
            sharded, single))
        shards = {"/".join(k.key for k in path): list(leaf.addressable_shards[0].data.shape)
                  for path, leaf in jax.tree_util.tree_flatten_with_path(sharded)[0]
                  if path[0].key == "layers_0"}
        out[f"quant/{family}/{fmt}"] = {"equal": all(same), "shards": shards}


def main() -> None:
    out: dict = {"devices": jax.device_count()}
    checks = (model_checks, hybrid_checks, shard_checks, engine_checks, llama_tp1_checks,
              sampler_layout_checks, spec_decode_checks, mtp_checks, executable_cache_checks,
              lora_checks, quant_shard_checks)
    if sys.argv[1:]:  # only the checks named (python tests/parallel_checks.py sampler_layout_checks)
        checks = [c for c in checks if c.__name__ in sys.argv[1:]]
    else:  # (engine_checks runs it)
        checks = [c for c in checks if c is not llama_tp1_checks]
    for check in checks:
        t0 = time.perf_counter()
        check(out)
        out[f"seconds/{check.__name__}"] = round(time.perf_counter() - t0, 1)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
