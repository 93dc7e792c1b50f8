"""Train one of the bundled demo models (target or draft) on the corpus `build_corpus.py` makes.

Data: a grain pipeline over the training token stream: documents (stdlib files; with `--extra`,
each `--stdlib-repeat` times plus the extra training code of build_corpus.py once) shuffled with a
fixed seed, reshuffled every epoch, concatenated and split into packed sequences of seq_len + 1
tokens (`ConcatThenSplitIterDataset`; attention crosses document boundaries, which are marked by
<|endoftext|>, as in GPT-2's training), batched and prefetched on a thread.

Model: jaxinfer's own `train_forward` (Llama architecture, tied embeddings, GQA). Mixed precision:
float32 master weights and AdamW moments, bf16 forward/backward. AdamW's per-step updates
(lr * ~1 relative to weights of ~0.02) are below bf16's 8-bit mantissa resolution late in the
cosine, so bf16 master weights would stall; bf16 compute is what the server runs, so the eval
measures the numerics that ship. `--compute-dtype float32` for CPU runs (XLA:CPU bf16 is slow).

Distillation (`--teacher DIR`, for the draft): the loss mixes the cross-entropy against the data
with the cross-entropy against the teacher's next-token distribution (`--distill-weight`), the
teacher running in the same jitted step; matching the target's distribution is what raises the
draft's acceptance in speculative decoding.

Schedule: linear warmup, then cosine to `--final-lr-frac` of the peak (default 10%: the demo target
is under-trained at its time budget, and decaying to 0 over the same budget measured worse,
checkpoints/README.md).
Time-boxed (`--max-seconds`): after `PLAN_AT_STEP` steps the steady-state step time is measured
and the schedule's length fixed to the number of steps that fit before the deadline (capped by
`--max-steps`), leaving time for the final eval and saving; should the estimate prove optimistic,
training stops at the deadline anyway.
The chosen length is recorded, so `--max-steps N --max-seconds 0` replays a run's schedule.

Output: an HF-format directory (config.json, model.safetensors in bf16, generation_config.json,
tokenizer files) holding the weights with the lowest held-out loss seen at the periodic evals, and
training_log.json (config, schedule, losses, held-out perplexities, tokens, time).

    python checkpoints/train_demo.py --model target --out checkpoints/demo-target --max-seconds 170
    python checkpoints/train_demo.py --toy --data DIR --out DIR   # a few seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import grain
import grain.experimental as grain_exp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.transformer import init_params, train_forward
from jaxinfer.model.weights import load_params, save_safetensors

REPO = Path(__file__).resolve().parent.parent

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Steps TIMED_FROM_STEP..PLAN_AT_STEP are timed to fix the schedule's length. Not earlier: batches
# prefetched during compilation make the first ~20 steps look faster than the steady state (the
# committed models' run timed steps 10..30 and overestimated the steps that fit by 6% (target)
# and 33% (draft), so their cosines stopped early; see checkpoints/README.md).
TIMED_FROM_STEP, PLAN_AT_STEP = 50, 100
ENDOFTEXT_ID, IM_END_ID = 0, 2  # build_corpus.SPECIAL_TOKENS order

# HF config.json fields of each model (the rest is filled in by `hf_config`).
ARCHITECTURES = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "draft": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=64),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}
# Training hyperparameters per model; command-line flags override them.
HPARAMS = {
    "target": dict(seq_len=1024, batch_size=32, lr=1.5e-3, warmup_steps=200, eval_every=250),
    "draft": dict(seq_len=1024, batch_size=64, lr=3e-3, warmup_steps=200, eval_every=250),
    "toy": dict(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10),
}


def hf_config(arch: dict, vocab_size: int, max_positions: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **arch,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def split_documents(tokens: np.ndarray) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == ENDOFTEXT_ID) + 1
    return [d for d in np.split(tokens.astype(np.int32), ends) if d.size]


def training_batches(docs: list[np.ndarray], seq_len: int, batch_size: int, seed: int):
    """Endless iterator of int32 [batch, seq_len + 1] packed sequences (grain)."""
    ds = (grain.MapDataset.source(docs)
          .shuffle(seed=seed)
          .repeat(None)  # reshuffled every epoch
          .map(lambda doc: {"tokens": doc})
          .to_iter_dataset())
    ds = grain_exp.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    ds = ds.map(lambda ex: ex["tokens"]).batch(batch_size, drop_remainder=True)
    return grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=8).__iter__()


def heldout_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows from the start of the held-out stream."""
    n = min((tokens.size - 1) // seq_len, max_windows)
    if n < 1:
        raise SystemExit(f"held-out stream has {tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens.astype(np.int32)[idx]


def make_optimizer(weight_decay: float):
    def build(learning_rate):
        # No decay on norms (1-D weights): decaying them toward 0 fights the normalisation.
        decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                       mask=decay_mask))
    return optax.inject_hyperparams(build)(learning_rate=0.0)


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_steps(cfg, optimizer, compute_dtype, teacher_cfg=None, distill_weight: float = 0.0):
    """With `teacher_cfg`, train_step takes the teacher's params and the loss also matches the
    teacher's next-token distribution."""
    def loss_fn(params, batch, teacher_params):
        compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = train_forward(compute, cfg, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        if teacher_cfg is None:
            return loss
        t_logits = train_forward(teacher_params, teacher_cfg, batch[:, :-1]).astype(jnp.float32)
        soft = optax.softmax_cross_entropy(logits.astype(jnp.float32), jax.nn.softmax(t_logits)).mean()
        return (1 - distill_weight) * loss + distill_weight * soft

    @jax.jit
    def train_step(params, opt_state, batch, lr, teacher_params=None):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, teacher_params)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    @jax.jit
    def eval_loss_sum(params, batch, row_weight):
        """Sum of token cross-entropies over the rows with weight 1 (0 marks padding rows)."""
        compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = train_forward(compute, cfg, batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return (ce.sum(axis=-1) * row_weight).sum()

    return train_step, eval_loss_sum


def evaluate(eval_loss_sum, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean held-out cross-entropy (nats/token) over all windows. The last batch is padded to the
    compiled shape with weight-0 rows."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        n = len(chunk)
        weight = np.zeros(batch_size, np.float32)
        weight[:n] = 1.0
        if n < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - n, axis=0)])
        total += float(eval_loss_sum(params, chunk, weight))
        count += n * (windows.shape[1] - 1)
    return total / count


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("target", "draft"), default="target")
    p.add_argument("--toy", action="store_true", help="tiny model and shapes for a CPU smoke run")
    p.add_argument("--data", type=Path, default=REPO / "build" / "demo_corpus",
                   help="directory with train.npy, heldout.npy and tokenizer/ (build_corpus.py)")
    p.add_argument("--out", type=Path, required=True, help="HF-format output directory")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per eval")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--final-lr-frac", type=float, default=0.1,
                   help="learning rate at the end of the cosine, as a fraction of the peak")
    p.add_argument("--extra", action="store_true",
                   help="also train on extra_train.npy (third-party code; at the demo's time budget "
                        "it raised the stdlib held-out perplexity: checkpoints/README.md)")
    p.add_argument("--stdlib-repeat", type=int, default=2,
                   help="with --extra: copies of each stdlib document per epoch (extra code: one)")
    p.add_argument("--teacher", type=Path, help="HF model directory to distil from (same tokenizer)")
    p.add_argument("--distill-weight", type=float, default=0.9,
                   help="with --teacher: weight of the teacher cross-entropy in the loss")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--max-seconds", type=float, default=0,
                   help="wall-clock budget for the whole run, saving included (0: no limit)")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = "toy" if args.toy else args.model
    for key, value in HPARAMS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compute_dtype is None:
        args.compute_dtype = "float32" if args.toy else "bfloat16"
    for name in ("seq_len", "batch_size", "warmup_steps", "eval_every", "max_steps", "stdlib_repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.preset = preset
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.max_seconds if args.max_seconds > 0 else math.inf
    for f in ("train.npy", "heldout.npy", *(f"tokenizer/{n}" for n in TOKENIZER_FILES)):
        if not (args.data / f).is_file():
            raise SystemExit(f"--data {args.data}: missing {f} (run checkpoints/build_corpus.py)")
    train_tokens = np.load(args.data / "train.npy")
    docs = split_documents(train_tokens)
    epoch_tokens = train_tokens.size
    if args.extra:
        extra_docs = split_documents(np.load(args.data / "extra_train.npy"))
        docs = docs * args.stdlib_repeat + extra_docs
        epoch_tokens = args.stdlib_repeat * train_tokens.size + sum(d.size for d in extra_docs)
    windows = heldout_windows(np.load(args.data / "heldout.npy"), args.seq_len, args.eval_windows)
    vocab = json.loads((args.data / "tokenizer" / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"])

    raw_cfg = hf_config(ARCHITECTURES[args.preset], vocab_size, args.seq_len)
    cfg = config_from_dict(raw_cfg)
    compute_dtype = jnp.dtype(args.compute_dtype)
    params = init_params(cfg, jax.random.key(args.seed), jnp.float32)
    optimizer = make_optimizer(args.weight_decay)
    # Committed to the device, as every step's outputs are: uncommitted first arguments would
    # compile the step functions a second time at step 2.
    params, opt_state = jax.device_put((params, optimizer.init(params)), jax.devices()[0])
    t_cfg = t_params = None
    if args.teacher is not None:
        t_cfg = load_config(args.teacher)
        t_params = load_params(args.teacher, t_cfg, compute_dtype, progress=False)
    train_step, eval_loss_sum = build_steps(cfg, optimizer, compute_dtype, t_cfg, args.distill_weight)
    batches = training_batches(docs, args.seq_len, args.batch_size, args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    print(f"{args.preset}: {cfg.num_params():,} params, {epoch_tokens:,} training tokens per epoch "
          f"(extra code: {args.extra}), teacher {args.teacher}, "
          f"{len(windows)} held-out windows of {args.seq_len}, {tokens_per_step:,} tokens/step, "
          f"devices {jax.devices()}", flush=True)

    total_steps = args.max_steps
    t_eval = time.perf_counter()
    evaluate(eval_loss_sum, params, windows[:args.batch_size], args.batch_size)  # compiles
    log: dict = {"losses": [], "eval_compile_seconds": time.perf_counter() - t_eval}
    t_eval = time.perf_counter()
    initial = evaluate(eval_loss_sum, params, windows, args.batch_size)
    eval_seconds = time.perf_counter() - t_eval
    log["evals"] = [{"step": 0, "heldout_loss": initial, "heldout_ppl": math.exp(initial)}]
    best = (math.inf, None, -1)  # (held-out loss, host params, step)
    timed_from = None
    bar = tqdm(total=total_steps, desc=f"train {args.preset}", unit="step", mininterval=5.0)
    step = 0
    t_train = time.perf_counter()
    while step < total_steps:
        batch = next(batches)
        lr = lr_at(step, total_steps, args.lr, args.warmup_steps, args.final_lr_frac)
        params, opt_state, loss, gnorm = train_step(params, opt_state, batch, jnp.float32(lr), t_params)
        step += 1
        if step == 1:
            loss.block_until_ready()
            log["compile_seconds"] = time.perf_counter() - t_train
        if step == TIMED_FROM_STEP:
            loss.block_until_ready()
            timed_from = time.perf_counter()
        if step == PLAN_AT_STEP and math.isfinite(deadline):
            loss.block_until_ready()
            sec_per_step = (time.perf_counter() - timed_from) / (PLAN_AT_STEP - TIMED_FROM_STEP)
            # Reserve: the final eval + saving (~3 evals' worth) and one eval per eval_every steps.
            eval_est = max(eval_seconds, 0.5)
            left = deadline - time.perf_counter() - 3 * eval_est - 5.0
            fit = int(left / (sec_per_step + eval_est / args.eval_every))
            total_steps = max(PLAN_AT_STEP, min(args.max_steps, step + fit))
            bar.total = total_steps
            log["planned"] = {"sec_per_step": sec_per_step, "total_steps": total_steps}
        if step % 10 == 0 or step == total_steps:
            loss_f = float(loss)
            if not math.isfinite(loss_f):
                raise SystemExit(f"step {step}: loss is {loss_f}; lower --lr (now {args.lr})")
            log["losses"].append({"step": step, "loss": loss_f, "lr": lr, "grad_norm": float(gnorm)})
            bar.set_postfix(loss=f"{loss_f:.3f}", lr=f"{lr:.2e}")
        bar.update(1)
        out_of_time = time.perf_counter() > deadline and step < total_steps
        if step % args.eval_every == 0 or step == total_steps or out_of_time:
            t_eval = time.perf_counter()
            heldout = evaluate(eval_loss_sum, params, windows, args.batch_size)
            eval_seconds = time.perf_counter() - t_eval
            log["evals"].append({"step": step, "heldout_loss": heldout, "heldout_ppl": math.exp(heldout)})
            tqdm.write(f"step {step}: held-out loss {heldout:.4f} (ppl {math.exp(heldout):.2f})")
            if heldout < best[0]:
                best = (heldout, jax.device_get(params), step)
        if out_of_time:
            tqdm.write(f"deadline reached at step {step} of {total_steps}; stopping")
            break
    bar.close()
    batches.close()  # stop grain's prefetch thread before interpreter shutdown
    train_seconds = time.perf_counter() - t_train

    save_model_dir(args, raw_cfg, cfg, best[1])
    summary = {
        "model": args.preset,
        "params": cfg.num_params(),
        "config": raw_cfg,
        "hparams": {k: str(v) if isinstance(v, Path) else v for k, v in (
            (k, getattr(args, k)) for k in ("seq_len", "batch_size", "lr", "warmup_steps", "weight_decay",
                                            "final_lr_frac", "extra", "stdlib_repeat", "teacher",
                                            "distill_weight", "eval_windows", "seed", "compute_dtype",
                                            "max_steps", "max_seconds"))},
        "epoch_tokens": epoch_tokens,
        "steps": step,
        "schedule_steps": total_steps,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / epoch_tokens,
        "train_seconds": train_seconds,
        "tokens_per_second": (step - 1) * tokens_per_step / max(train_seconds - log["compile_seconds"], 1e-9),
        "saved_step": best[2],
        "heldout_loss": best[0],
        "heldout_ppl": math.exp(best[0]),
        "heldout_tokens": int(windows.size - len(windows)),
        "device": str(jax.devices()[0].device_kind),
        **log,
    }
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{args.preset}: {step} steps, {summary['tokens_seen']:,} tokens ({summary['epochs']:.2f} epochs) "
          f"in {train_seconds:.1f} s ({summary['tokens_per_second']:,.0f} tok/s); saved step {best[2]}: "
          f"held-out loss {best[0]:.4f}, ppl {math.exp(best[0]):.2f} -> {args.out}", flush=True)
    return summary


def save_model_dir(args, raw_cfg: dict, cfg, params) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    bf16 = jax.tree.map(lambda p: np.asarray(p).astype(jnp.bfloat16), params)
    save_safetensors(bf16, cfg, args.out)
    (args.out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:  # generation_config.json (eos ids) comes with the tokenizer
        shutil.copyfile(args.data / "tokenizer" / name, args.out / name)


if __name__ == "__main__":
    main()
