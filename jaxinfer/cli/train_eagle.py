"""`jaxinfer train-eagle`: train an EAGLE-3 head for a target model, in resumable time-boxed jobs.

    jaxinfer train-eagle --model checkpoints/demo-target --out checkpoints/demo-eagle3 \
        --work build/eagle_work --max-seconds 480 [--resume]

1. Data (first job; kept in WORK/data.npz): prompts cut from a corpus (`--corpus`: a text file or
   a directory of .py files; default the Python standard library, the demo target's domain), each
   continued by the target itself through the engine (greedy, or `--temperature`): the head learns
   the target's own outputs. Held out: the last `--eval-sequences`.
2. Head: hidden size, heads and rope of the target, one layer, the `--draft-vocab-size` most
   frequent tokens of the data (d2t), the target's embeddings (frozen, not stored).
3. Training: the TTT loss of `spec_decode/eagle_train.py` (`--k` unrolled steps), optax AdamW on
   float32 master weights with the forward in `--compute-dtype`, warmup + cosine over `--steps`.
   Orbax checkpoints (WORK/ckpt: weights, optimizer state, step) every `--save-every` steps and
   at the end; `--resume` continues from the newest one, so several short jobs (`--max-seconds`
   each) make one run. A tqdm bar shows the loss and step-0 agreement.
4. Output (each job): the head in the HF format vLLM / SGLang load (`--out`: config.json +
   model.safetensors; serve it with --speculative-config '{"method": "eagle3", "model": OUT}'),
   WORK/log.json (losses, held-out losses and per-step agreement with the target's greedy token)
   and the learning curve WORK/learning_curve.png (needs matplotlib; skipped without).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-eagle", help="train an EAGLE-3 speculative-decoding head for a "
                                           "model (resumable, time-boxed jobs)")
    p.add_argument("--model", required=True, help="the target model directory")
    p.add_argument("--out", required=True, help="where the head is written (HF format)")
    p.add_argument("--work", required=True, help="data, orbax checkpoints, log and plot")
    p.add_argument("--resume", action="store_true", help="continue from WORK's newest checkpoint")
    p.add_argument("--max-seconds", type=float, default=540.0,
                   help="stop (checkpointed) after this long, data generation included")
    p.add_argument("--steps", type=int, default=3000, help="the schedule's total steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--k", type=int, default=5, help="unrolled training-time-test steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="tokens the head proposes (default: the target's whole vocabulary)")
    p.add_argument("--corpus", default=None,
                   help="text file, directory of .py files, or .npy token stream (default: the "
                        "Python standard library)")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy continuations")
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def corpus_documents(corpus: str | None, limit: int, seed: int, tokenizer) -> list[list[int]]:
    """Up to `limit` documents as token ids: a text file (one document), a directory of .py
    files, or a .npy token stream split at the tokenizer's first EOS id (build_corpus.py's
    train.npy: the target's own training split, no held-out file among the prompts)."""
    path = Path(corpus or sysconfig.get_paths()["stdlib"])
    rng = np.random.default_rng(seed)
    if path.suffix == ".npy":
        stream = np.load(path).astype(np.int64)
        ends = np.flatnonzero(stream == tokenizer.eos_token_ids[0]) + 1
        docs = [d for d in np.split(stream, ends) if d.size]
        picked = rng.choice(len(docs), size=min(limit, len(docs)), replace=False)
        return [docs[i].tolist() for i in sorted(picked)]
    if path.is_file():
        return [tokenizer.encode(path.read_text(errors="replace"))]
    files = sorted(f for f in path.rglob("*.py") if "site-packages" not in f.parts)
    picked = rng.choice(len(files), size=min(limit, len(files)), replace=False)
    return [tokenizer.encode(files[i].read_text(errors="replace")) for i in sorted(picked)]


def generate_data(args, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Prompts from the corpus continued by the target: tokens i32[N, seq_len + 1], mask."""
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams
    rng = np.random.default_rng(args.seed)
    # Prompt starts uniform over the corpus's token positions (a long file gives more prompts
    # than a short one; num_prompts is not capped by the number of files).
    docs = [d for d in corpus_documents(args.corpus, args.num_prompts, args.seed, tokenizer)
            if len(d) > args.prompt_tokens]
    room = np.asarray([len(d) - args.prompt_tokens for d in docs], np.float64)
    which = rng.choice(len(docs), size=args.num_prompts, p=room / room.sum())
    prompts = []
    for i in which:
        start = int(rng.integers(0, len(docs[i]) - args.prompt_tokens))
        prompts.append(list(docs[i][start:start + args.prompt_tokens]))
    n_new = args.seq_len + 1 - args.prompt_tokens
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=args.seq_len + 8, max_num_seqs=256, warmup=False,
        compilation_cache_dir=None, seed=args.seed))
    out: dict[str, list[int]] = {}
    from tqdm.auto import tqdm
    bar = tqdm(total=len(prompts), desc="target continuations", unit="seq")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n_new, ignore_eos=True,
                                                     temperature=args.temperature,
                                                     seed=args.seed + i))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.prompt_token_ids + list(o.outputs[0].token_ids)
                bar.update(1)
    bar.close()
    tokens = np.zeros((len(prompts), args.seq_len + 1), np.int32)
    mask = np.zeros_like(tokens, np.float32)
    for i in range(len(prompts)):
        seq = out[str(i)][:args.seq_len + 1]
        tokens[i, :len(seq)], mask[i, :len(seq)] = seq, 1.0
    return tokens, mask


def plot(path: Path, log: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve plot")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*log["train"]), label="train TTT loss", alpha=0.6)
    if log["eval"]:
        ax.plot([e["step"] for e in log["eval"]], [e["loss"] for e in log["eval"]], "o-",
                label="held-out TTT loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def run(args) -> int:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    from jaxinfer.model.config import load_config
    from jaxinfer.model.tokenizer import load_tokenizer
    from jaxinfer.model.weights import load_params
    from jaxinfer.spec_decode import eagle_head as head
    from jaxinfer.spec_decode import eagle_train as train

    t0 = time.monotonic()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target_cfg = load_config(args.model)
    target_raw = json.loads((Path(args.model) / "config.json").read_text())
    data_path = work / "data.npz"
    if data_path.is_file():
        data = np.load(data_path)
        tokens, mask = data["tokens"], data["mask"].astype(np.float32)
    else:
        tokens, mask = generate_data(args, load_tokenizer(args.model))
        np.savez(data_path, tokens=tokens, mask=mask.astype(np.uint8))
    n_eval = min(args.eval_sequences, len(tokens) // 4)
    train_tok, train_mask = tokens[n_eval:], mask[n_eval:]
    eval_tok, eval_mask = tokens[:n_eval], mask[:n_eval]

    dtype = jnp.dtype(args.compute_dtype)
    target_params = load_params(args.model, target_cfg, dtype, progress=False)
    embed = target_params["embed"]["embedding"]
    vd = args.draft_vocab_size or target_cfg.vocab_size
    cfg = head.eagle3_config(dict(head_layer_config(target_cfg), draft_vocab_size=vd),
                             target_cfg)
    counts = np.bincount(train_tok[train_mask > 0].ravel(), minlength=target_cfg.vocab_size)
    hp = head.init_head(cfg, args.seed, jnp.float32)
    d2t = train.draft_vocab(counts, vd)
    settings = train.TrainSettings(k=args.k, lr=args.lr, warmup_steps=args.warmup_steps,
                                   total_steps=args.steps, compute_dtype=args.compute_dtype)
    step_fn, opt = train.make_train_step(cfg, target_cfg, settings)
    w = train.trainable(hp)
    state = {"w": w, "opt": opt.init(w), "step": jnp.zeros((), jnp.int32)}
    log_path = work / "log.json"
    log = {"train": [], "eval": [], "jobs": []}
    manager = ocp.CheckpointManager(work / "ckpt",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    if args.resume and manager.latest_step() is not None:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
        if log_path.is_file():
            log = json.loads(log_path.read_text())
    elif manager.latest_step() is not None:
        raise SystemExit(f"{work / 'ckpt'} holds checkpoints: pass --resume or a new --work")

    def save(step: int) -> None:
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
        log_path.write_text(json.dumps(log) + "\n")

    def evaluate(step: int) -> None:
        loss, agree = train.eval_loss(dict(state["w"], d2t=d2t), target_params, embed,
                                      jnp.asarray(eval_tok), jnp.asarray(eval_mask), cfg=cfg,
                                      target_cfg=target_cfg, k=args.k)
        log["eval"].append({"step": step, "loss": float(loss),
                            "agreement": [round(float(a), 4) for a in agree]})

    rng = np.random.default_rng(args.seed + int(state["step"]))
    start = int(state["step"])
    job = {"start_step": start, "started": time.time()}
    bar = tqdm(total=args.steps, initial=start, desc="train-eagle", unit="step")
    step = start
    while step < args.steps and time.monotonic() - t0 < args.max_seconds:
        rows = rng.integers(0, len(train_tok), args.batch_size)
        w2, opt_state, loss, agree = step_fn(state["w"], state["opt"], d2t, target_params, embed,
                                             jnp.asarray(train_tok[rows]),
                                             jnp.asarray(train_mask[rows]))
        step += 1
        state = {"w": w2, "opt": opt_state, "step": jnp.asarray(step, jnp.int32)}
        if step % 10 == 0 or step == args.steps:
            log["train"].append((step, float(loss)))
            bar.set_postfix(loss=f"{float(loss):.3f}", agree0=f"{float(agree[0]):.2f}")
        bar.update(1)
        if step % args.save_every == 0:
            evaluate(step)
            save(step)
    bar.close()
    if manager.latest_step() != step:
        evaluate(step)
        save(step)
    job.update(end_step=step, seconds=round(time.monotonic() - t0, 1))
    log["jobs"].append(job)
    log_path.write_text(json.dumps(log) + "\n")
    head.save_head(dict(state["w"], d2t=d2t), cfg, target_raw, args.out)
    plot(work / "learning_curve.png", log)
    last = log["eval"][-1]
    print(json.dumps({"step": step, "eval_loss": last["loss"], "agreement": last["agreement"],
                      "head": str(args.out), "done": step >= args.steps}))
    return 0


def head_layer_config(target) -> dict:
    """A head's config.json fields shaped like the target's layers."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope.theta,
            "max_position_embeddings": target.max_position_embeddings}
